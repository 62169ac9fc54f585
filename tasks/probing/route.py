"""The route stage: how the model's routers pick experts on the workload, for per-expert placement.

Only a MoE model on a machine with a GPU, of an architecture whose expert path the split supports, is traced;
a trace that fails (its worker dies, say) leaves the plan to whole expert tensors rather than failing it.
"""

from __future__ import annotations

from typing import Any

from artifacts.ids import content_id
from artifacts.records.hardware import HardwareReport
from artifacts.records.kinds import ROUTING_PROFILE, ROUTING_TABLE
from artifacts.records.routing import RoutingProfile
from engine_bridge.errors import EngineError
from engine_bridge.expert_split import SPLIT_ARCHITECTURES
from engine_bridge.routing_trace import routing_table
from tasks import route
from tasks import workload as wl
from tasks.gpu_budget import gpu_devices
from tasks.stage import PlanContext, Stage


def traces_routing(ctx: PlanContext, hw: HardwareReport) -> bool:
    """A routing trace shapes the plan of a MoE model on a machine with a GPU (per-expert placement), for the
    architectures whose expert path the split supports."""
    return ctx.info.is_moe and bool(gpu_devices(hw)) and ctx.info.architecture in SPLIT_ARCHITECTURES


def _when(ctx: PlanContext, log: Any, hw: HardwareReport) -> bool:
    """Trace when it shapes the plan; say why not when only the architecture stops it."""
    if traces_routing(ctx, hw):
        return True
    if ctx.info.is_moe and gpu_devices(hw):
        log.info("route: no per-expert placement for %s (the expert split supports %s): planning from whole expert "
                 "tensors", ctx.info.architecture, ", ".join(sorted(SPLIT_ARCHITECTURES)))
    return False


def route_key(ctx: PlanContext, hw: HardwareReport | None = None) -> dict[str, Any]:
    """The trace's key: the model, the workload, the seed, the tokens traced (:func:`tasks.route.trace_tokens`:
    fewer for a small budget), the build and the code."""
    return {"stage": "route", "model": ctx.model_hash, "workload": ctx.req.workload, "seed": ctx.req.seed,
            "tokens": _tokens(ctx, hw), "backend": ctx.backend_build, "code": ctx.code}


def _tokens(ctx: PlanContext, hw: HardwareReport | None) -> int:
    return route.trace_tokens(hw, ctx.req.budget_s, wl.ONE_TIME_SHARE)


def _run(ctx: PlanContext, log: Any, hw: HardwareReport) -> RoutingProfile:
    lengths, _ = wl.nominal_lengths(ctx.info.n_ctx_train or 4096, ctx.req)
    prompts = wl.tune_prompts(ctx.model, lengths, ctx.req.seed, ctx.worker_log)
    tokens = _tokens(ctx, hw)
    if tokens < route.TRACE_TOKENS:
        log.info("route: tracing %d prompt tokens (of %d) to fit --budget-s %g", tokens, route.TRACE_TOKENS,
                 ctx.req.budget_s)
    n_ctx = max(len(p) for p in route.trace_prompts(prompts, tokens)) + route.TRACE_GEN + 16
    # beside the reference's CPU noise floor: a share of the cores while both run, all of them once it is done
    with ctx.cores.busy("route", hw.cpu.physical_cores) as cores:
        counts = route.trace(ctx.model, prompts, route.trace_params(n_ctx, cores.threads()), ctx.worker_log,
                             ctx.settings.plan.measure_timeout_s, threads_file=cores.path, tokens=tokens)
    table = routing_table(counts, ctx.model_hash)
    tid = content_id({"routing": content_id(route_key(ctx, hw)), "counts": counts.counts})
    ctx.store.put_table(ROUTING_TABLE, table, key=tid)
    prof = route.profile(counts, tid)
    log.info("route: %d tokens traced; each layer's busiest 10%% / 25%% / 50%% of experts take %.0f%% / %.0f%% / "
             "%.0f%% of its picks, %.0f%% of a token's picks are its predecessor's (median over layers)",
             counts.n_tokens, 100 * prof.coverage(0.1), 100 * prof.coverage(0.25), 100 * prof.coverage(0.5),
             100 * (prof.repeat or 0.0))
    return prof


STAGE: Stage[RoutingProfile | None] = Stage(
    name="route", version=1, result=RoutingProfile, run=_run, kind=ROUTING_PROFILE, key=route_key,
    inputs=("model hash", "workload", "seed", "tokens traced", "backend build", "code"), tables=(ROUTING_TABLE,),
    when=_when, recovers=(EngineError,), recovery="the routing trace failed ({error}); planning without per-expert placement")
