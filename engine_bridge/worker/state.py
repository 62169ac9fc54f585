"""The worker process's state: what it has loaded, and how it writes protocol lines."""

from __future__ import annotations

import threading
from typing import Any, BinaryIO

from engine_bridge import ops
from engine_bridge.errors import EngineCode, EngineError
from engine_bridge.protocol import encode


class Worker:
    """State of one worker process: at most one loaded model (``load``) or serving engine (``serve_load``).

    It is also the serving engine's :class:`~engine_bridge.worker.sequences.Sink`: events and results go to the protocol.
    """

    def __init__(self, out: BinaryIO, fault: str | None = None) -> None:
        self.out = out
        self.fault = fault  # FLUX_WORKER_FAULT: "abort-on-load" or "abort-on-trace" crash like a native fault
        self.model: Any = None
        self.engine: Any = None
        self._lock = threading.Lock()
        self.engine_lock = threading.Lock()  # held while the serving engine is made or freed

    def send(self, msg: dict[str, Any]) -> None:
        """Write one protocol line (serialized: the reader thread reports bad lines itself)."""
        data = encode(msg)
        with self._lock:
            self.out.write(data)
            self.out.flush()

    def event(self, key: int, event: ops.TokenEvent | ops.PrefillEvent) -> None:
        """One streamed event of request ``key``."""
        self.send({"id": key, "event": event})

    def done(self, key: int, result: dict[str, Any]) -> None:
        """The final result of request ``key``."""
        self.send({"id": key, "ok": True, "result": result})

    def fail(self, key: int, code: EngineCode, message: str) -> None:
        """The final error of request ``key``."""
        self.send({"id": key, "ok": False, "error": {"code": code, "message": message}})

    def unload(self) -> None:
        """Free the loaded model and the serving engine."""
        if self.model is not None:
            self.model.close()
            self.model = None
        if self.engine is not None:
            with self.engine_lock:
                self.engine.cancel_all()
                self.engine.close()
                self.engine = None

    def need_engine(self) -> Any:
        """The serving engine, or a typed error."""
        if self.engine is None:
            raise EngineError("not_loaded", "no serving engine: send 'serve_load' first")
        return self.engine

    def need_model(self) -> Any:
        """The loaded model, or a typed error."""
        if self.model is None:
            raise EngineError("not_loaded", "no model loaded: send 'load' first")
        return self.model
