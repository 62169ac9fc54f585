"""Child processes run in their own session (llama-server, configured engines): stopping one stops everything
it started, and the tail of its log file says why it did not start."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def stop_group(proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    """Stop ``proc``'s process group: SIGTERM, then SIGKILL after ``timeout_s`` (nothing when it has exited)."""
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(path: Path | None, n_bytes: int, n_lines: int) -> str:
    """The last ``n_lines`` non-empty lines within the last ``n_bytes`` of ``path``, as one line ('' without)."""
    if path is None or not path.is_file():
        return ""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - n_bytes))
        text = f.read().decode("utf-8", errors="replace")
    return " | ".join(line.strip() for line in text.splitlines()[-n_lines:] if line.strip())
