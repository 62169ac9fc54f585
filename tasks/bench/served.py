"""``flux bench run --via serve``: the plan as ``flux serve`` serves it, raced against llama-server at the
plan's own GPU budget and context.

Contenders, each started once and kept loaded for the whole race (on a GPU the loads dominate otherwise):

* ``plan``: ``flux serve <plan>`` (what a user runs), its worker loaded with the plan's parameters;
* ``fit``: llama-server with its automatic fit (``--fit on``), told to leave all but the budget free
  (``--fit-target`` = free memory minus the budget) and to hold the plan's context (``-c`` and ``-fitc``
  both the plan's, so it cannot shrink the context to make room, which it otherwise does first);
* ``n-cpu-moe``: llama-server ``-ngl 999 --n-cpu-moe N`` with the smallest N whose *measured* GPU memory
  fits the budget (MoE models);
* ``most-ngl``: llama-server with the most ``-ngl`` layers whose measured GPU memory fits.

Every contender is timed by the same client through the same endpoint (``/v1/completions``, streamed,
greedy, a fresh prompt each turn so that no prompt cache helps): prefill is the time to the first token,
decode the generated tokens after it over their time. Each contender first runs one untimed full-size turn
(a cold first turn ran at 45% speed on the H200); rounds shuffle the order. A sweep's reading of a
configuration is compared with its reading in the race: more than :data:`AGREE` apart, the sweep reading is
reported as discarded (cold) and the race's stands.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from artifacts.model_info import ModelInfo, model_info
from artifacts.records.machine import cpu_info
from engine_bridge.gpumem import GpuMemoryMeter
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
    streamed_completion,
    sweep_n_cpu_moe,
)
from tasks.gpu_memory import budget_problem

log = logging.getLogger(__name__)
GIB, MIB = 2**30, 2**20
AGREE = 0.05  # two readings of one configuration in one run must agree within this, or the cold one goes
TRIAL_SCHEMA = pa.schema([
    ("engine", pa.string()), ("round", pa.int32()), ("turn", pa.int32()), ("prompt_tokens", pa.int32()),
    ("prompt_ms", pa.float64()), ("gen_tokens", pa.int32()), ("gen_ms", pa.float64()),
    ("prefill_tps", pa.float64()), ("decode_tps", pa.float64()), ("turn_s", pa.float64()),
    ("gpu_bytes", pa.int64()), ("error", pa.string()),
])


def race_loaded(contenders: list[Contender], prompts: dict[str, list[list[int]]], turns: Sequence[Turn],
                rounds: int, timeout_s: float, seed: int, progress: Progress,
                meter: GpuMemoryMeter | None = None) -> pa.Table:
    """Every contender started once (and measured), warmed with one full turn, then timed in shuffled rounds.

    Contenders start one after another, each read (NVML) once warm before the next starts, so a reading of
    the device's use above the baseline taken right before a start is that contender's alone.
    ``prompts[turn.name]`` holds one distinct prompt per (contender, round) visit plus one for the warm-up.
    """
    meter = meter or GpuMemoryMeter()
    rows: list[dict[str, Any]] = []
    live: list[Contender] = []
    for i, c in enumerate(contenders):
        try:
            meter.rebase()
            c.start()
            for t in turns:  # warm-up: one untimed full-size turn of each kind
                streamed_completion(c.base, prompts[t.name][-1 - i], t.gen, timeout_s)
            c.gpu = meter.read(c.pid)
            live.append(c)
            progress(f"{c.name}: started, GPU {(c.gpu_bytes or 0) / GIB:.2f} GiB"
                     f"{f' ({c.gpu.method})' if c.gpu else ''} ({c.note})")
        except Exception as exc:  # noqa: BLE001 - a contender that fails to start is an error row
            rows.append({"engine": c.name, "round": -1, "turn": -1, "error": f"{type(exc).__name__}: {exc}"[:500]})
            c.stop()
    rng = random.Random(seed)
    visit = 0
    try:
        for rnd in range(rounds):
            order = live[:]
            rng.shuffle(order)
            for c in order:
                for j, t in enumerate(turns):
                    prompt = prompts[t.name][visit % (len(prompts[t.name]) - len(contenders))]
                    rows.append(_timed_row(c, rnd, j, prompt, t, timeout_s))
                visit += 1
            progress(f"round {rnd + 1}/{rounds} done")
    finally:
        for c in contenders:
            c.stop()
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in TRIAL_SCHEMA} for r in rows], schema=TRIAL_SCHEMA)


def _timed_row(c: Contender, rnd: int, j: int, prompt: list[int], t: Turn, timeout_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {"engine": c.name, "round": rnd, "turn": j, "gpu_bytes": c.gpu_bytes}
    try:
        tm = streamed_completion(c.base, prompt, t.gen, timeout_s)
    except Exception as exc:  # noqa: BLE001 - one failed request is a row, the race goes on
        return {**row, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {**row, "prompt_tokens": tm.prompt_tokens, "prompt_ms": tm.prompt_ms, "gen_tokens": tm.gen_tokens,
            "gen_ms": tm.gen_ms, "prefill_tps": tm.prompt_tokens / tm.prompt_ms * 1e3 if tm.prompt_ms else None,
            "decode_tps": tm.gen_tokens / tm.gen_ms * 1e3 if tm.gen_ms else None,
            "turn_s": (tm.prompt_ms + tm.gen_ms) / 1e3}


def medians(table: pa.Table, engine: str, turn: int) -> dict[str, float]:
    """Median prefill and decode speed and turn seconds of one engine on one turn."""
    rows = [r for r in table.to_pylist() if r["engine"] == engine and r["turn"] == turn and not r["error"]]
    out = {}
    for k in ("prefill_tps", "decode_tps", "turn_s"):
        xs = [r[k] for r in rows if r[k]]
        if xs:
            out[k] = statistics.median(xs)
    return out


def agreement(sweep: Probe | None, raced: dict[str, float]) -> tuple[float | None, str | None]:
    """(relative difference, note) of a sweep's decode reading against the race's for one configuration."""
    if sweep is None or sweep.timing is None or not sweep.timing.gen_ms or not raced.get("decode_tps"):
        return None, None
    swept = sweep.timing.gen_tokens / sweep.timing.gen_ms * 1e3
    diff = abs(swept - raced["decode_tps"]) / raced["decode_tps"]
    if diff <= AGREE:
        return diff, None
    return diff, (f"sweep read {swept:.1f} tok/s decode, the race {raced['decode_tps']:.1f} ({diff:.0%} apart, more "
                  f"than {AGREE:.0%}): the sweep's single reading is discarded, the race's stands")


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


def _row(name: str, c: Contender, table: pa.Table, turns: Sequence[Turn], opts: Any,
         extra: dict[str, Any], host_flagged: str | None = None) -> Any:
    """Plan vs one contender: paired ratios per turn (same round), a verdict on the first turn's speeds."""
    from tasks.bench.record import SummaryRow
    from tasks.bench.stats import paired_ratio

    def pair(turn: int, metric: str) -> tuple[list[float], list[float]]:
        by: dict[str, dict[int, float]] = {"plan": {}, name: {}}
        for r in table.to_pylist():
            if r["engine"] in by and r["turn"] == turn and not r["error"] and r[metric]:
                by[r["engine"]][r["round"]] = r[metric]
        keys = sorted(by["plan"].keys() & by[name].keys())
        return [by["plan"][k] for k in keys], [by[name][k] for k in keys]

    if not pair(0, "decode_tps")[0]:
        return SummaryRow(baseline=name, verdict="info", detail=f"no paired turns with {name}", metrics=extra)
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
               "baseline_valid": c.flag is None and extra.get("plan_flag") is None}
    slower = "slower" in (pre.outcome, dec.outcome)
    detail = f"{turns[0].name}: prefill {pre.outcome} {pre.text()}, decode {dec.outcome} {dec.text()}"
    why_not = c.flag and f"{name} {c.flag}" or extra.get("plan_flag") and f"the plan {extra['plan_flag']}"
    if why_not:  # the ratios are kept for diagnosis, never reported as a result
        return SummaryRow(baseline=name, verdict="info", detail=f"not a result: {why_not}; measured {detail}",
                          n_samples=min(pre.n, dec.n), metrics={
                              **metrics, "unreported": {"prefill": pre.model_dump(), "decode": dec.model_dump()}})
    if host_flagged:
        detail += "; host slower than usual: these ratios hold for that state only"
    return ratio_row(name, pre, dec, "fail" if slower else "pass", detail, metrics)


def bench_served(ctx: BenchContext, opts: Any, progress: Progress | None = None) -> Any:
    """The served race (module docstring); one summary row per baseline."""
    from tasks.bench.record import BenchRun, SummaryRow

    say = progress or log.info
    asked = tuple(Turn(name=f"p{p}-g{g}", prompt=p, gen=g) for p, g in opts.turns) if opts.turns else DEFAULT_TURNS
    room = ctx.params.n_ctx - 16  # a turn must fit the plan's context, with its reply
    turns = tuple(t if t.prompt + t.gen <= room else t.model_copy(update={"prompt": max(8, room - t.gen)})
                  for t in asked)
    budget_gib = opts.gpu_mem_budget_gib if opts.gpu_mem_budget_gib is not None else ctx.plan.request.gpu_mem_budget_gib
    budget = int(max(budget_gib) * GIB) if budget_gib else None
    info = model_of(ctx)
    n_prompts = opts.rounds * (len(opts.baselines) + 1) + len(opts.baselines) + 3
    prompts = _prompts(ctx, turns, n_prompts, opts.seed)
    sweep_prompts = prompts[turns[0].name][-2:]
    contenders: list[Contender] = [plan_contender(ctx)]
    probes: dict[str, Probe] = {}
    skipped: dict[str, str] = {}
    meter = GpuMemoryMeter()
    check_budget(ctx, info, budget, meter)
    host_start = read_host()  # before any contender loads the machine
    t0 = time.monotonic()
    threads = BaselineThreads(ctx.params.n_threads)
    for name in opts.baselines:
        if name == "fit":
            contenders.append(fit_contender(ctx, budget, meter, threads))
            continue
        finder = {"n-cpu-moe": sweep_n_cpu_moe, "most-ngl": most_layers}.get(name)
        if finder is None:
            raise BenchError(f"unknown baseline {name!r} for --via serve: choose from fit, n-cpu-moe, most-ngl")
        if name == "n-cpu-moe" and not info.is_moe:
            skipped[name] = "n/a: dense model (no experts)"
            continue
        got = finder(ctx, info, budget, sweep_prompts, turns[0], say, threads.n)
        if isinstance(got, str):
            skipped[name] = got
            continue
        if not probes:  # the first baseline found sets every baseline's threads
            got = pick_threads(ctx, got, threads, cpu_info().physical_cores, budget, sweep_prompts, turns[0], say)
        contenders.append(got[0])
        probes[name] = got[1]
    table = race_loaded(contenders, prompts, turns, opts.rounds, ctx.timeout_s, opts.seed, say, meter)
    host = host_check(ctx, host_start, say)
    plan_c = contenders[0]
    for c in contenders[1:]:
        c.flag = budget_flag(c.gpu, budget)
        if c.flag:
            say(f"{c.name}: {c.flag}: its ratios are not reported as results")
    plan_flag = over_plan_budget(plan_c, budget)
    if plan_flag:
        say(f"plan: {plan_flag}: no ratio of this run is reported as a result")
    agree = memory_agreement(plan_c, ctx)
    if agree is not None and agree > MEMORY_AGREE:
        say(f"plan: flux serve held {(plan_c.gpu_bytes or 0) / GIB:.2f} GiB, the measure stage read "
            f"{(ctx.plan.measured.gpu_bytes or 0) / GIB:.2f} GiB ({agree:.0%} apart, more than {MEMORY_AGREE:.0%})")
    served = medians(table, "plan", 0)
    common: dict[str, Any] = {
        "options": opts.model_dump(mode="json"), "turn_specs": [t.model_dump() for t in turns],
        "budget_gib": max(budget_gib) if budget_gib else None, "ctx": ctx.params.n_ctx, "seconds": time.monotonic() - t0,
        "plan_gpu_bytes": plan_c.gpu_bytes, "plan_gpu_method": plan_c.gpu.method if plan_c.gpu else None,
        "plan_measured_gpu_bytes": ctx.plan.measured.gpu_bytes, "plan_gpu_vs_measured": agree, "plan_flag": plan_flag,
        "plan_measured_decode_tps": ctx.plan.measured.decode_tps,
        "plan_measured_prefill_tps": ctx.plan.measured.prefill_tps, "served_decode_tps": served.get("decode_tps"),
        "plan_backend_build": ctx.plan.backend_build, "timing": "client stream (/v1/completions)",
        "baseline_threads": threads.n, "baseline_threads_note": threads.note, "host": host.model_dump()}
    rows = []
    for c in contenders[1:]:
        diff, note = agreement(probes.get(c.name), medians(table, c.name, 0))
        extra = {**common, "sweep_vs_race": diff, "sweep_note": note}
        if note:
            say(f"{c.name}: {note}")
        rows.append(_row(c.name, c, table, turns, opts, extra, host.flag))
    rows += [SummaryRow(baseline=name, verdict="info", detail=why, metrics=common) for name, why in skipped.items()]
    return BenchRun(suite="run", ctx=ctx, rows=rows, raw=table)
