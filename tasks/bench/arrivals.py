"""``flux bench arrivals``: Poisson arrivals and a long-running chat, on Flux and on llama.cpp's llama-server.

The plan's single-stream capacity (requests per second: one over the median latency of requests sent one
at a time to ``flux serve``) sets the rates: ``--rates 0.5,1,2`` replays seeded Poisson arrivals at
0.5x, 1x and 2x that capacity. Each arrival is a ``/v1/completions`` stream of a corpus prompt given as
token ids (the same tokens on both engines, no template in between) decoding ``n_gen`` greedy tokens.
Alongside each replay one client holds a long chat (a bundled coding-agent conversation, a different
one per rate): turn after turn, each sending the whole history so far, its context growing.

Both engines get the same prompts, arrival times and seeds: ``flux serve`` (the plan) and llama-server
with its automatic fit (only ``-c`` = ctx x N and ``-np`` = N, N the sequences the plan serves: ``--concurrency``, or
the count ``--serving-p95-ms`` chose, so both hold the same KV cache). Every round starts
each engine fresh, in a new random order. Per request the client records the time to the first token
and the gaps between streamed pieces of text (inter-token latency; an engine that holds back the bytes
of an incomplete character sends fewer, larger pieces, so ``tpot`` = decode time per token of the
request is recorded too). Per engine and rate: p50/p95/p99 TTFT and ITL and throughput (completion
tokens per second of the replay), and Flux/llama-server ratios of each.

Verdict per rate (and for the chat): fail when a Flux request failed or when Flux is slower on both
TTFT and decode (paired per request, the whole 95% interval below 1); info without llama-server.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from artifacts.corpus import load_conversations, sized_prompts
from engine_bridge.client import tokenizer
from engine_bridge.errors import EngineError
from engine_bridge.llama_server import HOST, LlamaServer
from tasks.bench.arrivals_stats import summary_row
from tasks.bench.arrivals_workload import Workload, chat_messages, chat_turns
from tasks.bench.context import BenchContext, Progress
from tasks.bench.engines import fit_server_args
from tasks.bench.errors import BenchError
from tasks.bench.host import load_avg
from tasks.bench.http import Exchange, FluxServe, client_limits, error_body, exchange, json_object
from tasks.bench.record import BenchRun
from tasks.bench.registry import Suite

if TYPE_CHECKING:

    pass

log = logging.getLogger(__name__)
LADDER = (32, 64, 128, 256, 512)  # prompt lengths of the arrivals (those that fit the plan's context)
CHAT_MARGIN = 32  # tokens kept free in a chat turn for template differences between the engines
RAW_SCHEMA = pa.schema([
    ("engine", pa.string()), ("round", pa.int32()), ("rate_factor", pa.float64()), ("rate_rps", pa.float64()),
    ("kind", pa.string()), ("index", pa.int32()), ("prompt_tokens", pa.int32()), ("scheduled_s", pa.float64()),
    ("sent_s", pa.float64()), ("ttft_ms", pa.float64()), ("itl_ms", pa.list_(pa.float64())),
    ("tpot_ms", pa.float64()), ("e2e_ms", pa.float64()), ("end_s", pa.float64()),
    ("completion_tokens", pa.int32()), ("cached_tokens", pa.int32()), ("error", pa.string()),
])


class ArrivalsOptions(BaseModel):
    """How ``flux bench arrivals`` replays."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rates: tuple[float, ...] = Field((0.5, 1.0, 2.0), min_length=1, description="x single-stream capacity")
    requests: int = Field(12, ge=1, le=10_000, description="arrivals per rate")
    n_gen: int = Field(32, ge=2, le=4096, description="tokens decoded per arrival and chat turn")
    rounds: int = Field(2, ge=1, le=20)
    chat_turns: int = Field(6, ge=0, le=64, description="turns of the long chat per rate (0: no chat)")
    chat_chars: int = Field(1500, ge=16, description="characters kept of each chat message")
    capacity: float | None = Field(None, gt=0, description="requests/s; None: measure it on flux serve")
    calibration: int = Field(3, ge=1, le=50, description="requests timed one at a time for the capacity")
    hang_s: float = Field(120.0, gt=0, description="a request with no byte for this long is an error")
    seed: int = 0
    n_boot: int = Field(2000, ge=100)


# -- the workload ---------------------------------------------------------------------------------------
def make_workload(ctx: BenchContext, opts: ArrivalsOptions) -> Workload:
    """Tokenize the corpus with the plan's model (in a worker) into the replay's prompts and chat turns."""
    n_ctx, rng = ctx.params.n_ctx, random.Random(opts.seed)
    ladder = [n for n in LADDER if n + opts.n_gen + 8 <= n_ctx] or [max(4, (n_ctx - opts.n_gen) // 2)]
    n_rates = len(opts.rates)
    lengths = [rng.choice(ladder) for _ in range(n_rates * opts.requests + opts.calibration)]
    convs = load_conversations()
    with tokenizer(ctx.model, ctx.worker_log, ctx.timeout_s) as tokenize:
        prompts = sized_prompts(tokenize, lengths, split=None, seed=opts.seed)
        budget = int((n_ctx - opts.n_gen - CHAT_MARGIN) / 1.1)
        chats = [chat_turns(chat_messages(convs[k % len(convs)].messages, opts.chat_chars), tokenize, budget,
                            opts.chat_turns) for k in range(n_rates)]
    per_rate = [prompts[k * opts.requests:(k + 1) * opts.requests] for k in range(n_rates)]
    gaps = [[rng.expovariate(1.0) for _ in range(opts.requests)] for _ in range(n_rates)]
    return Workload(prompts=per_rate, gaps=gaps, chats=chats, calibration=prompts[n_rates * opts.requests:])


# -- the engines ----------------------------------------------------------------------------------------
class Target(Protocol):
    """An OpenAI-compatible server the replay can start, address and stop."""

    @property
    def base(self) -> str:
        """``http://host:port``."""

    def start(self) -> float:
        """Start; seconds taken."""

    def stop(self) -> None:
        """Stop and free everything."""


class LlamaServerTarget:
    """llama-server with its automatic fit: ``-c`` = ctx x concurrency, ``-np`` = concurrency."""

    def __init__(self, ctx: BenchContext) -> None:
        """Describe the server (BenchError when llama-server is not built)."""
        self.args = fit_server_args(ctx.params)
        self.srv = LlamaServer(ctx.need_llama_server(), ctx.model, self.args, log_path=ctx.server_log,
                               start_timeout_s=ctx.timeout_s, request_timeout_s=ctx.timeout_s)

    @property
    def base(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{HOST}:{self.srv.port}"

    def start(self) -> float:
        """Start and load; seconds taken."""
        return self.srv.start()

    def stop(self) -> None:
        """Stop the server's process group."""
        self.srv.stop()


def _flux(ctx: BenchContext) -> Target:
    return FluxServe(ctx.settings, ctx.plan.id, log_path=ctx.settings.logs_dir / "bench-serve.log",
                     start_timeout_s=ctx.timeout_s)


TARGETS: dict[str, Callable[[BenchContext], Target]] = {"flux": _flux, "llama-server": LlamaServerTarget}


# -- one replay -----------------------------------------------------------------------------------------
def _has_text(data: str) -> bool:
    choices = json_object(data).get("choices") or [{}]
    return bool(choices[0].get("text") or (choices[0].get("delta") or {}).get("content"))


def timing(ex: Exchange, t_start: float) -> dict[str, Any]:
    """A streamed answer's TTFT, text-piece gaps, decode time per token and token counts (ms, s since t_start)."""
    times = [t for (_, d), t in zip(ex.events, ex.times, strict=True) if _has_text(d)]
    usage = next((u for _, d in reversed(ex.events) if isinstance(u := json_object(d).get("usage"), dict)), {})
    n = int(usage.get("completion_tokens") or len(times))
    err = error_body(ex)
    error = ("hung" if ex.hung else ex.transport if ex.transport else f"HTTP {ex.status}" if ex.status != 200
             else f"error {err.get('code')}" if err else None if ex.done else "stream ended without [DONE]")
    end = ex.times[-1] if ex.times else time.perf_counter()
    return {"sent_s": ex.t0 - t_start, "end_s": end - t_start, "e2e_ms": (end - ex.t0) * 1e3,
            "ttft_ms": (times[0] - ex.t0) * 1e3 if times else None,
            "itl_ms": [(b - a) * 1e3 for a, b in zip(times, times[1:], strict=False)],
            "tpot_ms": (times[-1] - times[0]) * 1e3 / (n - 1) if n > 1 and len(times) > 1 else None,
            "completion_tokens": n, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"), "error": error}


def _stream_body(n_gen: int, seed: int, **what: Any) -> dict[str, Any]:
    return {**what, "max_tokens": n_gen, "temperature": 0.0, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}}


async def _arrival(client: httpx.AsyncClient, base: str, i: int, at: float, prompt: list[int], t0: float,
                   opts: ArrivalsOptions) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
    ex = await exchange(client, "POST", f"{base}/v1/completions", body=_stream_body(opts.n_gen, opts.seed + i,
                                                                                      prompt=prompt))
    return {**timing(ex, t0), "kind": "arrival", "index": i, "scheduled_s": at, "prompt_tokens": len(prompt)}


async def _chat(client: httpx.AsyncClient, base: str, turns: list[list[dict[str, str]]], t0: float,
                opts: ArrivalsOptions) -> list[dict[str, Any]]:
    rows = []
    for i, messages in enumerate(turns):
        ex = await exchange(client, "POST", f"{base}/v1/chat/completions",
                            body=_stream_body(opts.n_gen, opts.seed, messages=messages))
        rows.append({**timing(ex, t0), "kind": "chat", "index": i})
    return rows


async def replay(base: str, schedule: list[tuple[float, list[int]]], turns: list[list[dict[str, str]]],
                 opts: ArrivalsOptions) -> list[dict[str, Any]]:
    """Send every arrival at its time, and the chat's turns one after another, all from t=0; their rows."""
    limits = client_limits(max_connections=len(schedule) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(opts.hang_s, connect=10.0), limits=limits) as client:
        t0 = time.perf_counter()
        chat = asyncio.create_task(_chat(client, base, turns, t0, opts))
        rows = await asyncio.gather(*(_arrival(client, base, i, at, p, t0, opts) for i, (at, p) in enumerate(schedule)))
        return [*rows, *await chat]


async def _one_at_a_time(base: str, prompts: list[list[int]], opts: ArrivalsOptions) -> list[dict[str, Any]]:
    """Each prompt alone, one after another (capacity and warm-up)."""
    rows = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(opts.hang_s, connect=10.0), limits=client_limits()) as client:
        for i, p in enumerate(prompts):
            ex = await exchange(client, "POST", f"{base}/v1/completions",
                                body=_stream_body(opts.n_gen, opts.seed + i, prompt=p))
            rows.append({**timing(ex, ex.t0), "index": i})
    return rows


# -- the suite ------------------------------------------------------------------------------------------
def measure_capacity(ctx: BenchContext, work: Workload, opts: ArrivalsOptions) -> tuple[float, list[float]]:
    """Requests per second ``flux serve`` completes one at a time: 1 / median latency; and the latencies (s).

    Raises:
        BenchError: flux serve did not start or failed a calibration request.
    """
    target = TARGETS["flux"](ctx)
    target.start()
    try:  # the first (8-token) request warms the server up and is not counted
        rows = asyncio.run(_one_at_a_time(target.base, [work.calibration[0][:8], *work.calibration], opts))[1:]
    finally:
        target.stop()
    bad = [r["error"] for r in rows if r["error"]]
    if bad:
        raise BenchError(f"flux serve failed a request while measuring its capacity: {bad[0]} "
                         f"(see {ctx.settings.logs_dir / 'bench-serve.log'})")
    latencies = [r["e2e_ms"] / 1e3 for r in rows]
    return 1.0 / statistics.median(latencies), latencies


def run_engine(name: str, ctx: BenchContext, work: Workload, rates_rps: Sequence[float], rnd: int,
               opts: ArrivalsOptions, progress: Progress | None) -> list[dict[str, Any]]:
    """Start one engine fresh, warm it up, replay every rate on it, stop it; a failed start is one row."""
    target = TARGETS[name](ctx)
    rows: list[dict[str, Any]] = []
    try:
        target.start()
        asyncio.run(_one_at_a_time(target.base, [work.calibration[0][:8]], opts))  # warm-up
        for k, (factor, rps) in enumerate(zip(opts.rates, rates_rps, strict=True)):
            if progress:
                progress(f"arrivals: round {rnd + 1}/{opts.rounds}, {name}: {factor:g}x = {rps:.2f} requests/s, "
                         f"{opts.requests} arrivals + {len(work.chats[k])} chat turns")
            got = asyncio.run(replay(target.base, list(zip(work.offsets(k, rps), work.prompts[k], strict=True)),
                                     work.chats[k], opts))
            rows += [{**r, "engine": name, "round": rnd, "rate_factor": factor, "rate_rps": rps} for r in got]
    except EngineError as exc:  # llama-server did not start (flux serve raises BenchError)
        log.warning("arrivals: %s failed: %s", name, exc)
        rows.append({"engine": name, "round": rnd, "kind": "start", "index": -1, "error": f"{exc.code}: {exc.message}"})
    finally:
        target.stop()
    return rows


def bench_arrivals(ctx: BenchContext, opts: ArrivalsOptions, progress: Progress | None = None) -> BenchRun:
    """Replay Poisson arrivals and a long chat on Flux and llama-server; one row per rate and one for the chat.

    Raises:
        BenchError: flux serve did not start or failed while measuring its capacity.
    """
    t0, load0 = time.monotonic(), load_avg()
    work = make_workload(ctx, opts)
    capacity, latencies = (opts.capacity, []) if opts.capacity else measure_capacity(ctx, work, opts)
    rates = [f * capacity for f in opts.rates]
    engines = ["flux"] + (["llama-server"] if ctx.llama_server is not None else [])
    rng, rows = random.Random(opts.seed), []
    for rnd in range(opts.rounds):
        rng.shuffle(engines)
        for name in list(engines):
            rows += run_engine(name, ctx, work, rates, rnd, opts, progress)
    common = {"options": opts.model_dump(mode="json"), "capacity_rps": capacity, "calibration_s": latencies,
              "rates_rps": rates, "chat_turns": [len(c) for c in work.chats], "seconds": time.monotonic() - t0,
              "llama_server_args": list(fit_server_args(ctx.params)), "load_avg_start": load0, "load_avg_end": load_avg()}
    started = [r for r in rows if r["kind"] == "start"]
    out = [summary_row(f"rate-{f:g}x", [r for r in rows if r.get("rate_factor") == f] + started, "arrival",
                       opts.n_boot, opts.seed, common) for f in opts.rates]
    if any(work.chats):
        out.append(summary_row("chat", rows, "chat", opts.n_boot, opts.seed, common))
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in RAW_SCHEMA} for r in rows], schema=RAW_SCHEMA)
    return BenchRun(suite="arrivals", ctx=ctx, rows=out, raw=table)


# -- flux bench arrivals --------------------------------------------------------------------------------
def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


SUITE = Suite(
    name="arrivals", help="replay Poisson arrivals and a long-running chat on Flux and on llama.cpp auto-fit",
    description="Measures the plan's single-stream capacity on flux serve, then replays seeded Poisson arrivals at "
                "--rates x that capacity (plus one long chat growing its context) on flux serve and on llama-server "
                "with its automatic fit, same prompts and seeds, engines in a new random order each round. Prints "
                "p50/p95/p99 TTFT and inter-token latency and throughput per engine and rate, with Flux/llama-server "
                "ratios. Fail when a Flux request fails or Flux is slower on both TTFT and decode. Exit 1 on fail.",
    options=ArrivalsOptions, run=bench_arrivals,
    flags=("rates", "requests", "n_gen", "rounds", "chat_turns", "capacity", "seed"),
    parsers={"rates": lambda text: tuple(float(x) for x in text.split(",") if x.strip())},
    help_text={"rates": "arrival rates as multiples of the single-stream capacity",
               "rounds": "rounds, engines in a new order each", "chat_turns": "turns of the long chat",
               "capacity": "single-stream capacity in requests/s (default: measure it)"})
