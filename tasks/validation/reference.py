"""The reference stage: the quality gate's reference outputs and noise floor, computed once per model, machine
and build (kept in the cache directory under keys of everything they depend on, not in the store).

It needs the probe and the request alone, so the flow starts it right after the probe and it runs beside the
routing trace, enumeration and pruning (on a 30B model's first plan: a minute of reference and noise floor
hidden behind the same minute of them)."""

from __future__ import annotations

from typing import Any, NamedTuple

from artifacts.config import Settings
from artifacts.model_info import ModelInfo
from artifacts.records.hardware import HardwareReport
from tasks import workload as wl
from tasks.quality_gate import Gate
from tasks.search.space import smallest_context
from tasks.stage import NATIVE_OPS, PlanContext, Stage
from tasks.validation.outputs import FLOOR_SEQUENCES, ReferenceOutputs, predicted_seconds, reference


def gate(settings: Settings) -> Gate:
    """The quality gate's limits from the ``[plan]`` settings."""
    plan = settings.plan
    return Gate(max_kl=plan.max_kl, min_top1=plan.min_top1, floor_factor=plan.floor_factor, min_kl=plan.min_kl)


# The scales a reference is tried at, largest first, until its predicted seconds fit its share of the budget.
SCALES = (1.0, 0.75, 0.5, 0.35, 0.25, 0.15, 0.1, 0.0)


class Shape(NamedTuple):
    """How much a reference computes: the scale, tokens scored per sequence, noise-floor sequences, and its
    predicted seconds (:func:`tasks.validation.outputs.predicted_seconds`)."""

    scale: float
    n_tokens: int
    floor_sequences: int
    predicted_s: float


def shape(info: ModelInfo, hw: HardwareReport, budget_s: float, validate_tokens: int) -> Shape:
    """The largest reference whose predicted seconds fit its share of ``--budget-s`` (tasks.workload.ONE_TIME_SHARE):
    the reference and the noise floor scale with the budget as the measuring rounds do (on the 2-core machine a
    small real model's reference alone took 709 s of a 120 s budget; the mixtral twin's noise floor 80 s of 240)."""
    full = validate_tokens
    out = Shape(1.0, full, FLOOR_SEQUENCES, 0.0)
    for scale in SCALES:
        cap, n_convs = wl.validation_shape(scale)
        n_tok = max(min(full, wl.MIN_GEN), int(full * scale))
        floor = max(2, round(FLOOR_SEQUENCES * scale))
        out = Shape(scale, n_tok, floor, predicted_seconds(info, hw, n_convs + 2, cap, n_tok, floor))
        if out.predicted_s <= wl.ONE_TIME_SHARE * budget_s:
            break
    return out


def _run(ctx: PlanContext, log: Any, hw: HardwareReport) -> ReferenceOutputs:
    sized = shape(ctx.info, hw, ctx.req.budget_s, ctx.settings.plan.validate_tokens)
    n_tok = sized.n_tokens
    n_ctx = smallest_context(ctx.info, hw, ctx.req, ctx.settings.host_reserve_percent)  # refusals first: nothing to wait for
    prompts, held = wl.validation_prompts(ctx.model, n_ctx, n_tok, ctx.req.seed, ctx.worker_log, sized.scale)
    if sized.scale < 1.0:
        log.info("reference: sized to %.0f%% for --budget-s %g (~%.0f s predicted): %d sequences, %d tokens scored "
                 "each, a noise floor over %d", 100 * sized.scale, ctx.req.budget_s, sized.predicted_s, len(prompts),
                 n_tok, sized.floor_sequences)
    # the routing trace runs beside it on the CPU: they share the cores (ctx.cores)
    out = reference(ctx.model, ctx.info, hw, prompts, held, n_tokens=n_tok, seed=ctx.req.seed, cores=ctx.cores,
                    gate=gate(ctx.settings), keys={"model": ctx.model_hash, "code": STAGE.code(),
                                                   "backend": ctx.backend_build},
                    cache_dir=ctx.settings.cache_dir / "validation", log_path=ctx.worker_log,
                    timeout_s=ctx.settings.plan.measure_timeout_s, progress=log.info,
                    floor_sequences=sized.floor_sequences)
    log.info("reference: %d sequences of up to %d tokens + %d scored, on %s; %s in %.0f s",
             len(prompts), max(len(p) for p in prompts), n_tok, out.device,
             "computed" if out.computed else "reused", out.seconds)
    return out


STAGE: Stage[ReferenceOutputs] = Stage(
    name="reference", version=1, result=ReferenceOutputs, run=_run,
    inputs=("model hash", "reference placement", "validation prompts", "backend build", "code"),
    computed=lambda out: bool(out.computed), sources=NATIVE_OPS)
