"""``flux bench oracle``: the plan against llama-cpp-python's defaults and the oracle, the best of its whole search space.

What it measures (it plans nothing): how close ``flux plan``'s choice comes to the best candidate of the space
the planner searched, and what it gains over the defaults. The space is the stored one the plan's candidate
came from (kind ``space``, written by ``flux plan``'s enumerate stage); the planner's wall time is the plan's
own record (``stage_seconds``). Then, in workers started fresh every round (the plan's engine):

1. every candidate of the space is timed on the plan's workload (its measured prompt lengths and generated
   tokens, the planner's own ``tune`` prompts) in ``--grid-rounds`` randomized rounds, and the one with the
   shortest workload time (median over rounds) is the oracle; the grid's wall time is recorded;
2. the plan, the defaults and the oracle race in ``--rounds`` paired randomized rounds.

A round's figures are those ``flux plan`` ranks by: prefill = all prompt tokens over all prompt time, decode =
all generated tokens over all decode time, workload = the sum of both times. Ratios are paired by round:
plan/other for prefill and decode, other/plan for workload time (above 1: the plan is better).

Rows: ``bench_oracle_raw`` holds one row per run with the columns of the planning benchmark (model, plan_id,
plan_s, grid_s, grid_size, oracle, plan_candidate, medians, ``vs_oracle_*`` and ``vs_defaults_*`` ratios, at);
``bench_summary`` one row for the oracle (``info``: the best of a noisy grid is an upper bound, not a gate) and
one for the defaults (``fail`` when the plan's workload is slower, the whole interval below 1).
"""

from __future__ import annotations

import datetime as dt
import statistics
import time
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from artifacts.records.kinds import SPACE
from artifacts.records.search import PlacementSpace
from artifacts.records.store import Records
from tasks.bench.context import BenchContext, Progress
from tasks.bench.engines import EngineSpec, llama_cpp_python_defaults, plan_engine
from tasks.bench.errors import BenchError
from tasks.bench.host import load_avg
from tasks.bench.record import BenchRun, SummaryRow, Verdict
from tasks.bench.registry import Suite
from tasks.bench.rows import tokenize_prompts
from tasks.bench.run import engine_error, prompt_lengths, race, trial_busy
from tasks.bench.stats import RatioCI, paired_ratio

FIGURES = ("workload", "prefill", "decode")
RAW_SCHEMA = pa.schema([
    ("model", pa.string()), ("plan_id", pa.string()), ("plan_s", pa.float64()), ("grid_s", pa.float64()),
    ("grid_size", pa.int64()), ("oracle", pa.string()), ("plan_candidate", pa.string()),
    *((f"{e}_{k}", pa.float64()) for e in ("plan", "defaults", "oracle") for k in ("prefill", "decode")),
    *((f"vs_{b}_{k}", pa.float64()) for b in ("oracle", "defaults") for k in FIGURES),
    ("at", pa.string()),
])


class OracleOptions(BaseModel):
    """How ``flux bench oracle`` races."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rounds: int = Field(4, ge=1, le=50, description="paired rounds of the plan, the defaults and the oracle")
    grid_rounds: int = Field(2, ge=1, le=20, description="rounds of every candidate of the space")
    seed: int = 0
    n_boot: int = Field(4000, ge=100)


def stored_space(ctx: BenchContext) -> PlacementSpace:
    """The newest stored search space that holds the plan's candidate.

    Raises:
        BenchError: none does (the plan was not made by ``flux plan`` here, or its space was removed).
    """
    records = Records(ctx.store)
    for row in reversed(records.rows(SPACE)):
        space = records.get(SPACE, row["id"])
        if ctx.plan.candidate in space.candidates:
            return space
    raise BenchError(f"no stored search space holds plan {ctx.plan.id[:12]}'s candidate {ctx.plan.candidate.id}: "
                     f"plan the model here (`flux plan {ctx.model} --replan`) and bench the new plan")


def round_figures(table: pa.Table, engine: str) -> dict[int, dict[str, float | None]]:
    """Per round of ``engine`` without error: its prefill and decode tok/s and workload seconds (as flux plan's)."""
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in table.to_pylist():
        if r["engine"] == engine and not r["error"]:
            by_round.setdefault(r["round"], []).append(r)
    out = {}
    for rnd, rs in by_round.items():
        p_ms, g_ms = sum(r["prompt_ms"] for r in rs), sum(r["gen_ms"] for r in rs)
        out[rnd] = {"prefill": sum(r["prompt_tokens"] for r in rs) / p_ms * 1e3 if p_ms > 0 else None,
                    "decode": sum(r["gen_tokens"] for r in rs) / g_ms * 1e3 if g_ms > 0 else None,
                    "workload": (p_ms + g_ms) / 1e3}
    return out


def medians(table: pa.Table, engine: str) -> dict[str, float | None]:
    """The median over rounds of each figure of ``engine`` (None without a measured round)."""
    rounds = round_figures(table, engine).values()
    out: dict[str, float | None] = {}
    for k in FIGURES:
        vals = [x for r in rounds if (x := r[k]) is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


def versus(table: pa.Table, other: str, opts: OracleOptions) -> dict[str, RatioCI]:
    """Plan vs ``other`` paired by round: plan/other tok/s, other/plan workload time (above 1: the plan is better)."""
    plan, them = round_figures(table, "plan"), round_figures(table, other)
    keys = sorted(plan.keys() & them.keys())
    out = {}
    for i, k in enumerate(FIGURES):
        mine, theirs = [plan[r][k] or 0.0 for r in keys], [them[r][k] or 0.0 for r in keys]
        num, den = (theirs, mine) if k == "workload" else (mine, theirs)
        out[k] = paired_ratio(num, den, n_boot=opts.n_boot, seed=opts.seed + i)
    return out


def _workload(ctx: BenchContext, space: PlacementSpace) -> tuple[list[int], int]:
    """The plan's measured workload (prompt lengths, generated tokens), else the run suite's ladder."""
    if ctx.plan.workload_lengths and ctx.plan.workload_n_gen:
        return list(ctx.plan.workload_lengths), ctx.plan.workload_n_gen
    n_ctx = min(c.params.n_ctx for c in space.candidates)
    return prompt_lengths(n_ctx, 32, 3), 32


def _grid(ctx: BenchContext, space: PlacementSpace, prompts: list[list[int]], n_gen: int, opts: OracleOptions,
          progress: Progress | None) -> tuple[str, dict[str, dict[str, Any]], float]:
    """Time every candidate; (the oracle's id, each candidate's medians, the grid's seconds)."""
    specs = [EngineSpec(name=c.id, kind="worker", params=c.params, note=" ".join(c.params.cli_args()))
             for c in space.candidates]
    t0 = time.monotonic()
    table = race(specs, ctx, prompts, n_gen, opts.grid_rounds, opts.seed, progress)
    grid_s = time.monotonic() - t0
    figures = {s.name: {**medians(table, s.name), "error": engine_error(table, s.name)} for s in specs}
    timed: dict[str, float] = {cid: float(f["workload"]) for cid, f in figures.items()
                               if f["workload"] is not None and not f["error"]}
    if not timed:
        raise BenchError(f"every candidate of the space failed (first: {next(iter(figures.values()))['error']}): "
                         f"see {ctx.worker_log}")
    return min(timed, key=lambda cid: timed[cid]), figures, grid_s


def _row(name: str, vs: dict[str, RatioCI], table: pa.Table, busy: str | None, metrics: dict[str, Any]) -> SummaryRow:
    """The plan against ``name`` (oracle: info; defaults: fail when the plan's workload is slower)."""
    err = engine_error(table, "plan") or engine_error(table, name)
    if err:
        return SummaryRow(baseline=name, verdict="fail" if engine_error(table, "plan") else "info",
                          detail=f"not compared: {err}", metrics=metrics)
    detail = ", ".join(f"{k} {vs[k].text()} ({vs[k].outcome})" for k in FIGURES)
    slower = name == "defaults" and vs["workload"].outcome == "slower"
    verdict: Verdict = "info" if name == "oracle" or busy else "fail" if slower else "pass"
    pre, dec = vs["prefill"], vs["decode"]
    return SummaryRow(baseline=name, verdict=verdict, detail=f"plan/{name}: {detail}" + (f"; {busy}" if busy else ""),
                      ratio_prefill=pre.ratio, ratio_decode=dec.ratio, ci_low=dec.low, ci_high=dec.high,
                      prefill_ci_low=pre.low, prefill_ci_high=pre.high, n_samples=min(pre.n, dec.n),
                      metrics={**metrics, **{f"vs_{k}": v.model_dump() for k, v in vs.items()}})


def bench_oracle(ctx: BenchContext, opts: OracleOptions, progress: Progress | None = None) -> BenchRun:
    """Time the plan's whole space, then race the plan, the defaults and the best of the space.

    Raises:
        BenchError: the plan's space is not stored, or every candidate of it failed.
    """
    space, load0 = stored_space(ctx), load_avg()
    lengths, n_gen = _workload(ctx, space)
    prompts = tokenize_prompts(ctx, lengths, "tune", ctx.plan.request.seed)
    oracle_id, grid, grid_s = _grid(ctx, space, prompts, n_gen, opts, progress)
    oracle = next(c for c in space.candidates if c.id == oracle_id)
    defaults = llama_cpp_python_defaults(ctx.params)
    final = [plan_engine(ctx), EngineSpec(name="defaults", kind="worker", params=defaults,
                                          note="llama-cpp-python defaults: " + " ".join(defaults.cli_args())),
             EngineSpec(name="oracle", kind="worker", params=oracle.params, note=f"{oracle.id}: " + " ".join(
                 oracle.params.cli_args()))]
    table = race(final, ctx, prompts, n_gen, opts.rounds, opts.seed + 1, progress)
    vs = {name: versus(table, name, opts) for name in ("oracle", "defaults")}
    med = {s.name: medians(table, s.name) for s in final}
    plan_s = ctx.plan.stage_seconds.get("total")
    raw = {"model": ctx.plan.model_name, "plan_id": ctx.plan.id, "plan_s": plan_s, "grid_s": grid_s,
           "grid_size": len(space.candidates), "oracle": oracle_id, "plan_candidate": ctx.plan.candidate.id,
           **{f"{e}_{k}": med[e][k] for e in med for k in ("prefill", "decode")},
           **{f"vs_{b}_{k}": vs[b][k].ratio for b in vs for k in FIGURES},
           "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}
    planner = f"planner {plan_s:.0f} s" if plan_s is not None else "planner time not recorded in the plan"
    common = {"options": opts.model_dump(mode="json"), "lengths": lengths, "n_gen": n_gen, "grid": grid,
              "final": med, "engines": {s.name: s.note for s in final}, "load_avg_start": load0,
              "load_avg_end": load_avg(), "summary": f"{planner} vs exhaustive grid {grid_s:.0f} s "
                                                    f"({len(space.candidates)} candidates); plan "
                                                    f"{ctx.plan.candidate.id} vs oracle {oracle_id}"}
    busy = trial_busy(table)
    rows = [_row(name, vs[name], table, busy, common) for name in ("oracle", "defaults")]
    rows[0] = rows[0].model_copy(update={"detail": f"{common['summary']}; {rows[0].detail}"})
    return BenchRun(suite="oracle", ctx=ctx, rows=rows, raw=pa.Table.from_pylist([raw], schema=RAW_SCHEMA))


SUITE = Suite(
    name="oracle", help="race the plan against llama-cpp-python defaults and the best candidate of its whole space",
    description="Times every candidate of the search space the plan was chosen from (the stored space) on the "
                "plan's workload, takes the fastest as the oracle, then races plan, defaults and oracle in paired "
                "rounds; prints workload time, prefill and decode ratios plan/oracle and plan/defaults with the "
                "planner's and the grid's wall times. Plans nothing. Exit 1 when the plan's workload is slower "
                "than the defaults'.",
    options=OracleOptions, run=bench_oracle, flags=("rounds", "grid_rounds", "seed"))
