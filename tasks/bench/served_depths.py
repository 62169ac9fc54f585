"""``flux bench run PLAN --via serve --depths D1,D2,...``: prefill and decode by depth, each contender alone.

A depth D is D tokens of context already in the cache: each contender prefills a D-token prompt, then decodes
``--depth-gen`` tokens after it (64 unless given). A depth is a turn of the served race
(:mod:`tasks.bench.served_race`): the same contenders (the plan's ``flux serve``, the baselines found alone by
the same sweeps, :mod:`tasks.bench.served`), one resident at a time, visited in an order that alternates over
the rounds. A visit warms up with one untimed turn of the shallowest depth it holds (a warm-up at every depth
would cost as much as the timing), then times one prompt per depth: the prefill of a deep prompt is what a visit
costs, and rounds, not turns per visit, spread the readings. Every prompt opens differently
(:func:`tasks.bench.rows.distinct_prompts`) and asks for no prompt cache, so every prefill is real.

A depth the plan's context does not hold (D + the generated tokens past it) is skipped, with one line and one
``info`` row saying so. A depth a baseline's own context does not hold (``--fit`` may shrink its context) is
"not held" for it: a row saying so, never a failure.

One ``bench_summary`` row per (contender, depth), named ``CONTENDER@D``: prefill and decode tokens per second
(the client's stream; the server's own timings beside them where it sends them), that it was timed alone, and
for the plan the bytes bound of its decode at D (:func:`tasks.costmodel.roofline_decode`: each device's bytes
read per token under the plan's placement, split and KV window at depth D over the probe's bandwidths) with the
cost model's prediction. A baseline's row carries the plan/baseline ratios at that depth, paired by round. A row
is a reading, not a verdict (``info``); one whose visits disagree (its first visit against the median of its
later ones, :func:`tasks.bench.served_race.solo_check`) by more than :data:`tasks.bench.served_race.AGREE` is
``invalid``, as the race flags a baseline, and ``flux bench run`` exits 1; the plan failing at a depth it holds
is ``fail``.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from artifacts.errors import FluxError
from artifacts.records.hardware import HardwareReport
from artifacts.records.kinds import PROBE
from artifacts.records.store import Records
from engine_bridge.gpumem import GpuMemoryMeter
from tasks.bench.context import BenchContext, Progress
from tasks.bench.host_state import read_host
from tasks.bench.record import BenchRun, SummaryRow
from tasks.bench.rows import distinct_prompts, ratio_row, tokenize_prompts
from tasks.bench.served import (
    budget_of,
    check_budget,
    find_baselines,
    host_check,
    model_of,
    over_plan_budget,
    race_turns,
)
from tasks.bench.served_contenders import BaselineThreads, Contender, Turn, budget_flag, plan_contender
from tasks.bench.served_race import TRIAL_SCHEMA, race_solo, solo_check, visit_readings
from tasks.bench.stats import paired_ratio
from tasks.costmodel import Workload, predict, roofline_decode

log = logging.getLogger(__name__)
DEPTH_TURNS_PER_VISIT = 1  # a deep prompt's prefill is the visit's cost: more rounds, not more turns a visit
# The slowest prefill a depth turn waits for before its first token (the request's read timeout is the deepest
# depth over this rate, at least the bench's own): a 262,144-token prompt on a baseline whose KV and attention
# fit moved to the host may take many minutes, and a reading that takes long is still a reading.
DEPTH_MIN_PREFILL_TPS = 200.0
RACE = "solo visits: one contender resident at a time, one timed turn per depth a visit"


def depth_turns(depths: Sequence[int], n_ctx: int, gen: int) -> tuple[tuple[Turn, ...], list[int]]:
    """(a turn per depth the plan's context holds, shallowest first; the depths it does not hold)."""
    held = tuple(Turn(name=f"d{d}", prompt=d, gen=gen) for d in sorted(set(depths)) if d + gen <= n_ctx)
    return held, sorted({d for d in depths if d + gen > n_ctx})


def plan_probe(ctx: BenchContext) -> HardwareReport | None:
    """The newest stored probe of the plan's machine and model: the bandwidths its bound is priced at."""
    records = Records(ctx.store)
    for row in reversed(records.rows(PROBE)):
        try:
            hw = records.get(PROBE, str(row["id"]))
        except FluxError:
            continue
        if hw.fingerprint == ctx.plan.hardware_fingerprint and hw.model_hash == ctx.plan.model_hash:
            return hw
    return None


def plan_bounds(ctx: BenchContext, turns: Sequence[Turn]) -> dict[int, dict[str, float | None]]:
    """Per depth: the bytes bound of the plan's decode (:func:`tasks.costmodel.roofline_decode`) and the cost
    model's predicted decode there; empty when no probe of this machine and model is stored."""
    hw = plan_probe(ctx)
    if hw is None:
        return {}
    info, cand = model_of(ctx), ctx.plan.candidate
    return {t.prompt: {"bound_decode_tps": roofline_decode(info, hw, cand, t.prompt), "predicted_decode_tps": predict(
        info, hw, cand, Workload(prefill_tokens=t.prompt, decode_tokens=t.gen, mean_prompt_tokens=t.prompt)).decode_tps}
            for t in turns}


def reading(table: pa.Table, name: str, turn: int) -> dict[str, Any]:
    """One contender's reading at one depth: the median over its visits of each visit's figures (the client's and
    the server's), why it did not run there (not held, an error), and its visits against each other."""
    rows = [r for r in table.to_pylist() if r["engine"] == name and r["turn"] in (turn, -1)]
    out: dict[str, Any] = {
        "not_held": next((r["not_held"] for r in rows if r["not_held"]), None),
        "error": next((r["error"] for r in rows if r["error"]), None),
        "n_ctx": next((r["n_ctx"] for r in rows if r["n_ctx"]), None)}
    for k in ("prefill_tps", "decode_tps", "server_prefill_tps", "server_decode_tps", "turn_s"):
        xs = list(visit_readings(table, name, turn, k).values())
        out[k] = statistics.median(xs) if xs else None
    check = solo_check(name, None, table, turn)
    out.update(visits_decode_tps=check["race_visits_decode_tps"], solo_source=check["solo_source"],
               solo_vs_race=check["solo_vs_race"], invalid=check["invalid"])
    return out


def _figures(m: dict[str, Any]) -> str:
    """A reading in words: prefill and decode, the server's own where it sent them."""
    text = f"prefill {m['prefill_tps'] or 0:.1f} tok/s, decode {m['decode_tps'] or 0:.1f} tok/s"
    if m.get("server_decode_tps"):
        text += (f" (the server's own timings: prefill {m['server_prefill_tps'] or 0:.1f}, decode "
                 f"{m['server_decode_tps']:.1f})")
    return text


def plan_row(t: Turn, m: dict[str, Any]) -> SummaryRow:
    """The plan's row at one depth: its reading beside the bytes bound of its decode there."""
    name = f"plan@{t.prompt}"
    if m["error"]:
        return SummaryRow(baseline=name, verdict="fail", detail=f"the plan failed at depth {t.prompt}: {m['error']}",
                          metrics=m)
    if m["not_held"]:  # flux serve's context is the plan's: only a served context smaller than the plan's
        return SummaryRow(baseline=name, verdict="fail", detail=f"the plan's server: {m['not_held']}", metrics=m)
    bound = m.get("bound_decode_tps")
    m = {**m, "of_bound": m["decode_tps"] / bound if bound and m["decode_tps"] else None}
    detail = _figures(m) + (f"; bytes bound {bound:.1f} tok/s ({m['of_bound'] or 0:.0%} of it)" if bound else
                            "; no bound (no probe of this machine and model is stored)")
    if m["invalid"]:
        return SummaryRow(baseline=name, verdict="invalid", detail=f"invalid: {m['invalid']}; measured {detail}",
                          metrics=m)
    return SummaryRow(baseline=name, verdict="info", detail=detail, metrics=m)


def baseline_row(c: Contender, t: Turn, j: int, m: dict[str, Any], table: pa.Table, opts: Any,
                 plan_flag: str | None) -> SummaryRow:
    """A baseline's row at one depth: its reading and the plan/baseline ratios there (paired by round)."""
    name = f"{c.name}@{t.prompt}"
    m = {**m, "engine_note": c.note, "baseline_gpu_bytes": c.gpu_bytes, "baseline_flag": c.flag}
    if m["not_held"]:
        return SummaryRow(baseline=name, verdict="info", detail=m["not_held"], metrics=m)
    if m["error"]:
        return SummaryRow(baseline=name, verdict="info", detail=f"baseline failed: {m['error']}", metrics=m)

    def pair(metric: str) -> tuple[list[float], list[float]]:
        plan, base = visit_readings(table, "plan", j, metric), visit_readings(table, c.name, j, metric)
        keys = sorted(plan.keys() & base.keys())
        return [plan[k] for k in keys], [base[k] for k in keys]

    pre = paired_ratio(*pair("prefill_tps"), n_boot=opts.n_boot, seed=opts.seed)
    dec = paired_ratio(*pair("decode_tps"), n_boot=opts.n_boot, seed=opts.seed + 1)
    ratios = f"plan/{c.name}: prefill {pre.text()}, decode {dec.text()}"
    why_not = m["invalid"] and f"invalid: {m['invalid']}" or c.flag and f"not a result: {c.name} {c.flag}" or (
        plan_flag and f"not a result: the plan {plan_flag}")
    if why_not:  # the ratios are kept for diagnosis, never reported as a result
        unreported = {**m, "unreported": {"prefill": pre.model_dump(), "decode": dec.model_dump()}}
        return SummaryRow(baseline=name, verdict="invalid" if m["invalid"] else "info",
                          detail=f"{why_not}; measured {_figures(m)}, {ratios}", n_samples=min(pre.n, dec.n),
                          metrics=unreported)
    return ratio_row(name, pre, dec, "info", f"{_figures(m)}; {ratios}", m)


def depth_summary(contenders: Sequence[Contender], table: pa.Table, turns: Sequence[Turn],
                  bounds: dict[int, dict[str, float | None]], opts: Any, common: dict[str, Any]) -> list[SummaryRow]:
    """One row per (contender, depth), depths in order, the plan first."""
    plan_flag = common.get("plan_flag")
    rows = []
    for j, t in enumerate(turns):
        head = {**common, "depth": t.prompt, "gen_tokens": t.gen, "solo": True, "race": RACE}
        plan_m = {**head, "contender": "plan", **reading(table, "plan", j), **bounds.get(t.prompt, {})}
        rows.append(plan_row(t, plan_m))
        for c in contenders[1:]:
            m = {**head, "contender": c.name, **reading(table, c.name, j), "plan_decode_tps": plan_m["decode_tps"],
                 "plan_bound_decode_tps": plan_m.get("bound_decode_tps")}
            rows.append(baseline_row(c, t, j, m, table, opts, plan_flag))
    return rows


def depth_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A table per depth, as lines, from a run's summary rows (as :class:`SummaryRow` dumps them, or as
    ``bench_summary`` stores them, metrics as JSON): each contender's prefill and decode, the plan/contender
    ratios, the plan's bytes bound. No lines for a run without depths."""
    got = [(r, r["metrics"] if isinstance(r["metrics"], dict) else json.loads(r["metrics"] or "{}")) for r in rows]
    got = [(r, m) for r, m in got if m.get("depth") is not None]
    out: list[str] = []
    for depth in dict.fromkeys(m["depth"] for _, m in got):
        mine = [(r, m) for r, m in got if m["depth"] == depth]
        bound = next((m.get("bound_decode_tps") for _, m in mine if m.get("contender") == "plan"), None)
        out.append(f"depth {depth:,}" + (f": the plan's decode bound {bound:.1f} tok/s" if bound else ""))
        for r, m in mine:
            if m.get("skipped") or m.get("not_held") or m.get("error"):
                out.append(f"  {m.get('contender', 'plan'):<12} {r['detail']}")
                continue
            flag = f"  {r['verdict']}" if r["verdict"] != "info" else ""
            out.append(f"  {m.get('contender', ''):<12} prefill {_num(m.get('prefill_tps')):>9} tok/s, decode "
                       f"{_num(m.get('decode_tps')):>8} tok/s" + (
                           f", plan/this {_num(r.get('ratio_prefill'), 'x')} and {_num(r.get('ratio_decode'), 'x')}"
                           if m.get("contender") != "plan" else
                           f", {m['of_bound']:.0%} of the bound" if m.get("of_bound") else "") + flag)
    return out


def _num(x: float | None, unit: str = "") -> str:
    return "—" if x is None else f"{x:.2f}{unit}" if unit else f"{x:.1f}"


def skipped_rows(skipped: Sequence[int], n_ctx: int, gen: int, common: dict[str, Any]) -> list[SummaryRow]:
    """An ``info`` row per depth the plan's context does not hold."""
    return [SummaryRow(baseline=f"plan@{d}", verdict="info", metrics={**common, "depth": d, "skipped": True},
                       detail=f"depth {d:,} skipped: the plan holds {n_ctx:,} tokens per sequence, {d:,} + {gen} "
                              "generated do not fit") for d in skipped]


def bench_depths(ctx: BenchContext, opts: Any, progress: Progress | None = None) -> BenchRun:
    """The depth race (module docstring): one summary row per (contender, depth)."""
    say = progress or log.info
    n_ctx, gen = ctx.params.n_ctx, opts.depth_gen
    turns, skipped = depth_turns(opts.depths, n_ctx, gen)
    for d in skipped:
        say(f"depth {d:,}: skipped: the plan holds {n_ctx:,} tokens per sequence, {d:,} + {gen} generated do not fit")
    t0 = time.monotonic()
    common: dict[str, Any] = {"options": opts.model_dump(mode="json"), "ctx": n_ctx, "skipped_depths": skipped,
                              "plan_backend_build": ctx.plan.backend_build, "timing": "client stream (/v1/completions)"}
    rows: list[SummaryRow] = []
    table = TRIAL_SCHEMA.empty_table()
    if turns:
        contenders, table, not_found, facts = _race(ctx, opts, turns, say)
        common.update(facts, seconds=time.monotonic() - t0)
        rows = depth_summary(contenders, table, turns, plan_bounds(ctx, turns), opts, common)
        rows += [SummaryRow(baseline=name, verdict="info", detail=why, metrics=common) for name, why in not_found.items()]
    rows += skipped_rows(skipped, n_ctx, gen, common)
    depth_col = pa.array([turns[t].prompt if 0 <= t < len(turns) else None for t in table.column("turn").to_pylist()],
                         pa.int64())
    return BenchRun(suite="run", ctx=ctx, rows=rows, raw=table.append_column("depth", depth_col))


def _race(ctx: BenchContext, opts: Any, turns: Sequence[Turn],
          say: Progress) -> tuple[list[Contender], pa.Table, dict[str, str], dict[str, Any]]:
    """Find the baselines as the race does (their sweeps on the race's first turn), then race every depth:
    (contenders, the race's rows, the baselines not raced and why, the run's facts)."""
    budget_gib, budget = budget_of(ctx, opts)
    info = model_of(ctx)
    sweep = race_turns(ctx, opts.model_copy(update={"turns": ()}))[0]
    sweep_prompts = tokenize_prompts(ctx, [sweep.prompt] * 2, "held_out", opts.seed)
    per = 1 + opts.rounds * DEPTH_TURNS_PER_VISIT  # a warm-up prompt, then one a round
    flat = distinct_prompts(ctx, [t.prompt for t in turns for _ in range(per)], "held_out", opts.seed)
    prompts = {t.name: flat[k * per:(k + 1) * per] for k, t in enumerate(turns)}
    meter = GpuMemoryMeter()
    check_budget(ctx, info, budget, meter)
    host_start = read_host()
    threads = BaselineThreads(ctx.params.n_threads)
    found, _, not_found = find_baselines(ctx, opts, info, budget, meter, sweep_prompts, sweep, threads, say)
    contenders = [plan_contender(ctx), *found]
    timeout_s = max(ctx.timeout_s, max(t.prompt for t in turns) / DEPTH_MIN_PREFILL_TPS)
    table = race_solo(contenders, prompts, turns, opts.rounds, timeout_s, opts.seed, say, meter,
                      turns_per_visit=DEPTH_TURNS_PER_VISIT, warmup="first")
    host = host_check(ctx, host_start, say)
    for c in found:
        c.flag = budget_flag(c.gpu, budget)
    plan_c = contenders[0]
    facts = {"budget_gib": max(budget_gib) if budget_gib else None, "plan_flag": over_plan_budget(plan_c, budget),
             "plan_gpu_bytes": plan_c.gpu_bytes, "plan_engine": plan_c.note, "baseline_threads": threads.n,
             "baseline_threads_note": threads.note, "host": host.model_dump()}
    return contenders, table, not_found, facts
