"""``flux bench serve``: the plan served by ``flux serve``, raced side by side against what it should match or beat.

Each benchmark races two things in one run, in paired rounds whose order alternates at random, takes
medians, and reports ratios (client-side timing from the SSE stream, :mod:`tasks.bench.serve_client`):

1. overhead     decode tok/s and time to first token through ``flux serve`` (``/v1/completions``, streamed,
                short prompts) vs the plan's parameters in llama-cpp-python's own ``Llama`` in a process of
                its own (:mod:`tasks.bench.inprocess`, streaming ``create_completion``); 2 x --rounds
                paired rounds. Target: decode >= 0.97x, added TTFT <= 5 ms.
2. peers        flux serve vs ``python -m llama_cpp.server`` vs llama.cpp's ``llama-server``, the plan's flags
                everywhere: tok/s of 1 stream and of as many concurrent streams as the plan has sequences.
                A peer that is not installed or built is left out (its ratios n/a).
3. parking      TTFT of a return to a parked conversation (``--park-tokens``: A, then as many other prompts
                as the plan has sequences replace it, then A + a new user turn) vs the same A + turn sent
                cold to a second fresh server. Target <= 0.3x.
4. concurrency  aggregate tok/s of as many streams as the plan has sequences vs 1 stream (a plan of one
                sequence: n/a). Target: the whole interval above 1x.

Rows: ``bench_serve_raw`` holds one row per benchmark with the columns the serving benchmark always had
(``benchmark, model, plan_id, ratio_name, ratio, ci_low, ci_high, n, target, met, detail, seconds, threads,
load_avg_start, load_avg_end, metrics``); ``bench_summary`` one per benchmark: pass when its target is met,
fail when not (info when the machine was busy, or the benchmark does not apply to the plan).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any, Literal

import pyarrow as pa

from engine_bridge.errors import EngineError
from tasks.bench.context import BenchContext, Progress
from tasks.bench.errors import BenchError
from tasks.bench.host import busy_warning, load_avg
from tasks.bench.record import BenchRun, SummaryRow
from tasks.bench.registry import Suite, csv
from tasks.bench.serve_races import (
    Benchmark,
    BenchmarkRow,
    ServeOptions,
    concurrency,
    overhead,
    parking,
    peers,
)

log = logging.getLogger(__name__)
RAW_SCHEMA = pa.schema([
    ("created_at", pa.timestamp("us", tz="UTC")), ("benchmark", pa.string()), ("model", pa.string()),
    ("plan_id", pa.string()), ("ratio_name", pa.string()), ("ratio", pa.float64()), ("ci_low", pa.float64()),
    ("ci_high", pa.float64()), ("n", pa.int64()), ("target", pa.string()), ("met", pa.bool_()),
    ("detail", pa.string()), ("seconds", pa.float64()), ("threads", pa.int64()), ("load_avg_start", pa.string()),
    ("load_avg_end", pa.string()), ("metrics", pa.string()),
])


RaceFn = Callable[[BenchContext, ServeOptions, random.Random, Progress | None], BenchmarkRow]
RACES: dict[Benchmark, RaceFn] = {"overhead": overhead, "peers": peers, "parking": parking,
                                  "concurrency": concurrency}


def _verdict(row: BenchmarkRow, busy: str | None) -> SummaryRow:
    """Pass when the target is met, fail when not; info when it does not apply or the machine was busy."""
    ratio = {"ratio_prefill" if row.get("ttft_ratio") else "ratio_decode": row.get("ratio"),
             "prefill_ci_low" if row.get("ttft_ratio") else "ci_low": row.get("ci_low"),
             "prefill_ci_high" if row.get("ttft_ratio") else "ci_high": row.get("ci_high")}
    detail = f"{row.get('ratio_name') or row['benchmark']}: {row['detail']}"
    met = row.get("met")
    verdict: Literal["pass", "fail", "info"] = "info" if met is None else "pass" if met else "fail"
    if verdict == "fail" and busy:
        verdict, detail = "info", f"inconclusive: {busy}; {detail}"
    metrics = {k: row.get(k) for k in ("target", "threads", "seconds", "load_avg_start", "load_avg_end")}
    return SummaryRow(baseline=row["benchmark"], verdict=verdict, detail=detail, n_samples=row.get("n"),
                      metrics={**metrics, **row.get("metrics", {})}, **ratio)


def _run_one(name: Benchmark, ctx: BenchContext, opts: ServeOptions, rng: random.Random,
             progress: Progress | None) -> tuple[BenchmarkRow, str | None]:
    """One benchmark's row (an error is a row that did not meet its target) and the busy warning of its time."""
    if progress:
        progress(f"serve: {name}")
    t0, load0 = time.monotonic(), load_avg()
    try:
        row = RACES[name](ctx, opts, rng, progress)
    except (BenchError, EngineError) as exc:  # one benchmark failing must not lose the others' results
        log.warning("serve: %s failed: %s", name, exc)
        row = {"benchmark": name, "met": False, "detail": f"error: {type(exc).__name__}: {exc}"}
    load1 = load_avg()
    row.update(seconds=time.monotonic() - t0, threads=ctx.params.n_threads, load_avg_start=json.dumps(load0),
               load_avg_end=json.dumps(load1), model=row.get("model") or ctx.model.name, plan_id=ctx.plan.id)
    return row, busy_warning([*load0[:1], *load1[:1]])


def bench_serve(ctx: BenchContext, opts: ServeOptions, progress: Progress | None = None) -> BenchRun:
    """Run the chosen serving benchmarks on the plan; one raw row and one summary row per benchmark."""
    rng = random.Random(opts.seed)
    run = BenchRun(suite="serve", ctx=ctx, rows=[], raw=pa.table({}))
    raws: list[dict[str, Any]] = []
    for name in dict.fromkeys(opts.only):
        row, busy = _run_one(name, ctx, opts, rng, progress)
        run.rows.append(_verdict(row, busy))
        raws.append({**row, "created_at": run.created_at, "metrics": json.dumps(row.get("metrics", {}), default=str)})
    run.raw = pa.Table.from_pylist([{f.name: r.get(f.name) for f in RAW_SCHEMA} for r in raws], schema=RAW_SCHEMA)
    return run


SUITE = Suite(
    name="serve", help="race flux serve against in-process llama-cpp-python and the peer servers; parking; concurrency",
    description="Four races on the plan as flux serve serves it, each in paired rounds of random order: overhead "
                "(decode and TTFT vs llama-cpp-python in its own process, same parameters; target >= 0.97x decode, "
                "<= 5 ms added TTFT), peers (tok/s vs python -m llama_cpp.server and llama-server, 1 stream and "
                "one per sequence), parking (TTFT of a return to a parked conversation vs the same prompt cold; "
                "target <= 0.3x), concurrency (tok/s of one stream per sequence vs 1 stream). Rows: bench_serve_raw "
                "and bench_summary. Exit 1 when a target is missed.",
    options=ServeOptions, run=bench_serve, flags=("only", "rounds", "n_gen", "park_tokens", "seed"),
    parsers={"only": csv}, help_text={"only": "comma-separated benchmarks: overhead, peers, parking, concurrency"})

