"""The reference stage: the quality gate's reference outputs and noise floor, computed once per model, machine
and build (kept in the cache directory under keys of everything they depend on, not in the store).

It needs the probe and the request alone, so the flow starts it right after the probe and it runs beside the
routing trace, enumeration and pruning (on a 30B model's first plan: a minute of reference and noise floor
hidden behind the same minute of them)."""

from __future__ import annotations

from typing import Any

from artifacts.config import Settings
from artifacts.records.hardware import HardwareReport
from tasks import workload as wl
from tasks.enumerate import smallest_context
from tasks.quality_gate import Gate
from tasks.reference import ReferenceOutputs, reference
from tasks.stage import PlanContext, Stage


def gate(settings: Settings) -> Gate:
    """The quality gate's limits from the ``[plan]`` settings."""
    plan = settings.plan
    return Gate(max_kl=plan.max_kl, min_top1=plan.min_top1, floor_factor=plan.floor_factor, min_kl=plan.min_kl)


def _run(ctx: PlanContext, log: Any, hw: HardwareReport) -> ReferenceOutputs:
    n_tok = ctx.settings.plan.validate_tokens
    n_ctx = smallest_context(ctx.info, hw, ctx.req, ctx.settings.host_reserve_percent)  # refusals first: nothing to wait for
    prompts, held = wl.validation_prompts(ctx.model, n_ctx, n_tok, ctx.req.seed, ctx.worker_log)
    # the routing trace runs beside it on the CPU: they share the cores (ctx.cores)
    out = reference(ctx.model, ctx.info, hw, prompts, held, n_tokens=n_tok, seed=ctx.req.seed, cores=ctx.cores,
                    gate=gate(ctx.settings), keys={"model": ctx.model_hash, "code": ctx.code,
                                                   "backend": ctx.backend_build},
                    cache_dir=ctx.settings.cache_dir / "validation", log_path=ctx.worker_log,
                    timeout_s=ctx.settings.plan.measure_timeout_s, progress=log.info)
    log.info("reference: %d sequences of up to %d tokens + %d scored, on %s; %s in %.0f s",
             len(prompts), max(len(p) for p in prompts), n_tok, out.device,
             "computed" if out.computed else "reused", out.seconds)
    return out


STAGE: Stage[ReferenceOutputs] = Stage(
    name="reference", version=1, result=ReferenceOutputs, run=_run,
    inputs=("model hash", "reference placement", "validation prompts", "backend build", "code"),
    computed=lambda out: bool(out.computed))
