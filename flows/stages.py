"""Prefect tasks around the pipeline stages, with Flux's own content-addressed caching.

Each task computes its stage key from its inputs, returns the stored output when the store has it
(state message "reused from the store"), else runs the stage and publishes the output. Prefect's own
result caching is off (its default key includes the run id and its files are pickles); a retried flow
run recomputes the same keys and so reuses every stage that finished — measure and validate included,
since their keys include the flow run id.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.context import get_run_context
from prefect.states import Completed
from pydantic import BaseModel

from artifacts.code_id import code_id
from artifacts.config import Settings
from artifacts.filehash import model_hash
from artifacts.ids import content_id
from artifacts.model_info import ModelInfo
from artifacts.records.evidence import MeasureResults, MeasureSummary, ValidationReport
from artifacts.records.hardware import HardwareReport, MachineFacts
from artifacts.records.keys import plan_key, probe_key
from artifacts.records.kinds import (
    FINALISTS,
    MEASURED,
    MODEL_PATH,
    PROBE,
    ROUTING_PROFILE,
    ROUTING_TABLE,
    SPACE,
    TRIALS_RAW_TABLE,
    VALIDATION,
    Kind,
)
from artifacts.records.machine import machine_facts
from artifacts.records.plan import ModelPath, PlanRequest
from artifacts.records.routing import RoutingProfile
from artifacts.records.search import Candidate, Finalists, PlacementSpace
from artifacts.records.store import Records
from artifacts.store import Store
from engine_bridge.backend import backend_info
from engine_bridge.errors import EngineError
from engine_bridge.expert_split import SPLIT_ARCHITECTURES
from engine_bridge.routing_trace import routing_table
from flows import workload as wl
from flows.progress import StageClock
from tasks import route
from tasks.costmodel import Workload, all_gpu_decode, roofline_decode
from tasks.enumerate import enumerate_placements, gpu_devices, gpu_limits
from tasks.gpu_memory import predicted_gpu_bytes
from tasks.measure import Scoring, measure
from tasks.persist import find_plan, persist, plan_notes
from tasks.probe import probe
from tasks.prune import prune
from tasks.quality_gate import Gate
from tasks.reference import ReferenceOutputs, floor_variants, reference
from tasks.validate import rank_measured, validate

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class PlanContext:
    """What every stage needs: request, settings, store, model facts, backend build."""

    req: PlanRequest
    settings: Settings
    store: Store
    info: ModelInfo
    model_hash: str
    backend_build: str
    facts: MachineFacts
    code: str = ""
    clock: StageClock = field(default_factory=lambda: StageClock(0.0))

    @property
    def model(self) -> Path:
        """The model file."""
        return Path(self.req.model)

    @property
    def records(self) -> Records:
        """The store's records, typed by kind."""
        return Records(self.store)

    @property
    def worker_log(self) -> Path:
        """Where planning workers write their output."""
        return self.settings.logs_dir / "plan-worker.log"

    def settings_view(self) -> dict[str, Any]:
        """The settings that shape a plan (part of its key)."""
        return {"host_reserve_percent": self.settings.host_reserve_percent,
                **self.settings.plan.model_dump(exclude={"tuning_budget_s"})}


def context(req: PlanRequest, settings: Settings) -> PlanContext:
    """Read the model (header + cached hash) and the backend build once per flow run."""
    from flows.cmd_models import inspect_model

    info = inspect_model(Path(req.model), settings.cache_dir, with_hash=False)
    mh = model_hash([Path(s) for s in info.shards], settings.cache_dir)
    return PlanContext(req=req, settings=settings, store=Store(settings.data_dir), info=info.model_copy(
        update={"content_hash": mh}), model_hash=mh, backend_build=backend_info(settings.cache_dir).build_id,
        facts=machine_facts(), code=code_id(), clock=StageClock(req.budget_s))


def _flow_run_id() -> str:
    try:
        ctx = get_run_context()
        run = getattr(ctx, "flow_run", None) or getattr(getattr(ctx, "task_run", None), "flow_run_id", None)
        return str(getattr(run, "id", run))
    except Exception:  # noqa: BLE001 - outside a run (task.fn in tests): no run id
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


def cached(records: Records, kind: Kind[M], key: dict[str, Any], compute: Callable[[], M],
           force: bool = False, fault: str | None = None) -> Any:
    """Return a Completed state holding the stored ``kind`` output for ``key``, computing it if needed."""
    kid = content_id(key)
    log = get_run_logger()
    if not force and records.has(kind, kid):
        obj = records.get(kind, kid)
        msg = f"{kind.name} {kid[:12]} reused from the store"
        log.info(msg)
        return Completed(message=msg, data=obj)
    inject_fault(fault, kind.name)
    obj = compute()
    records.put(kind, obj, key=kid)
    return Completed(message=f"{kind.name} {kid[:12]} computed and stored", data=obj)


def existing_plan(ctx: PlanContext) -> str | None:
    """Id of a stored plan whose key matches, if the probe report (and routing trace) for it are stored."""
    pid = content_id(probe_key(ctx.facts, ctx.model_hash, ctx.backend_build, ctx.code))
    if not ctx.records.has(PROBE, pid):
        return None
    hw = ctx.records.get(PROBE, pid)
    routing: str | None = None
    if _traces_routing(ctx, hw):
        rid = content_id(_route_key(ctx))
        if not ctx.records.has(ROUTING_PROFILE, rid):
            return None
        routing = ctx.records.get(ROUTING_PROFILE, rid).trace_id
    found = find_plan(ctx.records, plan_key(ctx.model_hash, hw, ctx.backend_build, ctx.req, ctx.settings_view(), routing,
                                          ctx.code))
    return found.id if found else None


def remember_model_path(ctx: PlanContext) -> None:
    """Record that the model's bytes live at this path too: ``flux serve`` of a plan made for the same bytes
    elsewhere finds them here (plans are immutable; the path they name may have moved)."""
    import time

    ctx.records.put(MODEL_PATH, ModelPath(model_hash=ctx.model_hash, path=ctx.req.model),
                    meta={"model_hash": ctx.model_hash, "path": ctx.req.model, "seen_at": time.time()})


@task(name="probe", cache_policy=NO_CACHE)
def probe_stage(ctx: PlanContext, reprobe: bool) -> HardwareReport:
    """Measure this machine (reused unless --reprobe)."""
    key = probe_key(ctx.facts, ctx.model_hash, ctx.backend_build, ctx.code)
    return _clocked(ctx, "probe", lambda: cached(ctx.records, PROBE, key, lambda: probe(
        ctx.model, ctx.model_hash, ctx.settings, ctx.backend_build), force=reprobe))


def _clocked(ctx: PlanContext, name: str, compute: Callable[[], Any]) -> Any:
    """Run a stage on the flow's clock; a state whose message says "reused" counts as reused."""
    with ctx.clock.stage(name) as st:
        state = compute()
        st.computed = state is not None and "reused" not in str(getattr(state, "message", "") or "")
    return state


def _traces_routing(ctx: PlanContext, hw: HardwareReport) -> bool:
    """A routing trace shapes the plan of a MoE model on a machine with a GPU (per-expert placement), for the
    architectures whose expert path the split supports."""
    return ctx.info.is_moe and bool(gpu_devices(hw)) and ctx.info.architecture in SPLIT_ARCHITECTURES


def _route_key(ctx: PlanContext) -> dict[str, Any]:
    return {"stage": "route", "model": ctx.model_hash, "workload": ctx.req.workload, "seed": ctx.req.seed,
            "tokens": route.TRACE_TOKENS, "backend": ctx.backend_build, "code": ctx.code}


@task(name="route", cache_policy=NO_CACHE)
def route_stage(ctx: PlanContext, hw: HardwareReport) -> RoutingProfile | None:
    """How the model's routers pick experts on the workload (MoE models on a GPU machine; else nothing)."""
    if not _traces_routing(ctx, hw):
        if ctx.info.is_moe and gpu_devices(hw):
            get_run_logger().info(
                "route: no per-expert placement for %s (the expert split supports %s): planning from whole expert "
                "tensors", ctx.info.architecture, ", ".join(sorted(SPLIT_ARCHITECTURES)))
        return None
    return _clocked(ctx, "route", lambda: traced_routing(ctx, hw, get_run_logger()))


def traced_routing(ctx: PlanContext, hw: HardwareReport, log: Any) -> Any:
    """The workload's routing trace (from the store when there), as a completed state; None with a warning
    when the trace fails (its worker dies, say): the plan is then made from whole expert tensors."""

    def run() -> RoutingProfile:
        lengths, _ = wl.nominal_lengths(ctx.info.n_ctx_train or 4096, ctx.req)
        prompts = wl.tune_prompts(ctx.model, lengths, ctx.req.seed, ctx.worker_log)
        n_ctx = max(len(p) for p in route.trace_prompts(prompts)) + route.TRACE_GEN + 16
        counts = route.trace(ctx.model, prompts, route.trace_params(n_ctx, hw.cpu.physical_cores), ctx.worker_log,
                             ctx.settings.plan.measure_timeout_s)
        table = routing_table(counts, ctx.model_hash)
        tid = content_id({"routing": content_id(_route_key(ctx)), "counts": counts.counts})
        ctx.store.put_table(ROUTING_TABLE, table, key=tid)
        prof = route.profile(counts, tid)
        log.info("route: %d tokens traced; each layer's busiest 10%% / 25%% / 50%% of experts take %.0f%% / %.0f%% / "
                 "%.0f%% of its picks (median over layers)", counts.n_tokens, 100 * prof.coverage(0.1),
                 100 * prof.coverage(0.25), 100 * prof.coverage(0.5))
        return prof

    try:
        return cached(ctx.records, ROUTING_PROFILE, _route_key(ctx), run)
    except EngineError as e:  # the plan is still made, from whole expert tensors
        log.warning("route: the routing trace failed (%s); planning without per-expert placement", e)
        return None


def _space_key(ctx: PlanContext, hw: HardwareReport, routing: RoutingProfile | None = None) -> dict[str, Any]:
    flags = ctx.req.model_dump(include={"ctx", "concurrency", "kv", "gpu_mem_budget_gib", "allow_storage_streaming", "seed"})
    key = {"stage": "enumerate", "probe": content_id(hw), "model": ctx.model_hash, "flags": flags,
           "reserve": ctx.settings.host_reserve_percent, "code": ctx.code}
    return {**key, "routing": routing.trace_id} if routing is not None else key


@task(name="enumerate", cache_policy=NO_CACHE)
def enumerate_stage(ctx: PlanContext, hw: HardwareReport, routing: RoutingProfile | None = None) -> PlacementSpace:
    """The memory-feasible search space (with per-expert placements when a routing trace is given)."""
    shares = routing.shares() if routing is not None else None
    return _clocked(ctx, "enumerate", lambda: cached(ctx.records, SPACE, _space_key(ctx, hw, routing),
                    lambda: enumerate_placements(ctx.info, hw, ctx.req, ctx.settings.host_reserve_percent, shares)))


def _kv_label(c: Candidate) -> str:
    """Where a finalist's KV cache lives, for the log (a CPU-only candidate has no GPU to hold it)."""
    if not any(d != "CPU" for d in (*c.weights_bytes, *c.kv_bytes)):
        return "cpu-only"
    return "kv-gpu" if c.params.offload_kqv else "kv-host"


def workload_for(ctx: PlanContext, space: PlacementSpace) -> Workload:
    """Token counts of the workload the plan is ranked on: every prompt of the request's workload once."""
    return wl.workload(*wl.nominal_lengths(space.n_ctx, ctx.req))


@task(name="prune", cache_policy=NO_CACHE)
def prune_stage(ctx: PlanContext, hw: HardwareReport, space: PlacementSpace) -> Finalists:
    """Cost-model ranking and the finalists."""
    work = workload_for(ctx, space)
    key = {"stage": "prune", "space": content_id(space), "work": [work.prefill_tokens, work.decode_tokens],
           "n": ctx.req.finalists, "code": ctx.code}
    state = _clocked(ctx, "prune", lambda: cached(ctx.records, FINALISTS, key,
                                                  lambda: prune(space, ctx.info, hw, work, ctx.req.finalists)))
    fin: Finalists = state.data
    log = get_run_logger()
    log.info("prune: %d finalists of %d candidates for a workload of %d prompt + %d generated tokens: %s",
             len(fin.finalists), fin.n_ranked, work.prefill_tokens, work.decode_tokens, "; ".join(
                 f"{c.id} {c.family} ctx {c.params.n_ctx} ub {c.params.n_ubatch} t {c.params.n_threads} "
                 f"{_kv_label(c)} predicted {p.score_s:.2f} s "
                 f"({p.prefill_tps:.0f}/{p.decode_tps:.1f} tok/s)"
                 for c, p in zip(fin.finalists, fin.predictions, strict=True)))
    create_table_artifact(key="finalists", description="Finalists and their predicted speed", table=[
        {"candidate": c.id, "family": c.family, "ctx": c.params.n_ctx, "kv": "gpu" if c.params.offload_kqv else "host",
         "threads": f"{c.params.n_threads}/{c.params.n_threads_batch}",
         "ubatch": c.params.n_ubatch, "flash_attn": c.params.flash_attn, "load": c.params.load_mode,
         "host": "repacked" if c.params.no_host else "gpu-host",
         "hot_experts": sum(len(h.experts) for h in c.params.expert_split.layers) if c.params.expert_split else 0,
         "pred_workload_s": round(p.score_s, 3), "pred_prefill_tps": round(p.prefill_tps, 1),
         "pred_decode_tps": round(p.decode_tps, 1)}
        for c, p in zip(fin.finalists, fin.predictions, strict=True)])
    return state


@task(name="reference", cache_policy=NO_CACHE)
def reference_stage(ctx: PlanContext, hw: HardwareReport, fin: Finalists) -> ReferenceOutputs:
    """The quality gate's reference outputs and noise floor (computed once per model, machine and build)."""
    log = get_run_logger()
    with ctx.clock.stage("reference") as st:
        n_tok = ctx.settings.plan.validate_tokens
        prompts, held = wl.validation_prompts(ctx.model, min(c.params.n_ctx for c in fin.finalists), n_tok,
                                              ctx.req.seed, ctx.worker_log)
        out = reference(ctx.model, ctx.info, hw, prompts, held, n_tokens=n_tok, seed=ctx.req.seed,
                        gate=_gate(ctx.settings), keys={"model": ctx.model_hash, "code": ctx.code,
                                                        "backend": ctx.backend_build},
                        cache_dir=ctx.settings.cache_dir / "validation", log_path=ctx.worker_log,
                        timeout_s=ctx.settings.plan.measure_timeout_s, progress=log.info)
        st.computed = out.computed
        log.info("reference: %d sequences of up to %d tokens + %d scored, on %s; %s in %.0f s",
                 len(prompts), max(len(p) for p in prompts), n_tok, out.device,
                 "computed" if out.computed else "reused", out.seconds)
    return out


@task(name="measure", cache_policy=NO_CACHE)
def measure_stage(ctx: PlanContext, hw: HardwareReport, fin: Finalists, ref: ReferenceOutputs) -> MeasureResults:
    """Time the finalists in fresh workers within what the budget has left; each finalist's first visit also
    scores the reference's continuations for validation."""
    log = get_run_logger()
    with ctx.clock.stage("measure"):
        spent = ctx.clock.in_budget_spent()
        budget = wl.measure_budget(ctx.req.budget_s, spent)
        rates = wl.load_rates(hw, ctx.info.file_bytes)
        n_ctx = min(c.params.n_ctx for c in fin.finalists)
        lengths, n_gen = wl.measurement_lengths(fin, n_ctx, ctx.req, budget, rates)
        kept = wl.fitting_finalists(fin, lengths, n_gen, budget, rates)
        wl.check_budget(kept, lengths, n_gen, budget, rates, spent)
        if len(kept.finalists) < len(fin.finalists):
            log.info("measure: %d of %d finalists fit %d rounds in the %.0f s left of the budget (%s dropped; a larger "
                     "--budget-s measures them)", len(kept.finalists), len(fin.finalists), wl.MIN_ROUNDS, budget,
                     ", ".join(c.id for c in fin.finalists if c not in kept.finalists))
        log.info("measure: %d prompt(s) of %s tokens + %d generated each, %d finalists, up to %d rounds in %.0f s",
                 len(lengths), "/".join(map(str, lengths)), n_gen, len(kept.finalists), ctx.req.repeats, budget)
        key = {"stage": "measure", "finalists": content_id(fin), "run": _flow_run_id(), "budget": ctx.req.budget_s,
               "code": ctx.code}
        score_tokens = sum(len(p) + len(c) for p, c in ref.seqs())

        def run() -> MeasureResults:
            prompts = wl.tune_prompts(ctx.model, lengths, ctx.req.seed, ctx.worker_log)
            summaries, table, used, stopped = measure(
                kept.finalists, ctx.model, prompts, n_gen, budget_s=budget, repeats=ctx.req.repeats,
                timeout_s=ctx.settings.plan.measure_timeout_s, log_path=ctx.worker_log, seed=ctx.req.seed,
                progress=log.info, gpu_budgets=gpu_limits(hw, ctx.req) if ctx.req.gpu_mem_budget_gib else None,
                predicted_gpu={c.id: sum(predicted_gpu_bytes(c, hw).values()) for c in kept.finalists},
                scoring=Scoring(ref.seqs(), ref.held_out, scored_dir(ctx, key)),
                predicted_visit_s={c.id: wl.visit_seconds(c, p, lengths, n_gen, rates, score_tokens)
                                   for c, p in zip(kept.finalists, kept.predictions, strict=True)})
            tid = content_id({"measure": content_id(key), "rows": table.num_rows})
            ctx.store.put_table(TRIALS_RAW_TABLE, table, key=tid)
            dropped = [MeasureSummary(candidate_id=c.id, prefill_tps=None, decode_tps=None, workload_s=None, n_trials=0,
                                      error="not measured: the budget left did not fit it") for c in fin.finalists
                       if c.id not in {k.id for k in kept.finalists}]
            return MeasureResults(summaries=summaries + dropped, trials_table=tid, budget_s=budget, spent_s=used,
                                  stopped_by_budget=stopped, lengths=lengths, n_gen=n_gen,
                                  scored_dir=str(scored_dir(ctx, key)))

        return cached(ctx.records, MEASURED, key, run, fault=ctx.settings.fault_inject)


def scored_dir(ctx: PlanContext, key: dict[str, Any]) -> Path:
    """Where a measure run keeps its finalists' scores of the reference's continuations."""
    return ctx.settings.cache_dir / "validation" / "scored" / content_id(key)[:16]


def _gate(settings: Settings) -> Gate:
    plan = settings.plan
    return Gate(max_kl=plan.max_kl, min_top1=plan.min_top1, floor_factor=plan.floor_factor, min_kl=plan.min_kl)


@task(name="validate", cache_policy=NO_CACHE)
def validate_stage(ctx: PlanContext, hw: HardwareReport, fin: Finalists, measured: MeasureResults,
                   ref: ReferenceOutputs) -> ValidationReport:
    """The fastest finalists against the reference placement, within the noise floor of correct kernels."""
    log = get_run_logger()
    with ctx.clock.stage("validate"):
        return _validated(ctx, hw, fin, measured, ref, log)


def _validated(ctx: PlanContext, hw: HardwareReport, fin: Finalists, measured: MeasureResults,
               ref: ReferenceOutputs, log: Any) -> Any:
    ok = rank_measured(measured.summaries, fin.finalists)
    if not ok:
        from tasks.errors import NoMeasurement

        raise NoMeasurement("; ".join(f"{s.candidate_id}: {s.error}" for s in measured.summaries))
    by_id = {c.id: c for c in fin.finalists}
    ranked = [by_id[s.candidate_id] for s in ok]
    log.info("validate: measured order %s", ", ".join(
        f"{s.candidate_id} {s.workload_s:.2f} s" + (f" (ctx {by_id[s.candidate_id].params.n_ctx})" if len(
            {c.params.n_ctx for c in ranked}) > 1 else "") for s in ok))
    key = {"stage": "validate", "measured": content_id(measured), "run": _flow_run_id(), "code": ctx.code}

    def run() -> ValidationReport:
        return validate(ranked, ctx.model, ref.prompts, ref.held_out, n_tokens=ctx.settings.plan.validate_tokens,
                        gate=_gate(ctx.settings), quality_profile=ctx.req.quality_profile, log_path=ctx.worker_log,
                        timeout_s=ctx.settings.plan.measure_timeout_s, reference=ref.reference,
                        floor_variants=floor_variants(ctx.info, hw, ref.reference), cache=ref.cache, progress=log.info,
                        scored_dir=Path(measured.scored_dir) if measured.scored_dir else None)

    state = cached(ctx.records, VALIDATION, key, run, fault=ctx.settings.fault_inject)
    report: ValidationReport = state.data
    log.info("validate: chose %s, the fastest measured finalist that matches the reference (limits: mean KL %s, "
             "top-1 %s)", report.winner_id, f"{report.kl_limit:.2e}" if report.kl_limit is not None else "?",
             f"{report.top1_limit:.3f}" if report.top1_limit is not None else "?")
    return state


@task(name="persist", cache_policy=NO_CACHE)
def persist_stage(ctx: PlanContext, hw: HardwareReport, space: PlacementSpace, fin: Finalists,
                  measured: MeasureResults, report: ValidationReport, routing: RoutingProfile | None = None) -> str:
    """Write the immutable plan; returns its id."""
    trials = ctx.store.get_table(TRIALS_RAW_TABLE, measured.trials_table)
    work = wl.workload(measured.lengths, measured.n_gen) if measured.lengths else workload_for(ctx, space)
    winner = next(c for c in fin.finalists if c.id == report.winner_id)
    key = plan_key(ctx.model_hash, hw, ctx.backend_build, ctx.req, ctx.settings_view(),
                   routing.trace_id if routing is not None else None, ctx.code)
    plan = persist(ctx.store, key=key, routing=routing,
                   model_path=ctx.req.model, model_name=ctx.info.name, hw=hw, req=ctx.req, finalists=fin,
                   measured=measured, trials=trials, validation=report,
                   roofline_decode_tps=roofline_decode(ctx.info, hw, winner),
                   all_gpu_decode=all_gpu_decode(hw),
                   memory_limits=space.memory_limits, prefill_share=work.prefill_share,
                   notes=plan_notes(space, fin, measured, report), stage_seconds=ctx.clock.record())
    log = get_run_logger()
    for note in plan.notes:
        log.info("persist: %s", note)
    from flows.show import plan_markdown

    create_markdown_artifact(key="plan", markdown=plan_markdown(plan), description="The chosen plan")
    logging.getLogger(__name__).debug("persisted %s", plan.id)
    return plan.id
