"""``python -m engine_bridge.worker.inprocess``: llama-cpp-python's own ``Llama`` in one process, a baseline.

Not Flux's engine: what a user gets who runs the plan's parameters through llama-cpp-python's high-level
API in their own process (``Llama(...)``, streaming ``create_completion``), with no server and no pipe
between the tokens and the clock. ``flux bench serve`` (overhead) and ``flux bench ttft`` race it against the
plan's worker and ``flux serve``. It lives on the worker side because only this package links llama.cpp;
its client is :class:`tasks.bench.inprocess.InProcess`.

Protocol, one JSON object a line: the first line on stdin is ``{"model": path, "params": EngineParams}``,
answered ``{"load_s": seconds}``; every further line ``{"prompt": text, "max_tokens": n}`` is answered
``{"ttft_s", "last_s", "pieces", "finish_reason"}`` (seconds from the call, measured here; ``pieces``: text
chunks streamed). The process exits at the end of stdin.
"""

# ruff: noqa: I001  (llama_cpp is imported first on purpose: see engine_bridge.worker.process)
from __future__ import annotations

import llama_cpp

import json
import os
import sys
import time
from typing import Any

from artifacts.engine_params import KV_TYPE_IDS, EngineParams


def load(model: str, p: EngineParams) -> llama_cpp.Llama:
    """The plan's parameters as llama-cpp-python's keyword arguments (layers on the GPU: ``n_gpu_layers`` alone)."""
    return llama_cpp.Llama(model_path=model, n_ctx=p.n_ctx, n_batch=p.n_batch, n_ubatch=p.n_ubatch,
                           n_threads=p.n_threads, n_threads_batch=p.n_threads_batch, n_gpu_layers=p.n_gpu_layers,
                           flash_attn=p.flash_attn, type_k=KV_TYPE_IDS[p.type_k], type_v=KV_TYPE_IDS[p.type_v],
                           use_mmap=p.load_mode == "mmap", use_mlock=p.load_mode == "mlock", seed=p.seed,
                           verbose=False)


def complete(llm: llama_cpp.Llama, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One greedy streamed completion, timed from the call to its first and last text chunk."""
    t0, first, last, pieces, reason = time.perf_counter(), None, None, 0, None
    chunks: Any = llm.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, stream=True)
    for chunk in chunks:
        choice = chunk["choices"][0]
        if choice["text"]:
            last = time.perf_counter() - t0
            first = last if first is None else first
            pieces += 1
        reason = choice.get("finish_reason") or reason
    return {"ttft_s": first, "last_s": last, "pieces": pieces, "finish_reason": reason}


def main() -> int:
    """Load from the first line, then answer each completion line until stdin ends."""
    out = os.fdopen(os.dup(1), "w")  # the answers keep stdout; anything native writes to fd 1 goes to stderr
    os.dup2(2, 1)
    first = json.loads(sys.stdin.readline())
    t0 = time.perf_counter()
    llm = load(str(first["model"]), EngineParams.model_validate(first["params"]))
    out.write(json.dumps({"load_s": time.perf_counter() - t0}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        out.write(json.dumps(complete(llm, str(req["prompt"]), int(req["max_tokens"]))) + "\n")
        out.flush()
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
