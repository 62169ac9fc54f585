"""The worker (engine_bridge.client), llama-server and configured engines each run as one :class:`ManagedProcess`:
started in its own session (stopping it stops everything it started) with its output in its log file, waited on
until a readiness check passes, stopped politely and then killed as a group, and reaped. The tail of its log
says why it did not start."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Literal, Self

from engine_bridge.worker_log import last_words

Readiness = Literal["ready", "exited", "timeout"]


def log_tail(path: Path | None, n_bytes: int, n_lines: int) -> str:
    """The last ``n_lines`` non-empty lines within the last ``n_bytes`` of ``path``, as one line ('' without)."""
    if path is None or not path.is_file():
        return ""
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - n_bytes))
        text = f.read().decode("utf-8", errors="replace")
    return " | ".join(line.strip() for line in text.splitlines()[-n_lines:] if line.strip())


def _signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to the process group ``pgid``; False when the group is gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):  # gone, or only members no longer ours are left
        return False
    return True


class StartStop:
    """With-block use of something started and stopped: :meth:`start` on entry, :meth:`stop` on the way out."""

    def start(self) -> object:
        """Start it (each subclass says what this returns)."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stop it (idempotent)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ManagedProcess(StartStop):
    """One child process in its own process group, its output appended to ``log_path`` (None discards it).

    With ``pipes`` the child's stdin and stdout are pipes to the parent and its stderr goes to the log (the
    worker's JSON-lines protocol); without, its stdin is empty and stdout and stderr both go to the log (a server).
    ``env`` is added to this process's environment. :meth:`stop` sends ``stop_signal`` to the group first.
    """

    def __init__(self, argv: Sequence[str], *, log_path: Path | None = None, env: Mapping[str, str] | None = None,
                 cwd: Path | None = None, pipes: bool = False, stop_signal: int = signal.SIGTERM) -> None:
        self.argv, self.log_path, self.env, self.cwd = list(argv), log_path, dict(env or {}), cwd
        self.pipes, self.stop_signal = pipes, stop_signal
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_start = 0  # a log is shared by successive children: this one's words start here
        self._log: IO[bytes] | None = None

    # -- start ----------------------------------------------------------------------------------------
    def start(self) -> subprocess.Popen[bytes]:
        """Open the log (appending) and spawn the child in a new session.

        Raises:
            OSError: the command could not run (the log is closed again).
        """
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("ab")
            self.log_start = self._log.tell()
        log = self._log if self._log is not None else subprocess.DEVNULL
        stdin, stdout, stderr = ((subprocess.PIPE, subprocess.PIPE, log) if self.pipes
                                 else (subprocess.DEVNULL, log, subprocess.STDOUT))
        try:
            self.proc = subprocess.Popen(self.argv, stdin=stdin, stdout=stdout, stderr=stderr,
                                         env={**os.environ, **self.env}, start_new_session=True,
                                         cwd=str(self.cwd) if self.cwd is not None else None)
        except OSError:
            self.close_log()
            raise
        return self.proc

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float, *, since: float | None = None,
                   poll_s: float = 0.1) -> Readiness:
        """Poll ``ready()`` every ``poll_s`` until it is true ('ready'), the child exits ('exited') or
        ``timeout_s`` has passed since ``since`` (a ``time.monotonic()`` reading; now by default: 'timeout')."""
        t0 = time.monotonic() if since is None else since
        while time.monotonic() - t0 < timeout_s:
            if not self.alive:
                return "exited"
            if ready():
                return "ready"
            time.sleep(poll_s)
        return "timeout"

    # -- state ----------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """True while the child runs."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The child's process id (and its process group's)."""
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        """The child's exit status once it has exited (negative: killed by that signal)."""
        return self.proc.poll() if self.proc is not None else None

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait for the child to exit (at most ``timeout_s``); its exit status, None while it still runs (or
        before it starts)."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def exited(self, wait_s: float) -> bool:
        """True when the child has exited (or never started), or exits within ``wait_s``."""
        return self.proc is None or self.wait(wait_s) is not None

    # -- its log --------------------------------------------------------------------------------------
    def tail(self, n_bytes: int, n_lines: int) -> str:
        """The last ``n_lines`` non-empty lines within the last ``n_bytes`` of the log, as one line."""
        return log_tail(self.log_path, n_bytes, n_lines)

    def log_note(self, n_bytes: int, n_lines: int) -> str:
        """``"; log PATH: <its tail>"`` for an error message ('' when the log is empty or there is none)."""
        tail = self.tail(n_bytes, n_lines)
        return f"; log {self.log_path}: {tail}" if tail else ""

    def last_words(self) -> str:
        """This child's last words in its log since it started: the assertion or error that ended it when it left
        one, else its last line."""
        return last_words(self.log_path, self.log_start)

    def close_log(self) -> None:
        """Close the parent's handle of the log (the child keeps its own)."""
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- stop -----------------------------------------------------------------------------------------
    def stop(self, grace_s: float = 10.0) -> None:
        """Send ``stop_signal`` to the group, wait up to ``grace_s`` for the child, then SIGKILL what is left of the
        group (the child, and what it started) and reap the child. Idempotent."""
        proc = self.proc
        if proc is not None and proc.poll() is None and _signal_group(proc.pid, self.stop_signal):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        self.close_log()

    def kill(self) -> None:
        """SIGKILL the child's group now and reap the child. Idempotent."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        self.close_log()


class OwnsProcess(StartStop):
    """A class that runs one :class:`ManagedProcess` (``self.child``; None before it starts): its state is the
    child's."""

    child: ManagedProcess | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The child's ``Popen`` (None before it starts)."""
        return self.child.proc if self.child is not None else None

    @property
    def alive(self) -> bool:
        """True while the child runs."""
        return self.child is not None and self.child.alive

    @property
    def pid(self) -> int | None:
        """The child's process id."""
        return self.child.pid if self.child is not None else None
