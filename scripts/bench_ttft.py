#!/usr/bin/env python3
"""Where serving's added time to first token goes: in-process vs Flux's worker vs HTTP, in one run.

Three arms on the same TinyLlama-shape twin, the same prompts (24 characters each) and engine parameters:
1. in-process llama-cpp-python, streaming ``create_completion``;
2. Flux's worker driven directly: a ``tokenize`` round trip, then ``generate`` until its first token event;
3. ``flux serve`` (``python -m server``) over HTTP, ``/v1/completions`` with ``stream``, to the first text.
Run once with ``--max-tokens 4`` and once with ``--max-tokens 1``: the difference shows whether the HTTP
path waits behind the worker's continuing decode (it does on a 2-core machine).

    python3 scripts/bench_ttft.py [--max-tokens 4] [--threads 2] [--prompts 12]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import llama_cpp  # noqa: E402

from artifacts.config import load_settings  # noqa: E402
from artifacts.synth import cached_twin  # noqa: E402
from engine_bridge.aclient import AsyncWorker  # noqa: E402
from engine_bridge.params import EngineParams  # noqa: E402
from tasks.bench_http import FluxServe  # noqa: E402
from tasks.corpus import load_prompts  # noqa: E402
from tasks.testing import stored_plan  # noqa: E402


def texts(n: int) -> list[str]:
    """``n + 1`` corpus prompts that differ from their first characters on (the last one warms up)."""
    out: list[str] = []
    for p in load_prompts():
        if all(p.text[:16] != o[:16] for o in out) and len(p.text) >= 12:
            out.append(p.text[:24])
    return out[: n + 1]


def in_process(model: Path, params: EngineParams, prompts: list[str]) -> list[float]:
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=params.n_ctx, n_batch=params.n_batch, n_ubatch=params.n_ubatch,
                          n_threads=params.n_threads, n_threads_batch=params.n_threads_batch,
                          flash_attn=params.flash_attn, verbose=False)
    out = []
    for t in prompts:
        t0 = time.perf_counter()
        for ch in llm.create_completion(t, max_tokens=4, temperature=0.0, stream=True):
            if ch["choices"][0]["text"]:  # type: ignore[index]
                out.append(time.perf_counter() - t0)
                break
    llm.close()
    return out


async def worker(model: Path, params: EngineParams, prompts: list[str], log: Path) -> tuple[list[float], list[float]]:
    """(tokenize round trip, tokenize + generate to the first token event), seconds."""
    w = AsyncWorker(log)
    await w.start()
    await w.call("serve_load", {"model": str(model), "params": params.model_dump(mode="json"), "park_bytes": 0},
                 timeout=600)
    tok, first = [], []
    for i, t in enumerate(prompts):
        t0 = time.perf_counter()
        ids = (await w.call("tokenize", {"text": t, "special": True, "add_special": True}, timeout=60))["tokens"]
        t1 = time.perf_counter()
        t2 = None
        async for msg in w.stream("generate", {"rid": f"r{i}", "prompt": ids, "max_tokens": 4, "temperature": 0.0},
                                  timeout=60):
            if msg.get("type") == "token" and t2 is None:
                t2 = time.perf_counter()
            if "result" in msg:
                break
        tok.append(t1 - t0)
        first.append((t2 or time.perf_counter()) - t0)
    await w.close()
    return tok, first


def http(model: Path, params: EngineParams, prompts: list[str], max_tokens: int, log: Path) -> list[float]:
    st = load_settings()
    srv = FluxServe(st, stored_plan(st, model, params, key_extra={"bench_ttft": True}).id, log_path=log,
                    start_timeout_s=600)
    srv.start()
    out = []
    try:
        with httpx.Client(timeout=60) as c:
            for t in prompts:
                t0, got = time.perf_counter(), None
                body = {"prompt": t, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
                with c.stream("POST", srv.base + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"text":"' in line and '"text":""' not in line:
                            got = time.perf_counter() - t0
                            break
                if got is not None:
                    out.append(got)
    finally:
        srv.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens the HTTP arm asks for (default 4)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=12)
    args = ap.parse_args()
    st = load_settings()
    model = cached_twin(st.cache_dir, "tinyllama-1.1b")
    params = EngineParams(n_ctx=1024, n_seq_max=1, n_batch=512, n_ubatch=512, n_threads=args.threads,
                          n_threads_batch=args.threads)
    ps = texts(args.prompts)
    warm, timed = ps[-1:], ps[:-1]
    logs = st.logs_dir
    a = in_process(model, params, warm + timed)[1:]
    tok, b = asyncio.run(worker(model, params, warm + timed, logs / "bench-ttft-worker.log"))
    c = http(model, params, warm + timed, args.max_tokens, logs / "bench-ttft-serve.log")[1:]
    med = statistics.median
    print(f"TinyLlama twin, {args.threads} threads, {len(timed)} prompts, medians:")
    print(f"  in-process llama-cpp-python   {med(a) * 1e3:7.1f} ms")
    print(f"  Flux worker (tokenize+generate) {med(b[1:]) * 1e3:5.1f} ms  (tokenize round trip {med(tok[1:]) * 1e3:.2f} ms)"
          f"  worker/in-process {med(b[1:]) / med(a):.3f}x")
    print(f"  HTTP, max_tokens {args.max_tokens:<3}         {med(c) * 1e3:7.1f} ms  HTTP/worker {med(c) / med(b[1:]):.3f}x, "
          f"added {(med(c) - med(b[1:])) * 1e3:+.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
