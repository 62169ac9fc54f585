"""The validate stage: the fastest measured finalists against the reference placement, within the noise floor
of correct kernels; the winner is the fastest that matches. Its key holds the flow run's id (as measure's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from artifacts.ids import content_id
from artifacts.records.evidence import MeasureResults, ValidationReport
from artifacts.records.hardware import HardwareReport
from artifacts.records.kinds import TRIALS_RAW_TABLE, VALIDATION
from artifacts.records.search import Finalists
from tasks.engines import prefer
from tasks.errors import NoMeasurement
from tasks.measurement.speculation import drafted, drafting_that_won
from tasks.stage import NATIVE_OPS, PlanContext, Stage
from tasks.validation.gate import rank_measured, validate
from tasks.validation.outputs import ReferenceOutputs, floor_variants
from tasks.validation.reference import gate


def _key(ctx: PlanContext, hw: HardwareReport, fin: Finalists, measured: MeasureResults,
         ref: ReferenceOutputs) -> dict[str, Any]:
    return {"stage": "validate", "measured": content_id(measured), "run": ctx.run_id, "code": STAGE.code()}


def _run(ctx: PlanContext, log: Any, hw: HardwareReport, fin: Finalists, measured: MeasureResults,
         ref: ReferenceOutputs) -> ValidationReport:
    fin = drafted(ctx, hw, fin)
    rows = ctx.store.get_table(TRIALS_RAW_TABLE, measured.trials_table).to_pylist() if ctx.drafting else None
    ok = prefer(rank_measured(drafting_that_won(measured.summaries, rows), fin.finalists), fin, ctx.req.prefer_engine)
    if not ok:
        raise NoMeasurement("; ".join(f"{s.candidate_id}: {s.error}" for s in measured.summaries))
    by_id = {c.id: c for c in fin.finalists}
    ranked = [by_id[s.candidate_id] for s in ok]
    log.info("validate: measured order %s", ", ".join(
        f"{s.candidate_id} {s.workload_s:.2f} s" + (f" (ctx {by_id[s.candidate_id].params.n_ctx})" if len(
            {c.params.n_ctx for c in ranked}) > 1 else "") for s in ok))
    # the reference's own length: a small budget scores fewer tokens (tasks.validation.reference.shape)
    n_tokens = max((len(c) for c in ref.continuations), default=ctx.settings.plan.validate_tokens)
    return validate(ranked, ctx.model, ref.prompts, ref.held_out, n_tokens=n_tokens,
                    gate=gate(ctx.settings), quality_profile=ctx.req.quality_profile, log_path=ctx.worker_log,
                    timeout_s=ctx.settings.plan.measure_timeout_s, reference=ref.reference,
                    floor_variants=floor_variants(ctx.info, hw, ref.reference), cache=ref.cache, progress=log.info,
                    scored_dir=Path(measured.scored_dir) if measured.scored_dir else None)


def _report(ctx: PlanContext, log: Any, report: ValidationReport, *inputs: Any) -> None:
    log.info("validate: chose %s, the fastest measured finalist that matches the reference (limits: mean KL %s, "
             "top-1 %s)", report.winner_id, f"{report.kl_limit:.2e}" if report.kl_limit is not None else "?",
             f"{report.top1_limit:.3f}" if report.top1_limit is not None else "?")


STAGE: Stage[ValidationReport] = Stage(
    name="validate", version=1, result=ValidationReport, run=_run, kind=VALIDATION, key=_key,
    inputs=("measure results", "flow run id", "code"), report=_report, faults=True,
    sources=(*NATIVE_OPS, "engine_bridge.worker.speculative"))
