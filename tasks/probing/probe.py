"""The probe stage: this machine measured once per model and backend build (reused unless ``--reprobe``)."""

from __future__ import annotations

from typing import Any

from artifacts.records.hardware import HardwareReport
from artifacts.records.keys import probe_key
from artifacts.records.kinds import PROBE
from tasks.probe import probe
from tasks.stage import PlanContext, Stage


def _key(ctx: PlanContext) -> dict[str, Any]:
    return probe_key(ctx.facts, ctx.model_hash, ctx.backend_build, ctx.code)


def _run(ctx: PlanContext, log: Any) -> HardwareReport:
    return probe(ctx.model, ctx.model_hash, ctx.settings, ctx.backend_build, ctx.facts.rpc)


STAGE: Stage[HardwareReport] = Stage(
    name="probe", version=1, result=HardwareReport, run=_run, kind=PROBE, key=_key,
    inputs=("machine facts", "model hash", "backend build", "code"), force=lambda ctx: ctx.reprobe)
