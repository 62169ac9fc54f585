#!/usr/bin/env python3
"""Serving benchmarks: ``flux serve`` raced side by side against what it should match or beat.

Each benchmark races two things in one run, in paired rounds whose order alternates at random, takes
medians, and prints ratios:

1. overhead     TinyLlama-1.1B twin: decode tok/s and time to first token through ``flux serve``
                (``/v1/completions``, streamed, short prompts) vs the same plan's parameters in this
                process through llama-cpp-python (``Llama(...)``, streaming ``create_completion``);
                2 x --rounds paired rounds.
                Targets: decode >= 0.97x, added TTFT <= 5 ms.
2. peers        TinyLlama-1.1B twin, same flags everywhere: flux serve vs ``python -m llama_cpp.server`` vs
                llama.cpp's ``llama-server``; tok/s of 1 stream and of 4 concurrent streams.
3. parking      slow dense twin, plan with concurrency 1: TTFT of a return to a parked ~2,000-token
                conversation (A, then B replaces it, then A + a new user turn) vs the same A + turn sent
                cold to a second fresh server. Target <= 0.3x.
4. concurrency  slow dense twin, plan with concurrency 4: aggregate tok/s of 4 streams vs 1 stream.

Timing is client-side from the SSE stream on every server (and the same for the in-process stream):
TTFT = request sent -> first piece of text; decode tok/s = (tokens - 1) / (last piece - first piece).

Plans are made directly (as tests/server/conftest.py does: this machine's real keys, the CPU parameters
below, no planner run) in an isolated Flux data dir under ``<cache_dir>/bench-serve``, with the twins.
Results go to the normal store as table ``bench_serve`` (one row per benchmark, DuckDB-queryable).
Threads default to 1: on a shared 2-core machine llama.cpp's spinning thread pool collapses when
another process takes a core.

    python3 scripts/bench_serve.py [--only overhead,peers,parking,concurrency] [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from artifacts.config import Settings, load_settings  # noqa: E402
from artifacts.store import Store  # noqa: E402
from artifacts.synth import synthesize  # noqa: E402
from engine_bridge.backend import llama_server_path  # noqa: E402
from engine_bridge.llama_server import HOST, LlamaServer, free_port  # noqa: E402
from engine_bridge.params import KV_TYPE_IDS, EngineParams  # noqa: E402
from tasks.bench.arrivals import timing  # noqa: E402
from tasks.bench.host import load_avg  # noqa: E402
from tasks.bench.http import FluxServe, exchange, finish_reason  # noqa: E402
from tasks.bench.stats import paired_ratio  # noqa: E402
from tasks.corpus import load_prompts  # noqa: E402
from tasks.plan_types import (  # noqa: E402
    Plan,
)
from tasks.testing import stored_plan  # noqa: E402

SLOW_SHAPE = {"n_embd": "1024", "n_ff": "4096", "n_layer": "8", "n_head": "8", "n_head_kv": "2", "head_dim": "128"}
TWINS: dict[str, tuple[str, dict[str, str]]] = {"tinyllama-1.1b": ("tinyllama-1.1b", {}),
                                                "slow-dense": ("tiny-dense", SLOW_SHAPE)}


# -- setup ---------------------------------------------------------------------------------------------
@dataclass
class Env:
    """Where the benchmarks keep their plans and models, and how they run."""

    settings: Settings  # isolated data dir: plans and server logs of this script only
    results: Store  # the user's store: the bench_serve table
    threads: int
    rounds: int
    rng: random.Random


def twin(env: Env, name: str) -> Path:
    """A synthetic twin (written once, then reused from the cache)."""
    preset, overrides = TWINS[name]
    path = env.settings.cache_dir / "bench-serve" / "models" / f"{name}-Q4_0.gguf"
    if not path.exists():
        print(f"  synthesizing {name} -> {path}", flush=True)
        synthesize(preset, path, quant="Q4_0", overrides=overrides or None)
    return path


def make_plan(env: Env, model: Path, *, n_ctx: int, n_seq_max: int) -> Plan:
    """Store a plan valid on this machine, with this script's threads (no planner run)."""
    params = EngineParams(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=512, n_ubatch=512, n_threads=env.threads,
                          n_threads_batch=env.threads)
    return stored_plan(env.settings, model, params, key_extra={"bench_serve": True})


@contextmanager
def flux_serve(env: Env, plan: Plan) -> Iterator[str]:
    """A running ``python -m server <plan>``; yields its base URL."""
    srv = FluxServe(env.settings, plan.id, log_path=env.settings.logs_dir / "bench-serve.log", start_timeout_s=600)
    srv.start()
    try:
        yield srv.base
    finally:
        srv.stop()


@contextmanager
def llama_cpp_python_server(model: Path, p: EngineParams) -> Iterator[str]:
    """``python -m llama_cpp.server`` with the plan's flags; yields its base URL.

    ``--interrupt_requests False``: by default a new request aborts the stream in progress (the server runs
    one at a time), which would make concurrent streams fail instead of wait their turn.
    """
    port = free_port()
    log = open(Path("/tmp") / f"bench-serve-llama-cpp-python-{port}.log", "wb")  # noqa: SIM115
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--n_ctx", str(p.n_ctx), "--n_batch",
           str(p.n_batch), "--n_ubatch", str(p.n_ubatch), "--n_threads", str(p.n_threads), "--n_threads_batch",
           str(p.n_threads_batch), "--flash_attn", str(p.flash_attn), "--n_gpu_layers", "0", "--interrupt_requests",
           "False", "--host", HOST,
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama_cpp.server exited with {proc.returncode}: see {log.name}")
            try:
                if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()


@contextmanager
def llama_server(env: Env, model: Path, p: EngineParams) -> Iterator[str]:
    """llama.cpp's llama-server with the plan's flags (``-c`` = ctx x slots); yields its base URL."""
    exe = llama_server_path(env.settings.cache_dir)
    if exe is None:
        raise RuntimeError("llama-server is not built: run scripts/build-backend.sh")
    args = ["-np", str(p.n_seq_max), *p.cli_args()]
    args[args.index("-c") + 1] = str(p.n_ctx * p.n_seq_max)
    srv = LlamaServer(exe, model, args, log_path=env.settings.logs_dir / "bench-serve-llama-server.log",
                      start_timeout_s=600, request_timeout_s=600)
    srv.start()
    try:
        yield f"http://{HOST}:{srv.port}"
    finally:
        srv.stop()


# -- measuring one request -------------------------------------------------------------------------------
@dataclass
class Got:
    """One streamed request as the client saw it."""

    ttft_s: float
    tokens: int
    decode_tps: float | None
    end_s: float  # perf_counter of the last event
    sent_s: float
    cached: int | None


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Got:
    ex = await exchange(client, "POST", url, body={**body, "stream": True, "stream_options": {"include_usage": True}})
    t = timing(ex, ex.t0)
    if t["error"] or t["ttft_ms"] is None:
        raise RuntimeError(f"{url}: {t['error'] or 'no text'} ({ex.body[:200]})")
    usage = any('"usage"' in d for _, d in ex.events)
    n = t["completion_tokens"] if usage else (body["max_tokens"] if finish_reason(ex.events) == "length"
                                              else t["completion_tokens"])
    tpot = t["tpot_ms"] * t["completion_tokens"] / n if t["tpot_ms"] and t["completion_tokens"] != n else t["tpot_ms"]
    return Got(ttft_s=t["ttft_ms"] / 1e3, tokens=n, decode_tps=1e3 / tpot if tpot else None,
               end_s=ex.times[-1], sent_s=ex.t0, cached=t["cached_tokens"])


def streams(base: str, path: str, bodies: list[dict[str, Any]]) -> list[Got]:
    """Send every body at once (each its own stream) and wait for all."""
    async def go() -> list[Got]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as c:
            return list(await asyncio.gather(*(_one(c, base + path, b) for b in bodies)))
    return asyncio.run(go())


def aggregate_tps(got: list[Got]) -> float:
    """Tokens of all streams over the time from the first request to the last token."""
    return sum(g.tokens for g in got) / (max(g.end_s for g in got) - min(g.sent_s for g in got))


def prompts(n: int, chars: int, skip: int = 0) -> list[str]:
    """``n`` corpus prompts that differ from their first character on (no prefix cache can help)."""
    texts = [p.text for p in load_prompts()]
    out: list[str] = []
    for t in texts[skip:] + texts[:skip]:
        if all(t[:16] != o[:16] for o in out) and len(t) >= chars // 2:
            out.append(t[:chars])
        if len(out) == n:
            return out
    raise RuntimeError(f"the corpus has fewer than {n} distinct prompts of {chars // 2}+ characters")


def order(env: Env, names: list[str]) -> list[str]:
    """A new random order of the arms for this round."""
    out = list(names)
    env.rng.shuffle(out)
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def _ratio_fields(ci: Any) -> dict[str, Any]:
    return {"ratio": ci.ratio, "ci_low": ci.low, "ci_high": ci.high, "n": ci.n}


# -- 1. overhead ------------------------------------------------------------------------------------------
def bench_overhead(env: Env) -> dict[str, Any]:
    """flux serve vs the same parameters in-process (llama-cpp-python, streaming create_completion)."""
    import llama_cpp

    model, n_gen, rounds = twin(env, "tinyllama-1.1b"), 32, 2 * env.rounds
    plan = make_plan(env, model, n_ctx=1024, n_seq_max=1)
    p = plan.candidate.params
    texts = prompts(rounds + 1, 24)  # short prompts: TTFT is mostly overhead, not prefill, so its noise is small
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=p.n_ctx, n_batch=p.n_batch, n_ubatch=p.n_ubatch,
                          n_threads=p.n_threads, n_threads_batch=p.n_threads_batch, n_gpu_layers=0,
                          flash_attn=p.flash_attn, type_k=KV_TYPE_IDS[p.type_k], type_v=KV_TYPE_IDS[p.type_v],
                          use_mmap=p.load_mode == "mmap", seed=p.seed, verbose=False)

    def in_process(text: str, max_tokens: int = n_gen) -> Got:
        t0, times, reason = time.perf_counter(), [], None
        chunks: Any = llm.create_completion(text, max_tokens=max_tokens, temperature=0.0, stream=True)
        for chunk in chunks:
            c = chunk["choices"][0]
            if c["text"]:
                times.append(time.perf_counter())
            reason = c.get("finish_reason") or reason
        n = max_tokens if reason == "length" else len(times)
        return Got(ttft_s=times[0] - t0, tokens=n, decode_tps=(n - 1) / (times[-1] - times[0]), end_s=times[-1],
                   sent_s=t0, cached=None)

    def body(text: str, max_tokens: int = n_gen) -> dict[str, Any]:
        return {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0}

    got: dict[str, list[Got]] = {"flux": [], "in-process": []}
    with flux_serve(env, plan) as base:
        streams(base, "/v1/completions", [body(texts[-1], 4)])  # warm-up (not timed), a prompt no round uses
        in_process(texts[-1], 4)
        for r in range(rounds):
            for arm in order(env, list(got)):
                got[arm].append(streams(base, "/v1/completions", [body(texts[r])])[0] if arm == "flux"
                                else in_process(texts[r]))
    llm.close()
    f, loc = got["flux"], got["in-process"]
    dec = paired_ratio([g.decode_tps or 0 for g in f], [g.decode_tps or 0 for g in loc])
    added = [(a.ttft_s - b.ttft_s) * 1e3 for a, b in zip(f, loc, strict=True)]
    met = (dec.ratio or 0) >= 0.97 and med(added) <= 5.0
    detail = (f"decode {med([g.decode_tps or 0 for g in f]):.2f} vs {med([g.decode_tps or 0 for g in loc]):.2f} tok/s "
              f"= {dec.text()} (target >= 0.97x); TTFT {med([g.ttft_s for g in f]) * 1e3:.1f} vs "
              f"{med([g.ttft_s for g in loc]) * 1e3:.1f} ms, added {med(added):+.1f} ms median of paired rounds "
              f"(target <= 5 ms)")
    return {"benchmark": "overhead", "model": model.name, "plan_id": plan.id, "ratio_name": "decode flux/in-process",
            **_ratio_fields(dec), "target": ">= 0.97x decode, <= 5 ms added TTFT", "met": met, "detail": detail,
            "metrics": {"added_ttft_ms": added, "added_ttft_ms_median": med(added), "n_gen": n_gen,
                        "flux": [g.__dict__ for g in f], "in_process": [g.__dict__ for g in loc],
                        "params": " ".join(p.cli_args())}}


# -- 2. peers ---------------------------------------------------------------------------------------------
PEERS = ("flux", "llama-cpp-python", "llama-server")


def bench_peers(env: Env) -> dict[str, Any]:
    """flux serve vs llama_cpp.server vs llama-server, same model and flags: 1 stream and 4 concurrent streams."""
    model, n_gen = twin(env, "tinyllama-1.1b"), 24
    plan = make_plan(env, model, n_ctx=1024, n_seq_max=4)
    p = plan.candidate.params
    texts = prompts(5 * env.rounds + 1, 72)

    def body(text: str, max_tokens: int = n_gen) -> dict[str, Any]:
        return {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0}

    tps: dict[tuple[str, int], list[float]] = {(e, k): [] for e in PEERS for k in (1, 4)}
    single: dict[str, list[Got]] = {e: [] for e in PEERS}
    with flux_serve(env, plan) as fx, llama_cpp_python_server(model, p.model_copy(update={"n_seq_max": 1})) as lp, \
            llama_server(env, model, p) as ls:
        bases = dict(zip(PEERS, (fx, lp, ls), strict=True))
        for base in bases.values():
            streams(base, "/v1/completions", [body(texts[-1], 4)])  # warm-up
        for r in range(env.rounds):
            batch = texts[5 * r:5 * r + 5]
            for name in order(env, list(PEERS)):
                single[name] += streams(bases[name], "/v1/completions", [body(batch[0])])
                tps[(name, 1)].append(aggregate_tps(single[name][-1:]))
                tps[(name, 4)].append(aggregate_tps(streams(bases[name], "/v1/completions", [body(t) for t in batch[1:]])))
    ratios = {f"flux/{peer} x{k}": paired_ratio(tps[("flux", k)], tps[(peer, k)]) for peer in PEERS[1:] for k in (1, 4)}
    medians = {f"{e} x{k}": med(v) for (e, k), v in tps.items()}
    parts = {e: f"TTFT {med([g.ttft_s for g in v]) * 1e3:.0f} ms, decode {med([g.decode_tps or 0 for g in v]):.1f} tok/s"
             for e, v in single.items()}
    detail = "; ".join(f"{name} {ci.text()}" for name, ci in ratios.items()) + " | tok/s medians: " + ", ".join(
        f"{k} {v:.1f}" for k, v in medians.items()) + " | 1 stream: " + "; ".join(f"{e} {t}" for e, t in parts.items())
    main = ratios["flux/llama-server x4"]
    met = all((ci.ratio or 0) >= 0.97 for ci in ratios.values())
    return {"benchmark": "peers", "model": model.name, "plan_id": plan.id, "ratio_name": "tok/s flux/llama-server x4",
            **_ratio_fields(main), "target": ">= 0.97x of each peer (no target in the issue: same or better)",
            "met": met, "detail": detail,
            "metrics": {"ratios": {k: v.model_dump() for k, v in ratios.items()}, "tps": {f"{e} x{k}": v for (e, k), v in
                                                                                      tps.items()},
                        "medians": medians, "single_stream": parts, "n_gen": n_gen, "flags": " ".join(p.cli_args())}}


# -- 3. parking -------------------------------------------------------------------------------------------
def long_texts(model: Path, n: int, n_tokens: int) -> list[str]:
    """``n`` texts of about ``n_tokens`` tokens, each starting with a different corpus prompt."""
    import llama_cpp

    vocab = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    texts = [p.text for p in load_prompts()]
    out = []
    for i in range(n):
        joined = "\n\n".join(texts[(i * 7 + k) % len(texts)] for k in range(len(texts)))
        per_char = len(vocab.tokenize(joined.encode(), add_bos=False)) / len(joined)
        out.append(joined[: int(n_tokens / per_char)])
    return out


def bench_parking(env: Env) -> dict[str, Any]:
    """TTFT of a return to a parked ~2,000-token conversation vs the same prompt cold on a fresh server."""
    model = twin(env, "slow-dense")
    plan = make_plan(env, model, n_ctx=3072, n_seq_max=1)
    convs = long_texts(model, env.rounds, 2000)
    others = prompts(env.rounds + 1, 400)
    turn = [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Now summarize it in one line."}]

    def chat(base: str, messages: list[dict[str, str]]) -> Got:
        return streams(base, "/v1/chat/completions", [{"messages": messages, "max_tokens": 8, "temperature": 0.0}])[0]

    parked: list[Got] = []
    cold: list[Got] = []
    with flux_serve(env, plan) as hot, flux_serve(env, plan) as fresh:
        for base in (hot, fresh):
            chat(base, [{"role": "user", "content": others[-1]}])  # warm-up
        for r, text in enumerate(convs):
            a = [{"role": "user", "content": text}]
            for arm in order(env, ["parked", "cold"]):
                if arm == "parked":
                    chat(hot, a)  # A: ~2,000 tokens of prefill
                    chat(hot, [{"role": "user", "content": others[r]}])  # B replaces A: A is parked
                    parked.append(chat(hot, a + turn))
                else:
                    cold.append(chat(fresh, a + turn))
    ci = paired_ratio([g.ttft_s for g in parked], [g.ttft_s for g in cold])
    detail = (f"TTFT parked {med([g.ttft_s for g in parked]) * 1e3:.0f} ms vs cold {med([g.ttft_s for g in cold]) * 1e3:.0f}"
              f" ms = {ci.text()} (target <= 0.3x); cached tokens parked {[g.cached for g in parked]}, "
              f"cold {[g.cached for g in cold]}")
    return {"benchmark": "parking", "model": model.name, "plan_id": plan.id, "ratio_name": "TTFT parked/cold",
            **_ratio_fields(ci), "target": "<= 0.3x", "met": (ci.ratio or 9) <= 0.3, "detail": detail,
            "metrics": {"parked": [g.__dict__ for g in parked], "cold": [g.__dict__ for g in cold]}}


# -- 4. concurrency ---------------------------------------------------------------------------------------
def bench_concurrency(env: Env) -> dict[str, Any]:
    """Aggregate tok/s of 4 streams vs 1 stream on a plan made for 4 sequences."""
    model, n_gen = twin(env, "slow-dense"), 64
    plan = make_plan(env, model, n_ctx=1024, n_seq_max=4)
    texts = prompts(5 * env.rounds + 1, 200)

    def body(text: str, max_tokens: int = n_gen) -> dict[str, Any]:
        return {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0}

    tps: dict[str, list[float]] = {"1": [], "4": []}
    with flux_serve(env, plan) as base:
        streams(base, "/v1/completions", [body(texts[-1], 4)])
        for r in range(env.rounds):
            batch = texts[5 * r:5 * r + 5]
            for arm in order(env, list(tps)):
                chosen = batch[:1] if arm == "1" else batch[1:]
                tps[arm].append(aggregate_tps(streams(base, "/v1/completions", [body(t) for t in chosen])))
    ci = paired_ratio(tps["4"], tps["1"])
    detail = f"4 streams {med(tps['4']):.1f} tok/s vs 1 stream {med(tps['1']):.1f} tok/s = {ci.text()}"
    return {"benchmark": "concurrency", "model": model.name, "plan_id": plan.id, "ratio_name": "tok/s 4 streams/1",
            **_ratio_fields(ci), "target": "> 1x", "met": (ci.low or 0) > 1.0, "detail": detail,
            "metrics": {"tps": tps, "n_gen": n_gen}}


BENCHMARKS: dict[str, Callable[[Env], dict[str, Any]]] = {
    "overhead": bench_overhead, "peers": bench_peers, "parking": bench_parking, "concurrency": bench_concurrency}
SCHEMA = pa.schema([
    ("run_id", pa.string()), ("created_at", pa.timestamp("us", tz="UTC")), ("benchmark", pa.string()),
    ("model", pa.string()), ("plan_id", pa.string()), ("ratio_name", pa.string()), ("ratio", pa.float64()),
    ("ci_low", pa.float64()), ("ci_high", pa.float64()), ("n", pa.int64()), ("target", pa.string()),
    ("met", pa.bool_()), ("detail", pa.string()), ("seconds", pa.float64()), ("threads", pa.int64()),
    ("load_avg_start", pa.string()), ("load_avg_end", pa.string()), ("metrics", pa.string()),
])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated benchmarks (default: all)")
    ap.add_argument("--rounds", type=int, default=4, help="paired rounds per benchmark (default 4)")
    ap.add_argument("--threads", type=int, default=1, help="threads of every engine (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}: choose from {', '.join(BENCHMARKS)}")
    settings = load_settings()
    iso = settings.model_copy(update={"data_dir": settings.cache_dir / "bench-serve" / "data"})
    env = Env(settings=iso, results=Store(settings.data_dir), threads=args.threads, rounds=args.rounds,
              rng=random.Random(args.seed))
    run_id, created, rows = uuid.uuid4().hex, dt.datetime.now(dt.UTC), []
    for name in names:
        print(f"== {name}: {BENCHMARKS[name].__doc__}", flush=True)
        t0, load0 = time.monotonic(), load_avg()
        try:
            row = BENCHMARKS[name](env)
        except Exception as exc:  # noqa: BLE001 - one benchmark failing must not lose the others' results
            row = {"benchmark": name, "met": False, "detail": f"error: {type(exc).__name__}: {exc}"}
        row.update(run_id=run_id, created_at=created, seconds=time.monotonic() - t0, threads=args.threads,
                   load_avg_start=json.dumps(load0), load_avg_end=json.dumps(load_avg()),
                   metrics=json.dumps(row.get("metrics", {}), default=str))
        rows.append(row)
        print(f"   {'MET' if row['met'] else 'NOT MET'} ({row['seconds']:.0f} s, load {load0} -> {load_avg()}): "
              f"{row['detail']}", flush=True)
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in SCHEMA} for r in rows], schema=SCHEMA)
    path = env.results.put_table("bench_serve", table, key=run_id, meta={"benchmarks": names})
    print(f"stored {len(rows)} rows in {path} (Store.query('SELECT * FROM bench_serve'))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
