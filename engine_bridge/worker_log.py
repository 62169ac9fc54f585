"""A worker's log file, read back by the clients that started it (engine_bridge.client, engine_bridge.aclient)."""

from __future__ import annotations

import os
from pathlib import Path

TAIL_BYTES = 65536  # how much of the log's end is read for the worker's last words


def last_words(log_path: Path | None, start: int = 0) -> str:
    """The worker's last words in its log since byte ``start``: the assertion or error that ended it when it left
    one (a backtrace follows ggml's), else its last line ("" without a log)."""
    if log_path is None or not log_path.exists():
        return ""
    with log_path.open("rb") as f:
        f.seek(max(start, f.seek(0, os.SEEK_END) - TAIL_BYTES))
        lines = f.read().decode("utf-8", errors="replace").strip().splitlines()
    fatal = [x for x in lines if "GGML_ASSERT(" in x or "GGML_ABORT" in x or ": error: " in x]
    return (fatal or lines or [""])[-1].strip()
