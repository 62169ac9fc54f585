"""One engine process on a loopback port: started from its spec, healthy when it answers, stopped as a group.

The process runs in its own session (stopping it stops what it started); its output goes to a log file whose
tail is quoted when it does not start. It is healthy once ``/health`` or ``/v1/models`` answers 200.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

import httpx

from engine_bridge.drafting import Drafting
from engine_bridge.engines.spec import HOST, EngineSpec, launch
from engine_bridge.errors import EngineError
from engine_bridge.llama_server import free_port
from engine_bridge.params import EngineParams
from engine_bridge.procgroup import log_tail, stop_group

log = logging.getLogger(__name__)
HEALTH_PATHS = ("/health", "/v1/models")


def peak_rss(pid: int | None) -> int | None:
    """VmHWM of a process (its peak resident set), from /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class EngineStartError(EngineError):
    """The engine's command did not start, exited, or did not answer within its start timeout."""

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        super().__init__("load_failed", f"engine {name}: {message}")


class EngineProcess:
    """An engine of ``spec`` serving ``model`` with the placement ``params`` on 127.0.0.1."""

    def __init__(self, spec: EngineSpec, model: str, params: EngineParams, *, log_path: Path | None,
                 env: Mapping[str, str] | None = None, drafting: Drafting | None = None) -> None:
        """Describe the process; nothing starts before :meth:`start`."""
        self.spec, self.model, self.params, self.drafting = spec, model, params, drafting
        self.log_path, self.extra_env = log_path, dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self._log: IO[bytes] | None = None

    @property
    def base(self) -> str:
        """The engine's base URL."""
        return f"http://{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The engine's process id."""
        return self.proc.pid if self.proc is not None else None

    def start(self) -> float:
        """Launch the engine and wait until it answers; returns the seconds that took.

        Raises:
            EngineStartError: the command could not run, exited, or did not answer within ``start_timeout_s``.
        """
        self.port = free_port()
        argv, env = launch(self.spec, self.model, self.params, self.port, self.drafting)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = self.log_path.open("ab")
        out = self._log if self._log is not None else subprocess.DEVNULL
        log.debug("starting engine %s: %s", self.spec.name, " ".join(argv))
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         env={**os.environ, **env, **self.extra_env}, start_new_session=True)
        except OSError as exc:
            self.stop()
            raise EngineStartError(self.spec.name, f"its command {argv[0]!r} did not start: {exc.strerror or exc}") from None
        while time.monotonic() - t0 < self.spec.start_timeout_s:
            if not self.alive:
                code = self.proc.poll() if self.proc is not None else None
                raise EngineStartError(self.spec.name, f"exited with code {code} before answering{self._tail()}")
            if self._healthy():
                return time.monotonic() - t0
            time.sleep(0.1)
        self.stop()
        raise EngineStartError(self.spec.name, f"did not answer /health or /v1/models on port {self.port} within "
                                               f"{self.spec.start_timeout_s:g} s{self._tail()}")

    def _healthy(self) -> bool:
        for path in HEALTH_PATHS:
            try:
                if httpx.get(self.base + path, timeout=2.0).status_code == 200:
                    return True
            except httpx.HTTPError:
                continue
        return False

    def _tail(self, n_bytes: int = 400) -> str:
        """The last lines of the engine's log, as one line (with a leading '; ')."""
        tail = log_tail(self.log_path, n_bytes, 3)
        return f"; log {self.log_path}: {tail}" if tail else ""

    def exited(self, wait_s: float) -> bool:
        """True when the process has exited, or exits within ``wait_s``."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the process group: SIGTERM, then SIGKILL after ``timeout_s`` (idempotent)."""
        stop_group(self.proc, timeout_s)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> EngineProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
