"""``flux bench ttft``: where serving's time to first token goes, on the plan's own parameters.

Three arms on the same short prompts (corpus prompts cut to 24 characters, differing from their first
characters on; one more warms up), each reading every reply to its end (:mod:`tasks.bench.ttft_arms`):

1. llama-cpp-python in its own process, streaming ``create_completion`` (:mod:`tasks.bench.inprocess`);
2. the plan's worker driven directly: a ``tokenize`` round trip, then ``generate`` to its first token event;
3. ``flux serve`` of the plan over HTTP, ``/v1/completions`` with ``stream``, to the first text.

Rows: worker/in-process and HTTP/worker (ratios of the medians, and the time HTTP adds).

``--pairs N`` measures the HTTP path's added time the way a busy machine still allows: one flux serve and one
separate worker, each prompt sent to both back to back (in alternating order), N rounds; the median of the
paired differences (HTTP - worker) is the added TTFT. ``--busy N`` measures what a request waits while another
reply decodes (a plan of 2 or more sequences): N pairs of distinct prompts, one on the idle server, the other
while a long reply decodes (alternating), paired. Either replaces the three arms.

Every row is ``info``: this suite explains the time, it does not gate on it (``flux bench serve``'s overhead
race holds the target). ``bench_ttft_raw``: one row per timed request (mode, arm, round, prompt, ms).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from tasks.bench import ttft_arms as arms
from tasks.bench.context import BenchContext, Progress
from tasks.bench.host import load_avg
from tasks.bench.record import BenchRun, SummaryRow
from tasks.bench.registry import Suite
from tasks.bench.serve_client import corpus_texts
from tasks.bench.stats import paired_ratio

RAW_SCHEMA = pa.schema([
    ("mode", pa.string()), ("arm", pa.string()), ("round", pa.int32()), ("prompt_index", pa.int32()),
    ("ttft_ms", pa.float64()), ("tokenize_ms", pa.float64()),
])
CHARS = 24  # short prompts: TTFT is mostly overhead, not prefill


class TtftOptions(BaseModel):
    """What ``flux bench ttft`` times."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    prompts: int = Field(12, ge=1, le=40, description="prompts timed per arm and round")
    max_tokens: int = Field(4, ge=1, le=1024, description="tokens each request asks for")
    pairs: int = Field(0, ge=0, le=50, description="rounds of the paired worker/HTTP comparison (0: the three arms)")
    busy: int = Field(0, ge=0, le=20, description="pairs of prompts timed idle and while another reply decodes")
    n_boot: int = Field(4000, ge=100)


def _ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def _quartiles_ms(diffs: list[float]) -> tuple[float, float, float]:
    s = sorted(diffs)
    return s[len(s) // 4] * 1e3, _ms(s), s[3 * len(s) // 4] * 1e3


def _raw(mode: str, arm: str, values: list[float], per_round: int, tok: list[float] | None = None) -> list[dict[str, Any]]:
    return [{"mode": mode, "arm": arm, "round": i // per_round, "prompt_index": i % per_round, "ttft_ms": v * 1e3,
             "tokenize_ms": tok[i] * 1e3 if tok else None} for i, v in enumerate(values)]


def _arms(ctx: BenchContext, opts: TtftOptions, progress: Progress | None) -> tuple[list[SummaryRow], list[dict[str, Any]]]:
    """In-process, worker and HTTP one after the other; the warm-up prompt is dropped from each."""
    texts = corpus_texts(opts.prompts + 1, CHARS)
    ordered = texts[-1:] + texts[:-1]  # the warm-up first
    if progress:
        progress(f"ttft: {opts.prompts} prompts through llama-cpp-python in process, the worker, flux serve")
    a = arms.in_process(ctx, ordered, opts.max_tokens)[1:]
    tok, b = (x[1:] for x in asyncio.run(arms.worker(ctx, ordered, opts.max_tokens)))
    c = asyncio.run(arms.http(ctx, ordered, opts.max_tokens))[1:]
    common = {"in_process_ms": _ms(a), "worker_ms": _ms(b), "tokenize_ms": _ms(tok), "http_ms": _ms(c),
              "prompts": opts.prompts, "max_tokens": opts.max_tokens}
    rows = [SummaryRow(baseline="worker/in-process", verdict="info", ratio_prefill=_ms(b) / _ms(a), n_samples=len(b),
                       detail=f"Flux worker (tokenize+generate) {_ms(b):.1f} ms (tokenize round trip {_ms(tok):.2f} "
                              f"ms) vs in-process llama-cpp-python {_ms(a):.1f} ms, medians: worker/in-process "
                              f"{_ms(b) / _ms(a):.3f}x", metrics=common),
            SummaryRow(baseline="http/worker", verdict="info", ratio_prefill=_ms(c) / _ms(b), n_samples=len(c),
                       detail=f"HTTP, max_tokens {opts.max_tokens}: {_ms(c):.1f} ms vs worker {_ms(b):.1f} ms, medians: "
                              f"HTTP/worker {_ms(c) / _ms(b):.3f}x, added {_ms(c) - _ms(b):+.1f} ms", metrics=common)]
    raw = (_raw("arms", "in-process", a, len(a)) + _raw("arms", "worker", b, len(b), tok) +
           _raw("arms", "http", c, len(c)))
    return rows, raw


def _pairs(ctx: BenchContext, opts: TtftOptions, progress: Progress | None) -> tuple[list[SummaryRow], list[dict[str, Any]]]:
    """The paired worker/HTTP comparison: the median of the differences is the added TTFT."""
    if progress:
        progress(f"ttft: {opts.pairs} rounds of {opts.prompts} prompts, each to the worker and to flux serve")
    ws, hs = asyncio.run(arms.paired(ctx, corpus_texts(opts.prompts + 1, CHARS), opts.pairs, opts.max_tokens))
    diffs = [h - w for w, h in zip(ws, hs, strict=True)]
    q1, mid, q3 = _quartiles_ms(diffs)
    ci = paired_ratio(hs, ws, n_boot=opts.n_boot)
    detail = (f"{len(diffs)} paired prompts (max_tokens {opts.max_tokens}): worker {_ms(ws):.1f} ms, HTTP "
              f"{_ms(hs):.1f} ms (medians); added by HTTP (paired): median {mid:+.2f} ms, quartiles {q1:+.2f} .. "
              f"{q3:+.2f} ms; HTTP/worker {ci.text()}")
    row = SummaryRow(baseline="http-worker-paired", verdict="info", detail=detail, ratio_prefill=ci.ratio,
                     prefill_ci_low=ci.low, prefill_ci_high=ci.high, n_samples=len(diffs),
                     metrics={"added_ms": [d * 1e3 for d in diffs], "added_ms_median": mid, "quartiles_ms": [q1, q3],
                              "ratio": ci.model_dump(), "rounds": opts.pairs, "max_tokens": opts.max_tokens})
    return [row], _raw("pairs", "worker", ws, opts.prompts) + _raw("pairs", "http", hs, opts.prompts)


def _busy(ctx: BenchContext, opts: TtftOptions, progress: Progress | None) -> tuple[list[SummaryRow], list[dict[str, Any]]]:
    """TTFT idle vs while another reply decodes, paired; n/a on a plan of one sequence."""
    if ctx.params.n_seq_max < 2:
        return [SummaryRow(baseline="busy", verdict="info", detail="n/a: the plan serves one sequence; a busy server "
                           "needs two (plan with --concurrency 2)")], []
    if progress:
        progress(f"ttft: {opts.busy} pairs of prompts, idle and while another reply decodes")
    idle, loaded = asyncio.run(arms.busy(ctx, corpus_texts(2 * opts.busy + 1, CHARS), opts.max_tokens))
    waits = [b - i for i, b in zip(idle, loaded, strict=True)]
    q1, mid, q3 = _quartiles_ms(waits)
    ci = paired_ratio(loaded, idle, n_boot=opts.n_boot)
    detail = (f"{ctx.params.n_seq_max} sequences, {len(waits)} prompts: TTFT idle {_ms(idle):.1f} ms, while another "
              f"reply decodes {_ms(loaded):.1f} ms; paired wait median {mid:+.2f} ms, quartiles {q1:+.2f} .. "
              f"{q3:+.2f} ms")
    row = SummaryRow(baseline="busy", verdict="info", detail=detail, ratio_prefill=ci.ratio, prefill_ci_low=ci.low,
                     prefill_ci_high=ci.high, n_samples=len(waits),
                     metrics={"wait_ms": [w * 1e3 for w in waits], "wait_ms_median": mid, "quartiles_ms": [q1, q3]})
    return [row], _raw("busy", "idle", idle, len(idle)) + _raw("busy", "busy", loaded, len(loaded))


def bench_ttft(ctx: BenchContext, opts: TtftOptions, progress: Progress | None = None) -> BenchRun:
    """Time the first token through each arm (or the paired / busy comparisons); ``info`` rows."""
    t0, load0 = time.monotonic(), load_avg()
    modes = [m for m, n in ((_busy, opts.busy), (_pairs, opts.pairs)) if n] or [_arms]
    rows: list[SummaryRow] = []
    raw: list[dict[str, Any]] = []
    for mode in modes:
        got, r = mode(ctx, opts, progress)
        rows += got
        raw += r
    common = {"options": opts.model_dump(mode="json"), "seconds": time.monotonic() - t0, "load_avg_start": load0,
              "load_avg_end": load_avg(), "threads": ctx.params.n_threads, "n_seq_max": ctx.params.n_seq_max}
    rows = [r.model_copy(update={"metrics": {**common, **r.metrics}}) for r in rows]
    return BenchRun(suite="ttft", ctx=ctx, rows=rows, raw=pa.Table.from_pylist(raw, schema=RAW_SCHEMA))


SUITE = Suite(
    name="ttft", help="where the time to first token goes: llama-cpp-python in process vs the plan's worker vs flux serve",
    description="The same short prompts through llama-cpp-python in its own process, the plan's worker driven "
                "directly (tokenize + generate) and flux serve over HTTP, every reply read to its end; prints the "
                "medians, worker/in-process, HTTP/worker and the time HTTP adds. --pairs N: worker and HTTP paired "
                "per prompt, N rounds; --busy N: TTFT while another reply decodes (2+ sequences). Rows are info.",
    options=TtftOptions, run=bench_ttft, flags=("prompts", "max_tokens", "pairs", "busy"),
    help_text={"pairs": "rounds of the paired worker/HTTP comparison instead of the three arms",
               "busy": "pairs of prompts timed idle and while another reply decodes, instead of the three arms"})
