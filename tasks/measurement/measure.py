"""The measure stage: the finalists timed in fresh workers within what ``--budget-s`` has left; each finalist's
first visit also scores the reference's continuations for validation.

The budget decides the prompts and the finalists raced (:mod:`tasks.workload`): the deepest prompts that
fit, then as many finalists as fit two rounds; those left out are rows saying so. Its key holds the flow run's
id, so a retried run reuses it and a new run measures again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from artifacts.ids import content_id
from artifacts.records.evidence import MeasureResults, MeasureSummary
from artifacts.records.hardware import HardwareReport
from artifacts.records.kinds import MEASURED, TRIALS_RAW_TABLE
from artifacts.records.search import Finalists
from tasks import workload as wl
from tasks.gpu_budget import gpu_limits
from tasks.gpu_memory import predicted_gpu_bytes
from tasks.measurement.concurrency import serving_choice
from tasks.measurement.rounds import Scoring, measure
from tasks.measurement.speculation import drafted
from tasks.stage import NATIVE_OPS, PlanContext, Stage
from tasks.validation.outputs import ReferenceOutputs


def _key(ctx: PlanContext, hw: HardwareReport, fin: Finalists, ref: ReferenceOutputs) -> dict[str, Any]:
    key = {"stage": "measure", "finalists": content_id(fin), "run": ctx.run_id, "budget": ctx.req.budget_s,
           "code": STAGE.code()}
    if ctx.req.domains:  # measured on a domain mix (--domains): other rounds
        key["domains"] = list(wl.measured_domains(ctx.req.domains))
    if ctx.drafting:
        key["drafting"] = [d.model_dump() for d in ctx.drafting]
    if ctx.req.serving_p95_ms is not None:
        key["serving_p95_ms"] = ctx.req.serving_p95_ms
    return key if ctx.req.engines == ["native"] else {**key, "engines": [e.model_dump() for e in ctx.engines]}


def scored_dir(ctx: PlanContext, key: dict[str, Any]) -> Path:
    """Where a measure run keeps its finalists' scores of the reference's continuations."""
    return ctx.settings.cache_dir / "validation" / "scored" / content_id(key)[:16]


def _sized(ctx: PlanContext, log: Any, hw: HardwareReport,
           fin: Finalists) -> tuple[float, tuple[float, float], list[int], int, Finalists]:
    """(budget left, load rates, prompt lengths, tokens generated, finalists kept) for what the budget has left."""
    spent = ctx.clock.in_budget_spent()
    budget = wl.measure_budget(ctx.req.budget_s, spent, ctx.clock.one_time_s(), ctx.clock.outside_s())
    # a first plan ends within B + FIRST_PLAN_SLACK_S of the command's start whatever ran before (a 26 GB model's
    # probe took 109 s): measuring gets what that deadline leaves, its workload scaled to fit (tasks.workload)
    budget = max(0.0, min(budget, wl.first_plan_left(ctx.req.budget_s, ctx.clock.command_s())))
    rates = wl.load_rates(hw, ctx.info.file_bytes)
    lengths, n_gen = wl.measurement_lengths(fin, min(c.params.n_ctx for c in fin.finalists), ctx.req, budget, rates)
    kept = wl.fitting_finalists(fin, lengths, n_gen, budget, rates)
    note = wl.overrun_note(kept, lengths, n_gen, budget, rates)
    if note:
        log.warning("measure: %s", note)
    if len(kept.finalists) < len(fin.finalists):
        log.info("measure: %d of %d finalists fit %d rounds in the %.0f s left of the budget (%s dropped; a larger "
                 "--budget-s measures them)", len(kept.finalists), len(fin.finalists), wl.MIN_ROUNDS, budget,
                 ", ".join(c.id for c in fin.finalists if c not in kept.finalists))
    log.info("measure: %d prompt(s) of %s tokens + %d generated each, %d finalists, up to %d rounds in %.0f s",
             len(lengths), "/".join(map(str, lengths)), n_gen, len(kept.finalists), ctx.req.repeats, budget)
    return budget, rates, lengths, n_gen, kept


def _run(ctx: PlanContext, log: Any, hw: HardwareReport, fin: Finalists, ref: ReferenceOutputs) -> MeasureResults:
    key = _key(ctx, hw, fin, ref)
    fin = drafted(ctx, hw, fin)
    budget, rates, lengths, n_gen, kept = _sized(ctx, log, hw, fin)
    score_tokens = sum(len(p) + len(c) for p, c in ref.seqs())
    prompts = wl.tune_prompts(ctx.model, lengths, ctx.req.seed, ctx.worker_log, wl.measured_domains(ctx.req.domains))
    # a freed visit goes to the best-ranked left out (run 16: in the family order it went to a layer split
    # decoding 100 tok/s, while the mapped split at a smaller micro-batch, predicted 158, was never tried)
    kept_ids = {c.id for c in kept.finalists}
    summaries, table, used, stopped = measure(
        kept.finalists, ctx.model, prompts, n_gen, budget_s=budget, repeats=ctx.req.repeats,
        timeout_s=ctx.settings.plan.measure_timeout_s, log_path=ctx.worker_log, seed=ctx.req.seed,
        progress=log.info, gpu_budgets=gpu_limits(hw, ctx.req) if ctx.req.gpu_mem_budget_gib else None,
        predicted_gpu={c.id: sum(predicted_gpu_bytes(c, hw).values()) for c in fin.finalists},
        scoring=Scoring(ref.seqs(), ref.held_out, scored_dir(ctx, key), ctx.info.n_vocab), engines=ctx.engines,
        predicted_visit_s={c.id: wl.visit_seconds(c, p, lengths, n_gen, rates, score_tokens)
                           for c, p in zip(fin.finalists, fin.predictions, strict=True)},
        reserves=[c for c in fin.finalists if c.id not in kept_ids])
    tid = content_id({"measure": content_id(key), "rows": table.num_rows})
    ctx.store.put_table(TRIALS_RAW_TABLE, table, key=tid)
    dropped = [MeasureSummary(candidate_id=c.id, prefill_tps=None, decode_tps=None, workload_s=None, n_trials=0,
                              error="not measured: the budget left did not fit it") for c in fin.finalists
               if c.id not in {s.candidate_id for s in summaries}]
    serving = None
    if ctx.req.serving_p95_ms is not None:  # after the race: the fastest native finalist's curve (concurrency.py)
        serving = serving_choice(fin.finalists, summaries, ctx.model, prompts, n_gen, most=ctx.req.concurrency,
                                 p95_ms=ctx.req.serving_p95_ms, timeout_s=ctx.settings.plan.measure_timeout_s,
                                 log_path=ctx.worker_log, budget_s=max(0.0, budget - used), seed=ctx.req.seed,
                                 progress=log.info)
    return MeasureResults(summaries=summaries + dropped, trials_table=tid, budget_s=budget, spent_s=used,
                          stopped_by_budget=stopped, lengths=lengths, n_gen=n_gen,
                          scored_dir=str(scored_dir(ctx, key)), serving=serving)


STAGE: Stage[MeasureResults] = Stage(
    name="measure", version=1, result=MeasureResults, run=_run, kind=MEASURED, key=_key,
    inputs=("finalists", "flow run id", "--budget-s", "code"), tables=(TRIALS_RAW_TABLE,), faults=True,
    # timed runs, drafting, and the serving engine that --serving-p95-ms times sequences together on
    sources=(*NATIVE_OPS, "engine_bridge.worker.speculative", "engine_bridge.worker.serving"))
