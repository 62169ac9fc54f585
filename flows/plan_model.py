"""The ``plan-model`` Prefect flow: probe → route → enumerate → prune → measure → validate → persist, with the
reference started after the probe and running beside route, enumerate and prune (it needs neither).

This module only composes the stages declared in ``tasks/`` (:mod:`tasks.pipeline`); :func:`flows.stages.run`
runs each as a Prefect task that returns its stored output when the inputs hash to one (the task's state
message says so).
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.states import Completed

from artifacts.config import load_settings
from flows import stages
from flows.request import flow_signature, plan_request
from tasks import pipeline as p


@flow(name="plan-model", log_prints=False, persist_result=False)
@flow_signature
def plan_model(**flags: Any) -> str:
    """Plan a model on this machine and return the plan id (the run's final state says "plan <id>"): one keyword
    per ``flux plan`` flag (the fields of :class:`artifacts.records.plan.PlanRequest`, ``model`` required)."""
    settings = load_settings()
    log = get_run_logger()
    req = plan_request(settings, flags.pop("model"), **flags)
    ctx_ = stages.context(req, settings, reprobe=req.reprobe)
    ctx_.clock.say = log.info
    p.remember_model_path(ctx_)
    if not req.replan:
        existing = p.existing_plan(ctx_)
        if existing:
            log.info("plan %s matches this model, machine, build and flags: reused (--replan measures again)",
                     existing[:12])
            return Completed(message=f"plan {existing}", data=existing)  # type: ignore[return-value]
    hw = stages.run(p.PROBE, ctx_)
    reference = stages.start(p.REFERENCE, ctx_, hw)
    routing = stages.run(p.ROUTE, ctx_, hw)
    space = stages.run(p.ENUMERATE, ctx_, hw, routing)
    finalists = stages.run(p.PRUNE, ctx_, hw, space)
    ref = reference.result()
    measured = stages.run(p.MEASURE, ctx_, hw, finalists, ref)
    report = stages.run(p.VALIDATE, ctx_, hw, finalists, measured, ref)
    plan = stages.run(p.PERSIST, ctx_, hw, space, finalists, measured, report, routing)
    log.info("plan %s", plan.id)  # `prefect deployment run --watch` shows the run's logs, not its result
    # the run's state message carries the id too (the UI, `prefect flow-run inspect`); a caller gets the id
    return Completed(message=f"plan {plan.id}", data=str(plan.id))  # type: ignore[return-value]
