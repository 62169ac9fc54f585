"""The engine worker: the only process that links llama.cpp. ``python -m engine_bridge.worker``.

It answers protocol requests on stdin/stdout (see :mod:`engine_bridge.protocol`). The protocol keeps
the original stdout; file descriptor 1 is pointed at stderr so that nothing native can corrupt it.
A native crash kills only this process: its client reports a typed error.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from engine_bridge.errors import EngineError
from engine_bridge.params import EngineParams
from engine_bridge.protocol import PROTOCOL_VERSION, decode, encode

Op = Callable[["Worker", dict[str, Any]], dict[str, Any]]


class Worker:
    """State of one worker process: at most one loaded model."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.model: Any = None

    def send(self, msg: dict[str, Any]) -> None:
        """Write one protocol line."""
        self.out.write(encode(msg))
        self.out.flush()

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

    if w.model is not None:
        w.model.close()
        w.model = None
    params = EngineParams.model_validate(args["params"])
    t0 = time.perf_counter()
    w.model = NativeModel(Path(args["model"]), params, logits_all=bool(args.get("logits_all", False)))
    return {"load_ms": (time.perf_counter() - t0) * 1e3, "n_ctx": w.model.n_ctx, "n_vocab": w.model.n_vocab}


def op_tokenize(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Tokens of a text (special tokens parsed)."""
    return {"tokens": w.need_model().tokenize(args["text"], special=bool(args.get("special", True)))}


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


def op_abort(w: Worker, args: dict[str, Any]) -> dict[str, Any]:
    """Die like a native crash would (fault injection for tests and the soak suite)."""
    os.abort()


OPS: dict[str, Op] = {"hello": op_hello, "devices": op_devices, "load": op_load, "tokenize": op_tokenize,
                      "timed_run": op_timed_run, "greedy": op_greedy, "logprobs": op_logprobs,
                      "chat": op_chat, "abort": op_abort}


def handle(w: Worker, msg: dict[str, Any]) -> bool:
    """Answer one request; False when the client asked to shut down."""
    rid, op = msg["id"], msg.get("op", "")
    if op == "shutdown":
        w.send({"id": rid, "ok": True, "result": {}})
        return False
    fn = OPS.get(op)
    try:
        if fn is None:
            raise EngineError("unknown_op", f"unknown op {op!r}")
        w.send({"id": rid, "ok": True, "result": fn(w, msg.get("args") or {})})
    except EngineError as exc:
        w.send({"id": rid, "ok": False, "error": {"code": exc.code, "message": exc.message}})
    except Exception as exc:  # noqa: BLE001 - any failure of one request is reported, the worker lives on
        w.send({"id": rid, "ok": False, "error": {"code": type(exc).__name__, "message": str(exc)}})
    return True


def main() -> int:
    """Serve requests from stdin until EOF or shutdown."""
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # native code printing to stdout now lands in the log, not in the protocol
    sys.stdout = sys.stderr
    w = Worker(proto)
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        try:
            msg = decode(line)
        except ValueError as exc:
            w.send({"id": -1, "ok": False, "error": {"code": "bad_request", "message": str(exc)}})
            continue
        if not handle(w, msg):
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
