"""The engine worker: the only process that links llama.cpp. ``python -m engine_bridge.worker``.

It answers protocol requests on stdin/stdout (see :mod:`engine_bridge.protocol`). The protocol keeps
the original stdout; file descriptor 1 is pointed at stderr so that nothing native can corrupt it.
A native crash kills only this process: its client reports a typed error.

Requests are read by a reader thread into a queue, so the worker keeps accepting requests while it
generates. The main thread drains the queue (cheap ops are answered at once, ``generate`` is admitted
into the serving engine, :mod:`engine_bridge.batch`), then runs one batched decode step, and blocks on
the queue only when nothing is generating. Blocking ops (load, timed_run, ...) run on the main thread
and pause generation while they run. ``tokenize`` and ``detokenize`` of a serving engine only read its
vocabulary: the reader thread answers them itself, while the main thread decodes, so a new request's
prompt is not tokenized one decode step late.
"""

# ruff: noqa: I001  (llama_cpp is imported first on purpose: see below)
from __future__ import annotations

# llama_cpp must be loaded before numpy: on the H200 image (numpy 2.5, CUDA 13 build) importing numpy
# first makes the first model load segfault (measured: numpy-first crashes, llama_cpp-first loads).
import llama_cpp  # noqa: F401

import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from engine_bridge.errors import EngineError
from engine_bridge.params import EngineParams
from engine_bridge.protocol import PROTOCOL_VERSION, decode, encode

Op = Callable[["Worker", dict[str, Any]], dict[str, Any]]
StreamOp = Callable[["Worker", int, dict[str, Any]], None]
log = logging.getLogger(__name__)
_EOF = object()


class Worker:
    """State of one worker process: at most one loaded model (``load``) or serving engine (``serve_load``).

    It is also the serving engine's :class:`~engine_bridge.batch.Sink`: events and results go to the protocol.
    """

    def __init__(self, out: BinaryIO, fault: str | None = None) -> None:
        self.out = out
        self.fault = fault  # FLUX_WORKER_FAULT: "abort-on-load" crashes like a native fault would
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

    def event(self, key: int, event: dict[str, Any]) -> None:
        """One streamed event of request ``key``."""
        self.send({"id": key, "event": event})

    def done(self, key: int, result: dict[str, Any]) -> None:
        """The final result of request ``key``."""
        self.send({"id": key, "ok": True, "result": result})

    def fail(self, key: int, code: str, message: str) -> None:
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

    def answer_now(self, msg: dict[str, Any]) -> bool:
        """Answer a vocabulary op on the calling (reader) thread; False when it must wait in the queue (no
        serving engine, or one being made or freed)."""
        if not self.engine_lock.acquire(blocking=False):
            return False
        try:
            if self.engine is None:
                return False
            handle(self, msg)
            return True
        finally:
            self.engine_lock.release()

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


def op_hello(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Versions, so the client can refuse a stale worker."""
    return {"protocol": PROTOCOL_VERSION, "pid": os.getpid(), "python": sys.version.split()[0]}


def op_devices(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """The ggml devices this build sees."""
    from engine_bridge.native import list_devices

    return {"devices": [d.model_dump() for d in list_devices()]}


def op_load(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Load a model with EngineParams; replaces a loaded one."""
    from engine_bridge.native import NativeModel

    w.unload()
    params = EngineParams.model_validate(args["params"])
    if w.fault == "abort-on-load":
        os.abort()
    t0 = time.perf_counter()
    w.model = NativeModel(Path(args["model"]), params, logits_all=bool(args.get("logits_all", False)))
    return {"load_ms": (time.perf_counter() - t0) * 1e3, "n_ctx": w.model.n_ctx, "n_vocab": w.model.n_vocab}


def op_tokenize(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Tokens of a text (special tokens parsed unless ``special`` is false; BOS only with ``add_special``)."""
    special = bool(args.get("special", True))
    if w.engine is not None:
        return {"tokens": w.engine.vocab.tokenize(args["text"], special, bool(args.get("add_special", False)))}
    return {"tokens": w.need_model().tokenize(args["text"], special=special)}


def op_detokenize(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Text of tokens (invalid UTF-8 replaced; control tokens rendered only with ``special``)."""
    tokens = [int(t) for t in args["tokens"]]
    if w.engine is not None:
        return {"text": w.engine.vocab.detokenize(tokens, bool(args.get("special", False)))}
    return {"text": w.need_model().detokenize(tokens)}


def op_serve_load(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Load a model for serving: one context with n_seq_max sequences of n_ctx tokens each."""
    from engine_bridge.batch import ServeEngine

    w.unload()
    params = EngineParams.model_validate(args["params"])
    with w.engine_lock:
        w.engine = ServeEngine(Path(args["model"]), params, int(args.get("park_bytes", 0)), w)
    return dict(w.engine.info())


def op_generate(w: Worker, key: int, args: dict[str, Any]) -> None:
    """Admit a generation; its events and result are sent by the engine as it runs."""
    w.need_engine().submit(key, args)


def op_cancel(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Finish a running generation now (finish_reason "cancelled")."""
    return {"cancelled": w.need_engine().cancel(str(args["rid"]))}


def op_serve_stats(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Counters and memory of the serving engine."""
    return dict(w.need_engine().stats())


def op_timed_run(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Prefill + greedy decode with llama.cpp's timings."""
    t = w.need_model().timed_run([int(x) for x in args["prompt"]], int(args["n_gen"]))
    return t.model_dump()


def op_greedy(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Greedy continuation tokens and their text."""
    m = w.need_model()
    toks = m.greedy([int(x) for x in args["prompt"]], int(args["n_gen"]), bool(args.get("stop_eog", True)))
    return {"tokens": toks, "text": m.detokenize(toks)}


def op_logprobs(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Write the log-softmax rows before each continuation token to an .npy file (too big for JSON)."""
    lp = w.need_model().logprobs([int(x) for x in args["prompt"]], [int(x) for x in args["continuation"]])
    out = Path(args["out"])
    tmp = out.with_suffix(".tmp.npy")
    np.save(tmp, lp.astype(np.float32))
    os.replace(tmp, out)
    return {"rows": int(lp.shape[0]), "path": str(out)}


def op_chat(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """One non-streaming chat completion."""
    return w.need_model().chat(args["messages"], int(args.get("max_tokens", 16)),
                               float(args.get("temperature", 0.0)))


def op_routing_counts(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Per-layer expert selection counts over prompts prefilled and decoded (``RoutingRequest`` -> ``RoutingCounts``).

    The model is loaded for the trace with the request's params and freed after; a loaded model is unloaded first.
    """
    from engine_bridge.routing import trace
    from engine_bridge.routing_trace import RoutingRequest

    w.unload()
    return trace(RoutingRequest.model_validate(args)).model_dump()


def op_abort(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Die like a native crash would (fault injection for tests and the soak suite)."""
    os.abort()


OPS: dict[str, Op] = {"hello": op_hello, "devices": op_devices, "load": op_load, "tokenize": op_tokenize,
                      "timed_run": op_timed_run, "greedy": op_greedy, "logprobs": op_logprobs,
                      "chat": op_chat, "abort": op_abort, "detokenize": op_detokenize,
                      "serve_load": op_serve_load, "cancel": op_cancel, "serve_stats": op_serve_stats,
                      "routing_counts": op_routing_counts}
STREAM_OPS: dict[str, StreamOp] = {"generate": op_generate}
READER_OPS = frozenset({"tokenize", "detokenize"})  # answered by the reader thread while serving


def handle(w: Worker, msg: dict[str, Any]) -> bool:
    """Answer one request; False when the client asked to shut down."""
    rid, op = msg["id"], msg.get("op", "")
    if op == "shutdown":
        if w.engine is not None:
            w.engine.cancel_all()
        w.send({"id": rid, "ok": True, "result": {}})
        return False
    fn = OPS.get(op)
    try:
        if op in STREAM_OPS:
            STREAM_OPS[op](w, rid, msg.get("args") or {})
            return True
        if fn is None:
            raise EngineError("unknown_op", f"unknown op {op!r}")
        w.send({"id": rid, "ok": True, "result": fn(w, msg.get("args") or {})})
    except EngineError as exc:
        w.send({"id": rid, "ok": False, "error": {"code": exc.code, "message": exc.message}})
    except Exception as exc:  # noqa: BLE001 - any failure of one request is reported, the worker lives on
        w.send({"id": rid, "ok": False, "error": {"code": type(exc).__name__, "message": str(exc)}})
    return True


def _lines(fd: int) -> Iterator[bytes]:
    """Lines read from a raw descriptor.

    Not ``sys.stdin.buffer``: a daemon thread blocked inside a buffered reader holds its lock, and the
    interpreter aborts at exit when it cannot take that lock ("could not acquire lock ... at interpreter
    shutdown"); a thread blocked in ``os.read`` holds nothing.
    """
    buf = bytearray()
    while chunk := os.read(fd, 1 << 16):
        buf += chunk
        while (nl := buf.find(b"\n")) >= 0:
            yield bytes(buf[:nl + 1])
            del buf[:nl + 1]
    if buf:
        yield bytes(buf)


def _read(fd: int, inbox: queue.Queue[Any], w: Worker) -> None:
    """Reader thread: parse request lines into ``inbox``; EOF ends the worker."""
    for line in _lines(fd):
        if not line.strip():
            continue
        try:
            msg = decode(line)
        except ValueError as exc:
            w.send({"id": -1, "ok": False, "error": {"code": "bad_request", "message": str(exc)}})
            continue
        if msg.get("op") in READER_OPS and w.answer_now(msg):
            continue
        inbox.put(msg)
    inbox.put(_EOF)


def _step(w: Worker) -> None:
    """One engine step; an unexpected error fails the running requests, not the worker."""
    try:
        w.engine.step()
    except Exception as exc:  # noqa: BLE001 - a bug in one step must not take every client down
        log.exception("engine step failed")
        w.engine.fail_all("internal", f"engine step failed: {type(exc).__name__}: {exc}")


def serve(w: Worker, inbox: queue.Queue[Any]) -> int:
    """The main loop: answer every queued request, then one engine step; block only when idle."""
    while True:
        busy = w.engine is not None and w.engine.has_work()
        try:
            msg = inbox.get(block=not busy)
        except queue.Empty:
            msg = None
        while msg is not None:
            if msg is _EOF or not handle(w, msg):
                return 0
            try:
                msg = inbox.get_nowait()
            except queue.Empty:
                msg = None
        if w.engine is not None and w.engine.has_work():
            _step(w)


def main() -> int:
    """Serve requests from stdin until EOF or shutdown."""
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # native code printing to stdout now lands in the log, not in the protocol
    sys.stdout = sys.stderr
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    w = Worker(proto, fault=os.environ.get("FLUX_WORKER_FAULT"))
    inbox: queue.Queue[Any] = queue.Queue()
    threading.Thread(target=_read, args=(sys.stdin.fileno(), inbox, w), daemon=True, name="stdin-reader").start()
    return serve(w, inbox)


if __name__ == "__main__":
    sys.exit(main())
