"""The ``plan-model`` Prefect flow: probe → route → enumerate → prune → measure → validate → persist, with the
reference started after the probe and running beside route, enumerate and prune (it needs neither).

This module only composes the stages declared in ``tasks/`` (:mod:`tasks.pipeline`); :func:`flows.stages.run`
runs each as a Prefect task that returns its stored output when the inputs hash to one (the task's state
message says so).
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from artifacts.config import load_settings
from flows import stages
from flows.request import plan_request
from tasks import pipeline as p


@flow(name="plan-model", log_prints=False, persist_result=False)
def plan_model(model: str, ctx: int | None = None, concurrency: int = 1, kv: str = "f16",
               budget_s: float | None = None, gpu_mem_budget_gib: list[float] | None = None,
               allow_storage_streaming: bool = False, replan: bool = False, reprobe: bool = False,
               seed: int = 0, workload: str = "agent", host_mem_budget_gib: float | None = None,
               rpc: list[str] | None = None, rpc_mem_budget_gib: list[float] | None = None,
               engines: list[str] | None = None, prefer_engine: str | None = None, speculation: bool = False,
               draft_model: str | None = None) -> str:
    """Plan a model on this machine and return the plan id."""
    settings = load_settings()
    log = get_run_logger()
    req = plan_request(settings, model, ctx=ctx, concurrency=concurrency, kv=kv, budget_s=budget_s,
                       gpu_mem_budget_gib=gpu_mem_budget_gib, allow_storage_streaming=allow_storage_streaming,
                       workload=workload, seed=seed, host_mem_budget_gib=host_mem_budget_gib, rpc=rpc,
                       rpc_mem_budget_gib=rpc_mem_budget_gib, engines=engines,
                       prefer_engine=prefer_engine, speculation=speculation, draft_model=draft_model)
    ctx_ = stages.context(req, settings, reprobe=reprobe)
    ctx_.clock.say = log.info
    p.remember_model_path(ctx_)
    if not replan:
        existing = p.existing_plan(ctx_)
        if existing:
            log.info("plan %s matches this model, machine, build and flags: reused (--replan measures again)",
                     existing[:12])
            return existing
    hw = stages.run(p.PROBE, ctx_)
    reference = stages.start(p.REFERENCE, ctx_, hw)
    routing = stages.run(p.ROUTE, ctx_, hw)
    space = stages.run(p.ENUMERATE, ctx_, hw, routing)
    finalists = stages.run(p.PRUNE, ctx_, hw, space)
    ref = reference.result()
    measured = stages.run(p.MEASURE, ctx_, hw, finalists, ref)
    report = stages.run(p.VALIDATE, ctx_, hw, finalists, measured, ref)
    plan = stages.run(p.PERSIST, ctx_, hw, space, finalists, measured, report, routing)
    return str(plan.id)
