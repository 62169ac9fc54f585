"""Runs any declared stage (:class:`tasks.stage.Stage`) as a Prefect task, with Flux's own content-addressed caching.

A stage with a record kind and a key returns the stored result when the store has one under its key (state
message "reused from the store"), else runs and stores it. Prefect's own result caching is off (its default key
includes the run id and its files are pickles); a retried flow run recomputes the same keys and so reuses every
stage that finished — measure and validate included, since their keys include the flow run id. Nothing here
decides anything about planning: that is the stages' (``tasks/``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prefect import Task, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.futures import PrefectFuture
from prefect.states import Completed
from pydantic import BaseModel

from artifacts.config import Settings
from artifacts.ids import content_id
from artifacts.records.kinds import Kind
from artifacts.records.plan import Plan, PlanRequest
from artifacts.records.store import Records
from flows.plan_context import check_loader, plan_context, preflight_engines, read_model
from tasks.pipeline import STAGES, PlanContext, Stage
from tasks.stage import Artifact

M = TypeVar("M", bound=BaseModel)


def context(req: PlanRequest, settings: Settings, reprobe: bool = False) -> PlanContext:
    """Read the model (header, llama.cpp's loader's check, cached hash) and the backend build once per flow run;
    every engine other than the worker is started once (:func:`flows.plan_context.preflight_engines`)."""
    info = read_model(req, settings)
    check_loader(info, settings)
    if req.routing_from is not None:  # a deployment run names a plan or a file, as `flux plan` does: its trace's id
        from flows.routing_from import resolve_routing_from

        req = resolve_routing_from(req, settings, info)
    return plan_context(req, settings, info, reprobe=reprobe, run_id=_flow_run_id(), check_engines=lambda engines:
                        preflight_engines(engines, Path(req.model), info.n_ctx_train, settings))


def _flow_run_id() -> str:
    try:
        ctx = get_run_context()
        run = getattr(ctx, "flow_run", None) or getattr(getattr(ctx, "task_run", None), "flow_run_id", None)
        return str(getattr(run, "id", run))
    except Exception:  # noqa: BLE001 - outside a run (the CLI's look-up, tests): no run id
        return "no-run"


class InjectedFault(RuntimeError):
    """A failure asked for by FLUX_FAULT_INJECT (tests and the soak suite exercise retries with it)."""


def inject_fault(spec: str | None, kind: str) -> None:
    """``fail-once:<kind>:<marker>`` fails the first computation of ``kind`` (the marker file records it)."""
    if not spec or not spec.startswith("fail-once:"):
        return
    _, what, marker = spec.split(":", 2)
    if what == kind and not Path(marker).exists():
        Path(marker).write_text("failed once\n")
        raise InjectedFault(f"injected failure in stage {kind} (FLUX_FAULT_INJECT); retry the run")


def cached(records: Records, kind: Kind[M], key: dict[str, Any], compute: Callable[[], M], log: Any,
           force: bool = False, fault: str | None = None) -> Any:
    """Return a Completed state holding the stored ``kind`` output for ``key``, computing it if needed."""
    kid = content_id(key)
    if not force and records.has(kind, kid):
        obj = records.get(kind, kid)
        msg = f"{kind.name} {kid[:12]} reused from the store"
        log.info(msg)
        return Completed(message=msg, data=obj)
    inject_fault(fault, kind.name)
    obj = compute()
    records.put(kind, obj, key=kid)
    return Completed(message=f"{kind.name} {kid[:12]} computed and stored", data=obj)


def compute(stage: Stage[Any], ctx: PlanContext, log: Any, *inputs: Any) -> tuple[Any, str | None, bool]:
    """(the stage's result, the store's message about it, whether it was computed rather than reused)."""
    if stage.kind is None or stage.key is None:
        out = stage.run(ctx, log, *inputs)
        return out, None, stage.computed(out) if stage.computed is not None else True
    try:
        state = cached(ctx.records, stage.kind, stage.key_of(ctx, *inputs), lambda: stage.run(ctx, log, *inputs),
                       log, force=stage.force(ctx) if stage.force is not None else False,
                       fault=ctx.settings.fault_inject if stage.faults else None)
    except stage.recovers as e:
        log.warning("%s: %s", stage.name, stage.recovery.format(error=e))
        return None, None, False
    return state.data, state.message, "reused" not in str(state.message or "")


def _publish(art: Artifact) -> None:
    if art.table is not None:
        create_table_artifact(key=art.key, table=art.table, description=art.description)
    if art.markdown is not None:
        create_markdown_artifact(key=art.key, markdown=art.markdown, description=art.description)


def _plan_page(plan: Plan) -> Artifact:
    from flows.show import plan_markdown

    return Artifact(key="plan", description="The chosen plan", markdown=plan_markdown(plan))


PAGES: dict[str, Callable[[Any], Artifact]] = {"persist": _plan_page}  # what the UI shows beyond a stage's own


def run_stage(stage: Stage[Any], ctx: PlanContext, *inputs: Any) -> Any:
    """Run one declared stage on the flow's clock (skipped when its ``when`` says so), report and show its
    result; returns the result, in a Completed state saying whether the store had it (Prefect unwraps it)."""
    log = get_run_logger()
    if stage.when is not None and not stage.when(ctx, log, *inputs):
        return None
    if stage.clocked:
        with ctx.clock.stage(stage.name) as st:
            result, message, st.computed = compute(stage, ctx, log, *inputs)
    else:
        result, message, _ = compute(stage, ctx, log, *inputs)
    if result is None:
        return None
    if stage.report is not None:
        stage.report(ctx, log, result, *inputs)
    for make in (stage.artifact, PAGES.get(stage.name)):
        if make is not None:
            _publish(make(result))
    return Completed(message=message, data=result) if message else result


def _as_task(stage: Stage[Any]) -> Task[..., Any]:
    def run(ctx: PlanContext, *inputs: Any) -> Any:
        return run_stage(stage, ctx, *inputs)

    run.__doc__ = f"The {stage.name} stage ({stage.result.__name__})."
    return task(name=stage.name, cache_policy=NO_CACHE)(run)


TASKS: dict[str, Task[..., Any]] = {s.name: _as_task(s) for s in STAGES}


def run(stage: Stage[Any], ctx: PlanContext, *inputs: Any) -> Any:
    """Run a declared stage as its Prefect task (in a flow: its result)."""
    return TASKS[stage.name](ctx, *inputs)


def start(stage: Stage[Any], ctx: PlanContext, *inputs: Any) -> PrefectFuture[Any]:
    """Start a declared stage as its Prefect task beside the flow's next ones; ``.result()`` waits for it."""
    return TASKS[stage.name].submit(ctx, *inputs)
