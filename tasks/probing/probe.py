"""The probe stage: this machine measured once per model and backend build (reused unless ``--reprobe``)."""

from __future__ import annotations

from typing import Any

from artifacts.records.hardware import HardwareReport
from artifacts.records.keys import probe_key
from artifacts.records.kinds import PROBE
from tasks import workload as wl
from tasks.probe import probe
from tasks.stage import PlanContext, Stage


def _key(ctx: PlanContext) -> dict[str, Any]:
    return probe_key(ctx.facts, ctx.model_hash, ctx.backend_build, ctx.code)


def _run(ctx: PlanContext, log: Any) -> HardwareReport:
    return probe(ctx.model, ctx.model_hash, ctx.settings, ctx.backend_build, ctx.facts.rpc)


def _check_budget(ctx: PlanContext, log: Any, hw: HardwareReport) -> None:
    """Right after the probe (computed or reused): a ``--budget-s`` that cannot measure two finalists twice even
    at this machine's fastest is refused now, naming one that works, not after it has been spent."""
    wl.check_feasible(hw, ctx.req.ctx or ctx.info.n_ctx_train or 4096, ctx.req)


STAGE: Stage[HardwareReport] = Stage(
    name="probe", version=1, result=HardwareReport, run=_run, kind=PROBE, key=_key,
    inputs=("machine facts", "model hash", "backend build", "code"), force=lambda ctx: ctx.reprobe,
    report=_check_budget)
