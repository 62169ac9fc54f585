"""The persist stage: the immutable plan, keyed like FFTW's wisdom (:func:`artifacts.records.keys.plan_key`),
and the look-up that finds a stored plan for the same key before anything is measured."""

from __future__ import annotations

import time
from typing import Any

from artifacts.engine_spec import NATIVE
from artifacts.ids import content_id
from artifacts.records.evidence import MeasureResults, ValidationReport
from artifacts.records.hardware import HardwareReport
from artifacts.records.keys import plan_key
from artifacts.records.kinds import MODEL_PATH, PLAN, ROUTING_PROFILE, TRIALS_RAW_TABLE, TRIALS_TABLE
from artifacts.records.plan import ModelPath, Plan
from artifacts.records.routing import RoutingProfile
from artifacts.records.search import Finalists, PlacementSpace
from tasks import workload as wl
from tasks.costmodel import all_gpu_decode, roofline_decode
from tasks.engines import engine_notes, spec_of
from tasks.gpu_budget import budget_notes
from tasks.measurement.speculation import draft_trials, drafted, mtp_note, speculation_notes
from tasks.probing import probe as probe_stage
from tasks.probing import route as route_stage
from tasks.recording.record import find_plan, load_notes, persist, plan_notes
from tasks.remote import rpc_notes
from tasks.search.prune import workload_for
from tasks.stage import PlanContext, Stage
from tasks.streaming import candidate_streaming


def _plan_key(ctx: PlanContext, hw: HardwareReport, routing: str | None) -> dict[str, Any]:
    key = plan_key(ctx.model_hash, hw, ctx.backend_build, ctx.req, ctx.settings_view(), routing, ctx.code)
    drafts = [d.model_hash for d in ctx.drafting if d.model_hash and d.kind == "model"]
    heads = [d.model_hash for d in ctx.drafting if d.model_hash and d.kind == "mtp"]
    # the draft's (the grafted heads') bytes, not only its path
    return {**key, **({"draft_model_hash": drafts[0]} if drafts else {}), **({"heads_hash": heads[0]} if heads else {})}


def existing_plan(ctx: PlanContext) -> str | None:
    """Id of a stored plan whose key matches, if the probe report (and routing trace) for it are stored."""
    hw = probe_stage.stored_probe(ctx)  # the newest (a re-probe is another link of its chain), busy or not
    if hw is None:
        return None
    routing: str | None = None
    if route_stage.traces_routing(ctx, hw):
        rid = content_id(route_stage.STAGE.key_of(ctx, hw))
        if not ctx.records.has(ROUTING_PROFILE, rid):
            return None
        routing = ctx.records.get(ROUTING_PROFILE, rid).trace_id
    found = find_plan(ctx.records, _plan_key(ctx, hw, routing))
    return found.id if found else None


def remember_model_path(ctx: PlanContext) -> None:
    """Record that the model's bytes live at this path too: ``flux serve`` of a plan made for the same bytes
    elsewhere finds them here (plans are immutable; the path they name may have moved)."""
    ctx.records.put(MODEL_PATH, ModelPath(model_hash=ctx.model_hash, path=ctx.req.model),
                    meta={"model_hash": ctx.model_hash, "path": ctx.req.model, "seen_at": time.time()})


def _run(ctx: PlanContext, log: Any, hw: HardwareReport, space: PlacementSpace, fin: Finalists,
         measured: MeasureResults, report: ValidationReport, routing: RoutingProfile | None = None) -> Plan:
    fin = drafted(ctx, hw, fin)
    trials = ctx.store.get_table(TRIALS_RAW_TABLE, measured.trials_table)
    drafts = draft_trials(fin.finalists, measured.summaries, trials.to_pylist()) if ctx.drafting else []
    work = wl.workload(measured.lengths, measured.n_gen) if measured.lengths else workload_for(ctx, space)
    winner = next(c for c in fin.finalists if c.id == report.winner_id)
    key = _plan_key(ctx, hw, routing.trace_id if routing is not None else None)
    return persist(ctx.store, key=key, routing=routing,
                   model_path=ctx.req.model, model_name=ctx.info.name, hw=hw, req=ctx.req, finalists=fin,
                   measured=measured, trials=trials, validation=report,
                   roofline_decode_tps=roofline_decode(ctx.info, hw, winner),
                   all_gpu_decode=all_gpu_decode(hw),
                   memory_limits=space.memory_limits, prefill_share=work.prefill_share,
                   notes=plan_notes(space, fin, measured, report, ctx.req.prefer_engine) + rpc_notes(hw, winner) + engine_notes(
                       {s.candidate_id: s for s in measured.summaries}, ctx.engines, winner)
                       + speculation_notes(drafts, winner) + (mtp_note(ctx.info.n_nextn_layers, ctx.req.engines) if ctx.req.speculation else [])
                       + budget_notes(hw, ctx.req) + load_notes(hw, fin, trials)
                       + ([routing.note] if routing is not None and routing.note else [])
                       + wl.cache_note(fin.finalists, measured.summaries, report.winner_id, ctx.req.domains),
                   speculation=drafts,
                   storage_streaming=candidate_streaming(ctx.info, hw, winner, space.memory_limits["CPU"])
                   if winner.needs_storage_streaming else None,
                   engine=None if winner.engine == NATIVE else spec_of(ctx.engines, winner.engine),
                   stage_seconds=ctx.clock.record())


def _report(ctx: PlanContext, log: Any, plan: Plan, *inputs: Any) -> None:
    for note in plan.notes:
        log.info("persist: %s", note)


STAGE: Stage[Plan] = Stage(
    name="persist", version=1, result=Plan, run=_run, kind=PLAN, tables=(TRIALS_TABLE,),
    inputs=("model hashes", "probe report", "backend build", "request", "settings", "routing trace", "code"),
    report=_report, clocked=False)
