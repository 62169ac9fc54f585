"""The four races of ``flux bench serve`` (:mod:`tasks.bench.serve`), each on the plan as ``flux serve`` serves it.

Each returns its row of ``bench_serve_raw`` (benchmark, ratio_name, ratio, interval, target, met, detail,
metrics); ``met`` is None where the benchmark does not apply to the plan.
"""

from __future__ import annotations

import random
import statistics
from contextlib import ExitStack
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine_bridge.client import tokenizer
from engine_bridge.errors import EngineError
from tasks.bench.context import BenchContext, Progress
from tasks.bench.errors import BenchError
from tasks.bench.inprocess import InProcess
from tasks.bench.serve_client import Got, aggregate_tps, corpus_texts, long_texts, shuffled, streams
from tasks.bench.serve_peers import PEERS, flux_serve, llama_cpp_python_server, llama_server
from tasks.bench.stats import RatioCI, paired_ratio

Benchmark = Literal["overhead", "peers", "parking", "concurrency"]
BenchmarkRow = dict[str, Any]
COMPLETIONS = "/v1/completions"


class ServeOptions(BaseModel):
    """How ``flux bench serve`` races."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    only: tuple[Benchmark, ...] = Field(("overhead", "peers", "parking", "concurrency"), min_length=1,
                                        description="benchmarks to run")
    rounds: int = Field(4, ge=1, le=20, description="paired rounds per benchmark (overhead: twice as many)")
    n_gen: int | None = Field(None, ge=2, le=4096, description=(
        "tokens per reply (default: overhead 32, peers 24, concurrency 64)"))
    park_tokens: int = Field(2000, ge=16, description=(
        "tokens of the parked conversation (at most 2/3 of the plan's context)"))
    seed: int = 0
    n_boot: int = Field(4000, ge=100)


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _ratio_fields(ci: RatioCI) -> dict[str, Any]:
    return {"ratio": ci.ratio, "ci_low": ci.low, "ci_high": ci.high, "n": ci.n}


def _body(text: str, max_tokens: int) -> dict[str, Any]:
    return {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0}


# -- 1. overhead ------------------------------------------------------------------------------------------
def _local(llm: InProcess, text: str, max_tokens: int) -> Got:
    """One completion in llama-cpp-python's own process, as a :class:`Got`."""
    c = llm.complete(text, max_tokens)
    if c.ttft_s is None or c.last_s is None:
        raise BenchError("in-process llama-cpp-python streamed no text")
    return Got(ttft_s=c.ttft_s, tokens=c.tokens(max_tokens), decode_tps=c.decode_tps(max_tokens), end_s=c.last_s,
               sent_s=0.0, cached=None)


def overhead(ctx: BenchContext, opts: ServeOptions, rng: random.Random, progress: Progress | None) -> BenchmarkRow:
    """flux serve vs the same parameters in llama-cpp-python's own process (streaming create_completion)."""
    n_gen, rounds, p = opts.n_gen or 32, 2 * opts.rounds, ctx.params
    texts = corpus_texts(rounds + 1, 24)  # short prompts: TTFT is mostly overhead, not prefill, so its noise is small
    got: dict[str, list[Got]] = {"flux": [], "in-process": []}
    log_path = ctx.settings.logs_dir / "bench-inprocess.log"
    with InProcess(ctx.model, p, log_path=log_path, timeout_s=ctx.timeout_s) as llm, flux_serve(ctx) as base:
        streams(base, COMPLETIONS, [_body(texts[-1], 4)])  # warm-up (not timed), a prompt no round uses
        _local(llm, texts[-1], 4)
        for r in range(rounds):
            for arm in shuffled(rng, list(got)):
                got[arm].append(streams(base, COMPLETIONS, [_body(texts[r], n_gen)])[0] if arm == "flux"
                                else _local(llm, texts[r], n_gen))
    f, loc = got["flux"], got["in-process"]
    dec = paired_ratio([g.decode_tps or 0 for g in f], [g.decode_tps or 0 for g in loc], n_boot=opts.n_boot,
                       seed=opts.seed)
    added = [(a.ttft_s - b.ttft_s) * 1e3 for a, b in zip(f, loc, strict=True)]
    met = (dec.ratio or 0) >= 0.97 and _med(added) <= 5.0
    detail = (f"decode {_med([g.decode_tps or 0 for g in f]):.2f} vs {_med([g.decode_tps or 0 for g in loc]):.2f} "
              f"tok/s = {dec.text()} (target >= 0.97x); TTFT {_med([g.ttft_s for g in f]) * 1e3:.1f} vs "
              f"{_med([g.ttft_s for g in loc]) * 1e3:.1f} ms, added {_med(added):+.1f} ms median of paired rounds "
              f"(target <= 5 ms)")
    return {"benchmark": "overhead", "ratio_name": "decode flux/in-process", **_ratio_fields(dec),
            "target": ">= 0.97x decode, <= 5 ms added TTFT", "met": met, "detail": detail,
            "metrics": {"added_ttft_ms": added, "added_ttft_ms_median": _med(added), "n_gen": n_gen,
                        "flux": [g.row() for g in f], "in_process": [g.row() for g in loc],
                        "params": " ".join(p.cli_args())}}


# -- 2. peers ---------------------------------------------------------------------------------------------
def _start_peers(stack: ExitStack, ctx: BenchContext) -> tuple[dict[str, str], dict[str, str]]:
    """({peer: base URL} of those that started, {peer: why not} of the others); flux serve must start."""
    p = ctx.params
    bases = {"flux": stack.enter_context(flux_serve(ctx))}
    missing: dict[str, str] = {}
    for name in PEERS[1:]:
        try:
            bases[name] = stack.enter_context(
                llama_cpp_python_server(ctx, p.model_copy(update={"n_seq_max": 1})) if name == "llama-cpp-python"
                else llama_server(ctx, p))
        except (BenchError, EngineError) as exc:
            missing[name] = str(exc)
    return bases, missing


def peers(ctx: BenchContext, opts: ServeOptions, rng: random.Random, progress: Progress | None) -> BenchmarkRow:
    """flux serve vs llama_cpp.server vs llama-server, same model and flags: 1 stream and one per sequence."""
    n_gen, k = opts.n_gen or 24, ctx.params.n_seq_max
    widths = sorted({1, k})
    texts = corpus_texts((k + 1) * opts.rounds + 1, 72)
    with ExitStack() as stack:
        bases, missing = _start_peers(stack, ctx)
        names = list(bases)
        tps: dict[tuple[str, int], list[float]] = {(e, w): [] for e in names for w in widths}
        single: dict[str, list[Got]] = {e: [] for e in names}
        for base in bases.values():
            streams(base, COMPLETIONS, [_body(texts[-1], 4)])  # warm-up
        for r in range(opts.rounds):
            batch = texts[(k + 1) * r:(k + 1) * (r + 1)]
            for name in shuffled(rng, names):
                single[name] += streams(bases[name], COMPLETIONS, [_body(batch[0], n_gen)])
                tps[(name, 1)].append(aggregate_tps(single[name][-1:]))
                if k > 1:
                    tps[(name, k)].append(aggregate_tps(streams(bases[name], COMPLETIONS,
                                                                [_body(t, n_gen) for t in batch[1:]])))
    ratios = {f"flux/{peer} x{w}": paired_ratio(tps[("flux", w)], tps[(peer, w)], n_boot=opts.n_boot, seed=opts.seed)
              for peer in names[1:] for w in widths}
    medians = {f"{e} x{w}": _med(v) for (e, w), v in tps.items()}
    parts = {e: f"TTFT {_med([g.ttft_s for g in v]) * 1e3:.0f} ms, decode {_med([g.decode_tps or 0 for g in v]):.1f} "
                f"tok/s" for e, v in single.items()}
    detail = "; ".join([f"{name} {ci.text()}" for name, ci in ratios.items()] +
                       [f"{peer} n/a ({why})" for peer, why in missing.items()]) + " | tok/s medians: " + ", ".join(
        f"{key} {v:.1f}" for key, v in medians.items()) + " | 1 stream: " + "; ".join(f"{e} {t}" for e, t in parts.items())
    main_name = next((n for n in (f"flux/llama-server x{k}", f"flux/llama-cpp-python x{k}") if n in ratios), None)
    main = ratios[main_name] if main_name else RatioCI(ratio=None, low=None, high=None, n=0)
    met = all((ci.ratio or 0) >= 0.97 for ci in ratios.values()) if ratios else None
    return {"benchmark": "peers", "ratio_name": f"tok/s {main_name or 'flux/peer: no peer ran'}", **_ratio_fields(main),
            "target": ">= 0.97x of each peer (no target in the issue: same or better)", "met": met, "detail": detail,
            "metrics": {"ratios": {key: v.model_dump() for key, v in ratios.items()}, "missing": missing,
                        "tps": {f"{e} x{w}": v for (e, w), v in tps.items()}, "medians": medians,
                        "single_stream": parts, "n_gen": n_gen, "flags": " ".join(ctx.params.cli_args())}}


# -- 3. parking -------------------------------------------------------------------------------------------
TURN = [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Now summarize it in one line."}]


def _chat(base: str, messages: list[dict[str, str]]) -> Got:
    return streams(base, "/v1/chat/completions", [{"messages": messages, "max_tokens": 8, "temperature": 0.0}])[0]


def parking(ctx: BenchContext, opts: ServeOptions, rng: random.Random, progress: Progress | None) -> BenchmarkRow:
    """TTFT of a return to a parked conversation vs the same prompt cold on a fresh server."""
    k = ctx.params.n_seq_max
    n_tokens = min(opts.park_tokens, 2 * ctx.params.n_ctx // 3)
    with tokenizer(ctx.model, ctx.worker_log, ctx.timeout_s) as tokenize:
        convs = long_texts(tokenize, opts.rounds, n_tokens)
    others = corpus_texts(k * opts.rounds + 1, 400)
    parked: list[Got] = []
    cold: list[Got] = []
    with flux_serve(ctx) as hot, flux_serve(ctx) as fresh:
        for base in (hot, fresh):
            _chat(base, [{"role": "user", "content": others[-1]}])  # warm-up
        for r, text in enumerate(convs):
            a = [{"role": "user", "content": text}]
            for arm in shuffled(rng, ["parked", "cold"]):
                if arm == "parked":
                    _chat(hot, a)  # A: a long prefill
                    for other in others[k * r:k * (r + 1)]:  # as many others as sequences: A is parked
                        _chat(hot, [{"role": "user", "content": other}])
                    parked.append(_chat(hot, a + TURN))
                else:
                    cold.append(_chat(fresh, a + TURN))
    ci = paired_ratio([g.ttft_s for g in parked], [g.ttft_s for g in cold], n_boot=opts.n_boot, seed=opts.seed)
    detail = (f"TTFT parked {_med([g.ttft_s for g in parked]) * 1e3:.0f} ms vs cold "
              f"{_med([g.ttft_s for g in cold]) * 1e3:.0f} ms = {ci.text()} (target <= 0.3x), ~{n_tokens}-token "
              f"conversation; cached tokens parked {[g.cached for g in parked]}, cold {[g.cached for g in cold]}")
    return {"benchmark": "parking", "ratio_name": "TTFT parked/cold", "ttft_ratio": True, **_ratio_fields(ci),
            "target": "<= 0.3x", "met": (ci.ratio or 9) <= 0.3, "detail": detail,
            "metrics": {"parked": [g.row() for g in parked], "cold": [g.row() for g in cold], "tokens": n_tokens}}


# -- 4. concurrency ---------------------------------------------------------------------------------------
def concurrency(ctx: BenchContext, opts: ServeOptions, rng: random.Random, progress: Progress | None) -> BenchmarkRow:
    """Aggregate tok/s of one stream per sequence vs 1 stream."""
    n_gen, k = opts.n_gen or 64, ctx.params.n_seq_max
    name = f"tok/s {k} streams/1"
    if k < 2:
        return {"benchmark": "concurrency", "ratio_name": name, "target": "> 1x", "met": None,
                "detail": "n/a: the plan serves one sequence (plan with --concurrency 2 or more)"}
    texts = corpus_texts((k + 1) * opts.rounds + 1, 200)
    tps: dict[str, list[float]] = {"1": [], str(k): []}
    with flux_serve(ctx) as base:
        streams(base, COMPLETIONS, [_body(texts[-1], 4)])
        for r in range(opts.rounds):
            batch = texts[(k + 1) * r:(k + 1) * (r + 1)]
            for arm in shuffled(rng, list(tps)):
                chosen = batch[:1] if arm == "1" else batch[1:]
                tps[arm].append(aggregate_tps(streams(base, COMPLETIONS, [_body(t, n_gen) for t in chosen])))
    ci = paired_ratio(tps[str(k)], tps["1"], n_boot=opts.n_boot, seed=opts.seed)
    detail = f"{k} streams {_med(tps[str(k)]):.1f} tok/s vs 1 stream {_med(tps['1']):.1f} tok/s = {ci.text()}"
    return {"benchmark": "concurrency", "ratio_name": name, **_ratio_fields(ci), "target": "> 1x",
            "met": (ci.low or 0) > 1.0, "detail": detail, "metrics": {"tps": tps, "n_gen": n_gen}}
