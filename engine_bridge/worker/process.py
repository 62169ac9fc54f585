"""The engine worker process: the only process that links llama.cpp. ``python -m engine_bridge.worker``.

It answers protocol requests on stdin/stdout (the line format of :mod:`engine_bridge.protocol`, the ops of
:mod:`engine_bridge.ops`, answered by :mod:`engine_bridge.worker.handlers`). The protocol keeps
the original stdout; file descriptor 1 is pointed at stderr so that nothing native can corrupt it.
A native crash kills only this process: its client reports a typed error.

Requests are read by a reader thread into a queue, so the worker keeps accepting requests while it
generates. The main thread drains the queue (cheap ops are answered at once, ``generate`` is admitted
into the serving engine, :mod:`engine_bridge.worker.serving`), then runs one batched decode step, and blocks on
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
from collections.abc import Iterator
from typing import Any

from engine_bridge import ops
from engine_bridge.errors import EngineError
from engine_bridge.protocol import decode
from engine_bridge.worker.handlers import HANDLERS, STREAM_HANDLERS, check, payload
from engine_bridge.worker.state import Worker

log = logging.getLogger(__name__)
_EOF = object()


def handle(w: Worker, msg: dict[str, Any]) -> bool:
    """Answer one request; False when the client asked to shut down."""
    rid, op, raw = msg["id"], msg.get("op", ""), msg.get("args") or {}
    if op == ops.SHUTDOWN.name:
        if w.engine is not None:
            w.engine.cancel_all()
        w.send({"id": rid, "ok": True, "result": {}})
        return False
    try:
        if op in STREAM_HANDLERS:
            spec, stream = STREAM_HANDLERS[op]
            stream(w, rid, check(spec, raw))
            return True
        if op not in HANDLERS:
            raise EngineError("unknown_op", f"unknown op {op!r}")
        spec, fn = HANDLERS[op]
        w.send({"id": rid, "ok": True, "result": payload(op, fn(w, check(spec, raw)))})
    except EngineError as exc:
        w.send({"id": rid, "ok": False, "error": {"code": exc.code, "message": exc.message}})
    except Exception as exc:  # noqa: BLE001 - any failure of one request is reported, the worker lives on
        w.send({"id": rid, "ok": False, "error": {"code": type(exc).__name__, "message": str(exc)}})
    return True


def answer_now(w: Worker, msg: dict[str, Any]) -> bool:
    """Answer a vocabulary op on the calling (reader) thread; False when it must wait in the queue (no
    serving engine, or one being made or freed)."""
    if not w.engine_lock.acquire(blocking=False):
        return False
    try:
        if w.engine is None:
            return False
        handle(w, msg)
        return True
    finally:
        w.engine_lock.release()


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
        spec = ops.OPS.get(str(msg.get("op")))
        if spec is not None and spec.reader and answer_now(w, msg):
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

