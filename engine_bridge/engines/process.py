"""One engine process on a loopback port: started from its spec, healthy when it answers, stopped as a group.

The process runs in its own session (stopping it stops what it started); its output goes to a log file whose
tail is quoted when it does not start. It is healthy once ``/health`` or ``/v1/models`` answers 200.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from artifacts.engine_spec import EngineSpec
from engine_bridge.engines.spec import HOST, launch
from engine_bridge.errors import EngineError
from engine_bridge.llama_server import answers, free_port
from engine_bridge.procgroup import ManagedProcess, OwnsProcess

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


class EngineProcess(OwnsProcess):
    """An engine of ``spec`` serving ``model`` with the placement ``params`` on 127.0.0.1."""

    def __init__(self, spec: EngineSpec, model: str, params: EngineParams, *, log_path: Path | None,
                 env: Mapping[str, str] | None = None, drafting: Drafting | None = None) -> None:
        """Describe the process; nothing starts before :meth:`start`."""
        self.spec, self.model, self.params, self.drafting = spec, model, params, drafting
        self.log_path, self.extra_env = log_path, dict(env or {})
        self.child: ManagedProcess | None = None
        self.port: int | None = None

    @property
    def base(self) -> str:
        """The engine's base URL."""
        return f"http://{HOST}:{self.port}"

    def start(self) -> float:
        """Launch the engine and wait until it answers; returns the seconds that took.

        Raises:
            EngineStartError: the command could not run, exited, or did not answer within ``start_timeout_s``.
        """
        self.port = free_port()
        argv, env = launch(self.spec, self.model, self.params, self.port, self.drafting)
        log.debug("starting engine %s: %s", self.spec.name, " ".join(argv))
        t0 = time.monotonic()
        child = self.child = ManagedProcess(argv, log_path=self.log_path, env={**env, **self.extra_env})
        try:
            child.start()
        except OSError as exc:
            self.stop()
            raise EngineStartError(self.spec.name, f"its command {argv[0]!r} did not start: {exc.strerror or exc}") from None
        state = child.wait_ready(answers(self.base, HEALTH_PATHS), self.spec.start_timeout_s, since=t0)
        if state == "exited":
            raise EngineStartError(self.spec.name, f"exited with code {child.returncode} before answering"
                                                   f"{child.log_note(400, 3)}")
        if state == "ready":
            return time.monotonic() - t0
        self.stop()
        raise EngineStartError(self.spec.name, f"did not answer /health or /v1/models on port {self.port} within "
                                               f"{self.spec.start_timeout_s:g} s{child.log_note(400, 3)}")

    def exited(self, wait_s: float) -> bool:
        """True when the process has exited, or exits within ``wait_s``."""
        return self.child is None or self.child.exited(wait_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the process group: SIGTERM, then SIGKILL after ``timeout_s`` (idempotent)."""
        if self.child is not None:
            self.child.stop(timeout_s)
