#!/usr/bin/env python3
"""Where serving's added time to first token goes: in-process vs Flux's worker vs HTTP, in one run.

Three arms on the same TinyLlama-shape twin, the same prompts (24 characters each) and engine parameters:
1. in-process llama-cpp-python, streaming ``create_completion``;
2. Flux's worker driven directly: a ``tokenize`` round trip, then ``generate`` until its first token event;
3. ``flux serve`` (``python -m server``) over HTTP, ``/v1/completions`` with ``stream``, to the first text.
Each arm reads every reply to its end before the next prompt, as a client that waits for its answer does.
(An HTTP client that dropped each stream at its first text used to find the worker still in the decode step
it had started for the dropped reply: the next prompt's tokenize waited one decode step, 8.8-13.9 ms on
the TinyLlama twin. That was the added TTFT once measured; the worker now tokenizes on its reader thread,
and a reply nobody follows gives its sequence to the next request.)

``--busy N`` measures what a request waits while another reply is decoding (a plan of 2 sequences, one of
them running a long reply): N pairs of distinct prompts, one on the idle server, the other while the long
reply decodes (alternating), paired.

``--pairs N`` measures the HTTP path's added time the way a busy machine still allows: one flux serve and
one separate worker with the same model, each prompt sent to both back to back (in alternating order), N
rounds; the median of the N x prompts paired differences (HTTP - worker) is the added TTFT.

    python3 scripts/bench_ttft.py [--max-tokens 4] [--threads 2] [--prompts 12] [--pairs 0]
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
from engine_bridge import ops  # noqa: E402
from engine_bridge.aclient import AsyncWorkerClient  # noqa: E402
from engine_bridge.params import EngineParams  # noqa: E402
from tasks.bench.http import FluxServe  # noqa: E402
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
    w = AsyncWorkerClient(log)
    await w.start()
    await w.request(ops.SERVE_LOAD, ops.ServeLoadArgs(model=str(model), params=params), timeout=600)
    tok, first = [], []
    for i, t in enumerate(prompts):
        t0 = time.perf_counter()
        ids = await w.tokenize(t, special=True, add_special=True, timeout=60)
        t1 = time.perf_counter()
        t2 = None
        async for msg in w.generate({"rid": f"r{i}", "prompt": ids, "max_tokens": 4, "temperature": 0.0},
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
                    for line in r.iter_lines():  # to the end: the next prompt must not find this one running
                        if got is None and line.startswith("data: {") and '"text":"' in line \
                                and '"text":""' not in line:
                            got = time.perf_counter() - t0
                if got is not None:
                    out.append(got)
    finally:
        srv.stop()
    return out


async def _worker_first(w: AsyncWorkerClient, rid: str, text: str, max_tokens: int) -> float:
    t0, first = time.perf_counter(), None
    ids = await w.tokenize(text, special=True, add_special=True, timeout=60)
    async for msg in w.generate({"rid": rid, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0},
                              timeout=60):
        if msg.get("type") == "token" and first is None:
            first = time.perf_counter()
    return (first or time.perf_counter()) - t0


async def _http_first(c: httpx.AsyncClient, base: str, text: str, max_tokens: int) -> float:
    t0, first = time.perf_counter(), None
    body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    async with c.stream("POST", base + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"text":"' in line and '"text":""' not in line:
                first = time.perf_counter()
    return (first or time.perf_counter()) - t0


async def paired(model: Path, params: EngineParams, prompts: list[str], rounds: int, max_tokens: int,
                 logs: Path) -> tuple[list[float], list[float]]:
    """(worker TTFTs, HTTP TTFTs), each prompt of each round sent to both, alternating which goes first."""
    st = load_settings()
    srv = FluxServe(st, stored_plan(st, model, params, key_extra={"bench_ttft": True}).id,
                    log_path=logs / "bench-ttft-serve.log", start_timeout_s=600)
    srv.start()
    w = AsyncWorkerClient(logs / "bench-ttft-worker.log")
    await w.start()
    await w.request(ops.SERVE_LOAD, ops.ServeLoadArgs(model=str(model), params=params), timeout=600)
    ws, hs = [], []
    try:
        async with httpx.AsyncClient(timeout=60) as c:
            await _http_first(c, srv.base, prompts[-1], max_tokens)  # warm both
            await _worker_first(w, "warm", prompts[-1], max_tokens)
            for r in range(rounds):
                for i, t in enumerate(prompts[:-1]):
                    if (r + i) % 2:
                        hs.append(await _http_first(c, srv.base, t, max_tokens))
                        ws.append(await _worker_first(w, f"p{r}-{i}", t, max_tokens))
                    else:
                        ws.append(await _worker_first(w, f"p{r}-{i}", t, max_tokens))
                        hs.append(await _http_first(c, srv.base, t, max_tokens))
    finally:
        await w.close()
        srv.stop()
    return ws, hs


async def busy(model: Path, params: EngineParams, prompts: list[str], rounds: int, max_tokens: int,
               logs: Path) -> tuple[list[float], list[float]]:
    """(idle TTFTs, busy TTFTs): pairs of prompts, one on the idle server, the other while another reply decodes
    (two prompts: the second of one would find the first's cached prefix)."""
    st = load_settings()
    two = params.model_copy(update={"n_seq_max": 2})
    srv = FluxServe(st, stored_plan(st, model, two, key_extra={"bench_ttft": "busy"}).id,
                    log_path=logs / "bench-ttft-serve.log", start_timeout_s=600)
    srv.start()
    idle, loaded = [], []
    long_body = {"prompt": "Once upon a time", "max_tokens": 100000, "temperature": 0.0, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            await _http_first(c, srv.base, prompts[-1], max_tokens)
            for r in range(rounds):
                for t, u in zip(prompts[:-1:2], prompts[1:-1:2], strict=False):
                    t, u = (t, u) if len(idle) % 2 else (u, t)
                    idle.append(await _http_first(c, srv.base, t, max_tokens))
                    async with c.stream("POST", srv.base + "/v1/completions", json=long_body,
                                        headers={"x-request-id": f"bg-{r}-{len(loaded)}"}) as bg:
                        lines = bg.aiter_lines()
                        while not (await lines.__anext__()).startswith("data: {\"id"):
                            pass
                        loaded.append(await _http_first(c, srv.base, u, max_tokens))
                    await c.delete(srv.base + f"/v1/requests/bg-{r}-{len(loaded) - 1}")
    finally:
        srv.stop()
    return idle, loaded


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=4, help="tokens the HTTP arm asks for (default 4)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--busy", type=int, default=0, help="rounds of TTFT while another reply decodes")
    ap.add_argument("--pairs", type=int, default=0, help="rounds of the paired worker/HTTP comparison (0: the "
                    "three arms, one after the other)")
    args = ap.parse_args()
    st = load_settings()
    model = cached_twin(st.cache_dir, "tinyllama-1.1b")
    params = EngineParams(n_ctx=1024, n_seq_max=1, n_batch=512, n_ubatch=512, n_threads=args.threads,
                          n_threads_batch=args.threads)
    ps = texts(args.prompts)
    warm, timed = ps[-1:], ps[:-1]
    logs = st.logs_dir
    med = statistics.median
    if args.busy:
        idle, loaded = asyncio.run(busy(model, params, texts(2 * args.busy), 1, args.max_tokens, logs))
        waits = sorted(b - i for i, b in zip(idle, loaded, strict=True))
        print(f"TinyLlama twin, {args.threads} threads, 2 sequences, {len(waits)} prompts: TTFT idle "
              f"{med(idle) * 1e3:.1f} ms, while another reply decodes {med(loaded) * 1e3:.1f} ms; "
              f"paired wait median {med(waits) * 1e3:+.2f} ms, quartiles {waits[len(waits) // 4] * 1e3:+.2f} .. "
              f"{waits[3 * len(waits) // 4] * 1e3:+.2f} ms")
        return 0
    if args.pairs:
        ws, hs = asyncio.run(paired(model, params, ps, args.pairs, args.max_tokens, logs))
        diffs = sorted(h - w for w, h in zip(ws, hs, strict=True))
        q1, q3 = diffs[len(diffs) // 4], diffs[3 * len(diffs) // 4]
        print(f"TinyLlama twin, {args.threads} threads, {len(diffs)} paired prompts (max_tokens {args.max_tokens}):")
        print(f"  worker {med(ws) * 1e3:7.1f} ms   HTTP {med(hs) * 1e3:7.1f} ms   (medians)")
        print(f"  added by HTTP (paired): median {med(diffs) * 1e3:+.2f} ms, quartiles {q1 * 1e3:+.2f} .. "
              f"{q3 * 1e3:+.2f} ms")
        return 0
    a = in_process(model, params, warm + timed)[1:]
    tok, b = asyncio.run(worker(model, params, warm + timed, logs / "bench-ttft-worker.log"))
    c = http(model, params, warm + timed, args.max_tokens, logs / "bench-ttft-serve.log")[1:]
    print(f"TinyLlama twin, {args.threads} threads, {len(timed)} prompts, medians:")
    print(f"  in-process llama-cpp-python   {med(a) * 1e3:7.1f} ms")
    print(f"  Flux worker (tokenize+generate) {med(b[1:]) * 1e3:5.1f} ms  (tokenize round trip {med(tok[1:]) * 1e3:.2f} ms)"
          f"  worker/in-process {med(b[1:]) / med(a):.3f}x")
    print(f"  HTTP, max_tokens {args.max_tokens:<3}         {med(c) * 1e3:7.1f} ms  HTTP/worker {med(c) / med(b[1:]):.3f}x, "
          f"added {(med(c) - med(b[1:])) * 1e3:+.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
