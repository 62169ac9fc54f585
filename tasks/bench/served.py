"""``flux bench run --via serve``: the plan as ``flux serve`` serves it, raced against llama-server at the
plan's own GPU budget and context.

Contenders:

* ``plan``: ``flux serve <plan>`` (what a user runs), its worker loaded with the plan's parameters;
* ``fit``: llama-server with its automatic fit (``--fit on``), told to leave all but the budget free
  (``--fit-target`` = free memory minus the budget) and to hold the plan's context (``-c`` and ``-fitc``
  both the plan's, so it cannot shrink the context to make room, which it otherwise does first);
* ``n-cpu-moe``: llama-server ``-ngl 999 --n-cpu-moe N`` with the smallest N whose *measured* GPU memory
  fits the budget (MoE models);
* ``most-ngl``: llama-server with the most ``-ngl`` layers whose measured GPU memory fits.

Each contender is timed in the conditions it would have alone (tasks/bench/served_race.py): one contender
resident at a time, visited once a round in an order that alternates over the rounds, started, read (GPU
memory) once warm, warmed with one untimed turn of each kind, timed on two distinct prompts of each kind,
stopped, and its processes seen gone before the next starts. (Kept resident together, the baselines of an
H100 run decoded 41% slower than alone: docs/benchmarks/race.md.) Every contender is timed by the same client
through the same endpoint (``/v1/completions``, streamed, greedy, a prompt not seen before in the visit, so
that no prompt cache helps): prefill is the time to the first token, decode the generated tokens after it
over their time. A visit's reading is the median of its turns; the plan's and a baseline's visits of one
round pair up.

Each baseline's row carries its solo reading (the sweep's probe of that configuration, started alone; for
``fit``, which no sweep times, its first visit against its later ones) beside its race reading (the median
of its visits). More than :data:`AGREE` apart, the row is invalid: no ratio of it is reported, its verdict
is ``fail`` (the verdicts stored are pass, fail and info) with a detail that starts ``invalid:``, so
``flux bench run`` exits 1 and says why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from artifacts.model_info import ModelInfo, model_info
from engine_bridge.gpumem import GpuMemoryMeter
from engine_bridge.machine_facts import cpu_info
from tasks.bench.context import BenchContext, Progress
from tasks.bench.errors import BenchError
from tasks.bench.host_state import HostCheck, HostState, host_flag, read_host, usual_state
from tasks.bench.rows import ratio_row, tokenize_prompts
from tasks.bench.served_contenders import (
    DEFAULT_TURNS,
    BaselineThreads,
    Contender,
    Probe,
    Turn,
    budget_flag,
    fit_contender,
    most_layers,
    pick_threads,
    plan_contender,
    sweep_n_cpu_moe,
)
from tasks.bench.served_race import (
    AGREE,
    TURNS_PER_VISIT,
    medians,
    race_solo,
    solo_check,
    visit_readings,
)
from tasks.gpu_memory import budget_problem

log = logging.getLogger(__name__)
GIB, MIB = 2**30, 2**20
MEMORY_AGREE = 0.05  # flux serve's GPU memory and the measure stage's reading of the same plan agree within this


def over_plan_budget(plan: Contender, budget: int | None) -> str | None:
    """The plan's own flag: over its budget (under it is the plan's choice, and no advantage)."""
    if budget and plan.gpu_bytes and plan.gpu_bytes > budget:
        return f"held {plan.gpu_bytes / GIB:.2f} GiB, over the {budget / GIB:.2f} GiB budget"
    return None


def memory_agreement(plan: Contender, ctx: BenchContext) -> float | None:
    """Relative difference between the served plan's GPU memory and what the measure stage read for it."""
    measured = ctx.plan.measured.gpu_bytes
    if not plan.gpu_bytes or not measured:
        return None
    return abs(plan.gpu_bytes - measured) / measured


def check_budget(ctx: BenchContext, info: ModelInfo, budget: int | None, meter: GpuMemoryMeter) -> None:
    """Refuse, before anything starts, a budget no contender can hold here (tasks.gpu_memory.budget_problem)."""
    free = meter.device_free()
    if not budget or not free:
        return
    p = ctx.params
    problem = budget_problem(info, budget, max(free), p.n_ctx, p.n_seq_max, p.type_k, None)
    if problem:
        raise BenchError(f"{problem[0]}; {problem[1]}")


def model_of(ctx: BenchContext) -> ModelInfo:
    """The plan's model header (cheap)."""
    return model_info(ctx.model)


def _prompts(ctx: BenchContext, turns: Sequence[Turn], n: int, seed: int) -> dict[str, list[list[int]]]:
    """``n`` distinct corpus prompts per turn, in the model's tokens."""

    return {t.name: tokenize_prompts(ctx, [t.prompt] * n, "held_out", seed + k) for k, t in enumerate(turns)}


def host_check(ctx: BenchContext, start: HostState, say: Progress) -> HostCheck:
    """The host read again after the race, against this machine's stored probes (tasks.bench.host_state)."""
    from artifacts.records.store import Records

    usual, n = usual_state(Records(ctx.store), ctx.plan.hardware_fingerprint)
    check = HostCheck(start=start, end=read_host(), usual=usual, probes=n)
    now = check.slowest()
    check.flag = host_flag(now, usual, n)
    pageable = f", pageable host-to-device {now.h2d_pageable_gbs:.1f} GB/s" if now.h2d_pageable_gbs else ""
    usual_text = f" (usual: {usual.ram_read_gbs:.1f} GB/s over {n} probe(s))" if usual else ""
    say(f"host during the race: RAM read {now.ram_read_gbs:.1f} GB/s{pageable}{usual_text}")
    if check.flag:
        say(check.flag)
    return check


def summary_row(c: Contender, table: pa.Table, turns: Sequence[Turn], opts: Any, extra: dict[str, Any],
                probe: Probe | None = None, host_flagged: str | None = None) -> Any:
    """Plan vs one baseline: paired ratios per turn (visits of the same round), a verdict on the first turn's
    speeds, and the baseline's solo reading beside its race reading (:func:`tasks.bench.served_race.solo_check`).

    Not a result (ratios kept under ``metrics["unreported"]``): an invalid row (solo and race readings more
    than :data:`AGREE` apart; verdict ``fail``, detail ``invalid: ...``), or a budget flag (verdict ``info``).
    """
    from tasks.bench.record import SummaryRow
    from tasks.bench.stats import paired_ratio

    name = c.name
    solo = solo_check(name, probe, table)
    extra = {**extra, **solo}

    def pair(turn: int, metric: str) -> tuple[list[float], list[float]]:
        plan, base = visit_readings(table, "plan", turn, metric), visit_readings(table, name, turn, metric)
        keys = sorted(plan.keys() & base.keys())
        return [plan[k] for k in keys], [base[k] for k in keys]

    if not pair(0, "decode_tps")[0]:
        return SummaryRow(baseline=name, verdict="invalid" if solo["invalid"] else "info", metrics=extra,
                          detail=f"invalid: {solo['invalid']}" if solo["invalid"] else f"no paired turns with {name}")
    pre = paired_ratio(*pair(0, "prefill_tps"), n_boot=opts.n_boot, seed=opts.seed)
    dec = paired_ratio(*pair(0, "decode_tps"), n_boot=opts.n_boot, seed=opts.seed + 1)
    per_turn = {}
    for j, t in enumerate(turns):
        plan_s, base_s = pair(j, "turn_s")
        ratio = paired_ratio(base_s, plan_s, n_boot=opts.n_boot, seed=opts.seed + 2 + j) if plan_s else None
        per_turn[t.name] = {"plan": medians(table, "plan", j), name: medians(table, name, j),
                            "turn_speedup": ratio.model_dump() if ratio else None}
    metrics = {**extra, "per_turn": per_turn, "engine_note": c.note, "baseline_gpu_bytes": c.gpu_bytes,
               "baseline_gpu_method": c.gpu.method if c.gpu else None, "baseline_flag": c.flag,
               "baseline_valid": c.flag is None and extra.get("plan_flag") is None and not solo["invalid"]}
    slower = "slower" in (pre.outcome, dec.outcome)
    detail = f"{turns[0].name}: prefill {pre.outcome} {pre.text()}, decode {dec.outcome} {dec.text()}"
    unreported = {**metrics, "unreported": {"prefill": pre.model_dump(), "decode": dec.model_dump()}}
    if solo["invalid"]:  # a disturbed measurement: never a result (per-turn ratios too), and the run must not pass
        unreported["per_turn"] = {k: {**v, "turn_speedup": None} for k, v in per_turn.items()}
        unreported["unreported"]["turn_speedup"] = {k: v["turn_speedup"] for k, v in per_turn.items()}
        return SummaryRow(baseline=name, verdict="invalid", detail=f"invalid: {solo['invalid']}; measured {detail}",
                          n_samples=min(pre.n, dec.n), metrics=unreported)
    why_not = c.flag and f"{name} {c.flag}" or extra.get("plan_flag") and f"the plan {extra['plan_flag']}"
    if why_not:  # the ratios are kept for diagnosis, never reported as a result
        return SummaryRow(baseline=name, verdict="info", detail=f"not a result: {why_not}; measured {detail}",
                          n_samples=min(pre.n, dec.n), metrics=unreported)
    if host_flagged:
        detail += "; host slower than usual: these ratios hold for that state only"
    return ratio_row(name, pre, dec, "fail" if slower else "pass", detail, metrics)


def find_baselines(ctx: BenchContext, opts: Any, info: ModelInfo, budget: int | None, meter: GpuMemoryMeter,
               sweep_prompts: list[list[int]], turn: Turn, threads: BaselineThreads,
               say: Progress) -> tuple[list[Contender], dict[str, Probe], dict[str, str]]:
    """The baselines asked for, each found alone (the sweeps): contenders, their sweep probes, and why the
    others are skipped."""
    found: list[Contender] = []
    probes: dict[str, Probe] = {}
    skipped: dict[str, str] = {}
    for name in opts.baselines:
        if name == "fit":
            found.append(fit_contender(ctx, budget, meter, threads))
            continue
        finder = {"n-cpu-moe": sweep_n_cpu_moe, "most-ngl": most_layers}.get(name)
        if finder is None:
            raise BenchError(f"unknown baseline {name!r} for --via serve: choose from fit, n-cpu-moe, most-ngl")
        if name == "n-cpu-moe" and not info.is_moe:
            skipped[name] = "n/a: dense model (no experts)"
            continue
        got = finder(ctx, info, budget, sweep_prompts, turn, say, threads.n)
        if isinstance(got, str):
            skipped[name] = got
            continue
        if not probes:  # the first baseline found sets every baseline's threads
            got = pick_threads(ctx, got, threads, cpu_info().physical_cores, budget, sweep_prompts, turn, say)
        found.append(got[0])
        probes[name] = got[1]
    return found, probes, skipped


def plan_agreement(ctx: BenchContext, served: float | None) -> float | None:
    """Relative difference between the plan's served decode and the measure stage's (a note, never a verdict:
    the measure stage reads the worker's own counters on its own prompts, the race a client's stream)."""
    measured = ctx.plan.measured.decode_tps
    return abs(served - measured) / measured if served and measured else None


def race_turns(ctx: BenchContext, opts: Any) -> tuple[Turn, ...]:
    """The turns asked for (or the defaults), each cut to fit the plan's context with its reply."""
    asked = tuple(Turn(name=f"p{p}-g{g}", prompt=p, gen=g) for p, g in opts.turns) if opts.turns else DEFAULT_TURNS
    room = ctx.params.n_ctx - 16
    return tuple(t if t.prompt + t.gen <= room else t.model_copy(update={"prompt": max(8, room - t.gen)})
                 for t in asked)


def _plan_notes(ctx: BenchContext, plan_c: Contender, table: pa.Table, budget: int | None,
                say: Progress) -> dict[str, Any]:
    """The plan's own readings beside its plan: GPU memory (over budget flags the run) and served decode."""
    plan_flag = over_plan_budget(plan_c, budget)
    if plan_flag:
        say(f"plan: {plan_flag}: no ratio of this run is reported as a result")
    agree = memory_agreement(plan_c, ctx)
    if agree is not None and agree > MEMORY_AGREE:
        say(f"plan: flux serve held {(plan_c.gpu_bytes or 0) / GIB:.2f} GiB, the measure stage read "
            f"{(ctx.plan.measured.gpu_bytes or 0) / GIB:.2f} GiB ({agree:.0%} apart, more than {MEMORY_AGREE:.0%})")
    served = medians(table, "plan", 0).get("decode_tps")
    served_vs = plan_agreement(ctx, served)
    if served_vs is not None and served_vs > AGREE:
        say(f"plan: served decode {served or 0:.1f} tok/s, the measure stage read {ctx.plan.measured.decode_tps:.1f} "
            f"({served_vs:.0%} apart; a note only: the measure stage reads the worker's own counters)")
    return {"plan_gpu_bytes": plan_c.gpu_bytes, "plan_gpu_method": plan_c.gpu.method if plan_c.gpu else None,
            "plan_measured_gpu_bytes": ctx.plan.measured.gpu_bytes, "plan_gpu_vs_measured": agree,
            "plan_flag": plan_flag, "plan_measured_decode_tps": ctx.plan.measured.decode_tps,
            "plan_measured_prefill_tps": ctx.plan.measured.prefill_tps, "served_decode_tps": served,
            "plan_served_vs_measured": served_vs}


def budget_of(ctx: BenchContext, opts: Any) -> tuple[list[float] | None, int | None]:
    """(GiB per GPU asked for, else the plan's; the largest in bytes): the budget every baseline is held to."""
    budget_gib = opts.gpu_mem_budget_gib if opts.gpu_mem_budget_gib is not None else ctx.plan.request.gpu_mem_budget_gib
    return budget_gib, int(max(budget_gib) * GIB) if budget_gib else None


def bench_served(ctx: BenchContext, opts: Any, progress: Progress | None = None) -> Any:
    """The served race (module docstring); one summary row per baseline."""
    from tasks.bench.record import BenchRun, SummaryRow

    say = progress or log.info
    turns = race_turns(ctx, opts)
    budget_gib, budget = budget_of(ctx, opts)
    info = model_of(ctx)
    # one warm-up prompt, TURNS_PER_VISIT per round (every contender of a round gets the same), two for the sweeps
    prompts = _prompts(ctx, turns, 1 + opts.rounds * TURNS_PER_VISIT + 2, opts.seed)
    sweep_prompts = prompts[turns[0].name][-2:]
    meter = GpuMemoryMeter()
    check_budget(ctx, info, budget, meter)
    host_start = read_host()  # before any contender loads the machine
    t0 = time.monotonic()
    threads = BaselineThreads(ctx.params.n_threads)
    found, probes, skipped = find_baselines(ctx, opts, info, budget, meter, sweep_prompts, turns[0], threads, say)
    contenders = [plan_contender(ctx), *found]
    race_prompts = {k: v[:-2] for k, v in prompts.items()}
    table = race_solo(contenders, race_prompts, turns, opts.rounds, ctx.timeout_s, opts.seed, say, meter)
    host = host_check(ctx, host_start, say)
    plan_c = contenders[0]
    for c in found:
        c.flag = budget_flag(c.gpu, budget)
        if c.flag:
            say(f"{c.name}: {c.flag}: its ratios are not reported as results")
    notes = _plan_notes(ctx, plan_c, table, budget, say)
    common: dict[str, Any] = {
        "options": opts.model_dump(mode="json"), "turn_specs": [t.model_dump() for t in turns],
        "budget_gib": max(budget_gib) if budget_gib else None, "ctx": ctx.params.n_ctx, "seconds": time.monotonic() - t0,
        **notes, "plan_backend_build": ctx.plan.backend_build, "timing": "client stream (/v1/completions)",
        "race": f"solo visits: one contender resident at a time, {TURNS_PER_VISIT} timed turns of each kind a visit",
        "baseline_threads": threads.n, "baseline_threads_note": threads.note, "host": host.model_dump()}
    rows = [summary_row(c, table, turns, opts, common, probes.get(c.name), host.flag) for c in found]
    for r in rows:
        if r.metrics.get("invalid"):
            say(f"{r.baseline}: INVALID: {r.metrics['invalid']}")
    rows += [SummaryRow(baseline=name, verdict="info", detail=why, metrics=common) for name, why in skipped.items()]
    return BenchRun(suite="run", ctx=ctx, rows=rows, raw=table)
