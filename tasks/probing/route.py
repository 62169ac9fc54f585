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
from engine_bridge.ops import RoutingCounts
from engine_bridge.routing_trace import check_routing_table, routing_table
from engine_bridge.serve_trace import trace_meta
from tasks import workload as wl
from tasks.gpu_budget import gpu_devices
from tasks.probing import trace as route
from tasks.stage import WORKER, PlanContext, Stage


def traces_routing(ctx: PlanContext, hw: HardwareReport) -> bool:
    """A routing trace shapes the plan of a MoE model on a machine with a GPU (per-expert placement), for the
    architectures whose expert path the split supports; a served trace (``--routing-from``) keys such a model's
    plan on any machine (it costs no tracing)."""
    return ctx.info.is_moe and ctx.info.architecture in SPLIT_ARCHITECTURES and (
        bool(gpu_devices(hw)) or ctx.req.routing_from is not None)


def _when(ctx: PlanContext, log: Any, hw: HardwareReport) -> bool:
    """Trace when it shapes the plan; say why not when only the architecture stops it."""
    if traces_routing(ctx, hw):
        return True
    if ctx.info.is_moe and gpu_devices(hw):
        log.info("route: no per-expert placement for %s (the expert split supports %s): planning from whole expert "
                 "tensors", ctx.info.architecture, ", ".join(sorted(SPLIT_ARCHITECTURES)))
    return False


def route_key(ctx: PlanContext, hw: HardwareReport | None = None) -> dict[str, Any]:
    """The trace's key: the model, the workload, the seed, the tokens traced (:func:`tasks.probing.trace.trace_tokens`:
    fewer for a small budget), the build and the code."""
    key = {"stage": "route", "model": ctx.model_hash, "workload": ctx.req.workload, "seed": ctx.req.seed,
           "tokens": _tokens(ctx, hw), "backend": ctx.backend_build, "code": STAGE.code()}
    if ctx.req.domains:  # traced on a domain mix (--domains)
        key["domains"] = list(wl.trace_domains(ctx.req.domains))
    return key | {"served": ctx.req.routing_from} if ctx.req.routing_from is not None else key


def _tokens(ctx: PlanContext, hw: HardwareReport | None) -> int:
    return route.trace_tokens(hw, ctx.req.budget_s, wl.ONE_TIME_SHARE)


def _run(ctx: PlanContext, log: Any, hw: HardwareReport) -> RoutingProfile:
    served = _served(ctx, log) if ctx.req.routing_from is not None else None
    if isinstance(served, RoutingProfile):
        return served
    prof = _traced(ctx, log, hw)
    return prof.model_copy(update={"note": served}) if served else prof


def _served(ctx: PlanContext, log: Any) -> RoutingProfile | str:
    """The served trace's profile (``--routing-from``), or why it cannot rank experts (then the bundled trace)."""
    tid = ctx.req.routing_from or ""
    table = ctx.store.get_table(ROUTING_TABLE, tid)
    counts = check_routing_table(table, ctx.model_hash, ctx.info.n_layer, ctx.info.n_expert)
    meta = trace_meta(table)
    tokens, source = int(meta.get("n_tokens", 0)), meta.get("plan_id", "")[:12] or "a trace file"
    if tokens < route.MIN_TRACE_TOKENS:
        why = (f"the served trace ({source}) holds {tokens} sampled tokens, too few to rank experts (at least "
               f"{route.MIN_TRACE_TOKENS}): the routing is the bundled workload's trace")
        log.warning("route: %s", why)
        return why
    log.info("route: the routing `flux serve` counted (%s, %d tokens) replaces the workload's trace", source, tokens)
    rc = RoutingCounts(architecture=meta.get("architecture", ""), n_layer=ctx.info.n_layer,
                       n_expert=ctx.info.n_expert, n_expert_used=int(meta.get("n_expert_used", 0)), n_tokens=tokens,
                       counts=tuple(tuple(int(x) for x in row) for row in counts))
    return route.profile(rc, tid).model_copy(update={"note": (
        f"re-fitted to the routing `flux serve` counted ({source}, {tokens} sampled tokens, trace {tid[:12]})")})


def _traced(ctx: PlanContext, log: Any, hw: HardwareReport) -> RoutingProfile:
    lengths, _ = wl.nominal_lengths(ctx.info.n_ctx_train or 4096, ctx.req)
    prompts = wl.tune_prompts(ctx.model, lengths, ctx.req.seed, ctx.worker_log, wl.trace_domains(ctx.req.domains))
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
    if ctx.req.domains and wl.parse_domains(ctx.req.domains).shifts:
        prof = prof.model_copy(update={"measured": _measured_counts(ctx, hw, lengths, tokens)})
    log.info("route: %d tokens traced; each layer's busiest 10%% / 25%% / 50%% of experts take %.0f%% / %.0f%% / "
             "%.0f%% of its picks, %.0f%% of a token's picks are its predecessor's (median over layers)",
             counts.n_tokens, 100 * prof.coverage(0.1), 100 * prof.coverage(0.25), 100 * prof.coverage(0.5),
             100 * (prof.repeat or 0.0))
    return prof


def _measured_counts(ctx: PlanContext, hw: HardwareReport, lengths: list[int], tokens: int) -> tuple[tuple[int, ...], ...]:
    """The picks on the measured rounds' domains (--domains TRACE:MEASURE), traced as the trace is."""
    prompts = wl.tune_prompts(ctx.model, lengths, ctx.req.seed, ctx.worker_log, wl.measured_domains(ctx.req.domains))
    n_ctx = max(len(p) for p in route.trace_prompts(prompts, tokens)) + route.TRACE_GEN + 16
    with ctx.cores.busy("route", hw.cpu.physical_cores) as cores:
        counts = route.trace(ctx.model, prompts, route.trace_params(n_ctx, cores.threads()), ctx.worker_log,
                             ctx.settings.plan.measure_timeout_s, threads_file=cores.path, tokens=tokens)
    return counts.counts


STAGE: Stage[RoutingProfile | None] = Stage(
    name="route", version=1, result=RoutingProfile, run=_run, kind=ROUTING_PROFILE, key=route_key,
    inputs=("model hash", "workload", "seed", "tokens traced", "backend build", "code", "served trace"), tables=(ROUTING_TABLE,),
    when=_when, recovers=(EngineError,), recovery="the routing trace failed ({error}); planning without per-expert placement",
    sources=(*WORKER, "engine_bridge.worker.routing"))
