"""``flux bench ablate``: the full plan against variants that each undo ONE choice the plan made.

A variant replaces one of the plan's settings with llama-cpp-python's default (threads, n_ubatch, flash
attention, load mode, KV offload, offload threshold) or moves every expert tensor back to the CPU. Only
what the plan *chose differently* from the default is undone: a variant identical to the plan is listed
as "not chosen by the plan" and not measured. The plan and the variants race in the same paired,
randomized rounds as ``flux bench run``; the ratio plan/variant says what that choice is worth (above 1:
the choice makes the plan faster).

Rows are ``info``, except that a choice which makes the plan slower on both prefill and decode (both
intervals below 1, on an idle machine) is a ``fail``: the planner kept something that measurably hurts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from artifacts.engine_params import EngineParams, TensorOverride
from artifacts.records.search import Candidate
from tasks.bench.context import BenchContext, Progress
from tasks.bench.engines import (
    EngineSpec,
    llama_cpp_python_defaults,
    no_drafting,
    other_engine,
    plan_engine,
    server_spec,
)
from tasks.bench.host import load_avg
from tasks.bench.record import BenchRun, SummaryRow
from tasks.bench.registry import Suite
from tasks.bench.rows import ratio_row, tokenize_prompts
from tasks.bench.run import (
    compare,
    engine_error,
    prompt_lengths,
    race,
    trial_busy,
)

EXPERTS_ON_CPU = TensorOverride(pattern=r"\.ffn_(gate|up|down)_exps", device="CPU")
Variant = Callable[[Candidate, EngineParams], EngineParams | str]  # the variant, or why there is none


class AblateOptions(BaseModel):
    """How ``flux bench ablate`` races."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rounds: int = Field(3, ge=1, le=50)
    prompts: int = Field(2, ge=1, le=20)
    n_gen: int = Field(32, ge=2, le=1024)
    seed: int = 0
    n_boot: int = Field(4000, ge=100)


def _with(p: EngineParams, **update: Any) -> EngineParams | str:
    """``p`` with fields replaced, validated again (model_copy would skip the checks)."""
    try:
        return EngineParams.model_validate({**p.model_dump(), **update})
    except ValueError as exc:
        return f"cannot undo: {exc}"


def _threads(c: Candidate, d: EngineParams) -> EngineParams | str:
    p = c.params
    if (p.n_threads, p.n_threads_batch) == (d.n_threads, d.n_threads_batch):
        return f"not chosen by the plan (threads {p.n_threads}/{p.n_threads_batch} are the default)"
    return _with(p, n_threads=d.n_threads, n_threads_batch=d.n_threads_batch)


def _ubatch(c: Candidate, d: EngineParams) -> EngineParams | str:
    p = c.params
    if p.n_ubatch == d.n_ubatch:
        return f"not chosen by the plan (n_ubatch {p.n_ubatch} is the default)"
    return _with(p, n_ubatch=d.n_ubatch, n_batch=max(p.n_batch, d.n_ubatch))


def _flash_attn(c: Candidate, d: EngineParams) -> EngineParams | str:
    p = c.params
    if p.flash_attn == d.flash_attn:
        return f"not chosen by the plan (flash attention {'on' if p.flash_attn else 'off'} is the default)"
    if p.type_v not in ("f16", "f32") and not d.flash_attn:
        return f"cannot undo: the plan's {p.type_v} V cache needs flash attention"
    return _with(p, flash_attn=d.flash_attn)


def _load_mode(c: Candidate, d: EngineParams) -> EngineParams | str:
    if c.params.load_mode == d.load_mode:
        return f"not chosen by the plan (load mode {d.load_mode} is the default)"
    return _with(c.params, load_mode=d.load_mode)


def _host_layout(c: Candidate, d: EngineParams) -> EngineParams | str:
    if c.params.no_host == d.no_host:
        return "not chosen by the plan (host weights in the GPU's pinned buffer are the default)"
    return _with(c.params, no_host=d.no_host)


def _kv_offload(c: Candidate, d: EngineParams) -> EngineParams | str:
    if c.params.offload_kqv == d.offload_kqv:
        return "not chosen by the plan (KV offload is the default)"
    return _with(c.params, offload_kqv=d.offload_kqv)


def _offload_threshold(c: Candidate, d: EngineParams) -> EngineParams | str:
    if c.params.offload_min_batch is None:
        return "not chosen by the plan (llama.cpp's default offload threshold)"
    return _with(c.params, offload_min_batch=None)


def _experts(c: Candidate, d: EngineParams) -> EngineParams | str:
    on_gpu = [e for layer in c.placement.expert_device for e in layer.values() if e != "CPU"]
    if not c.placement.expert_device:
        return "not chosen by the plan (dense model: no experts)"
    if not on_gpu:
        return "not chosen by the plan (every expert tensor is on the CPU)"
    kept = tuple(o for o in c.params.tensor_overrides if "exps" not in o.pattern)
    return _with(c.params, tensor_overrides=(*kept, EXPERTS_ON_CPU))


VARIANTS: dict[str, Variant] = {
    "default-threads": _threads, "ubatch-512": _ubatch, "flash-attn-default": _flash_attn,
    "load-mmap": _load_mode, "host-pinned": _host_layout, "kv-offload-default": _kv_offload,
    "offload-threshold-default": _offload_threshold,
    "experts-on-cpu": _experts,
}


OTHER = "other-engine"  # the plan's placement on the other engine (llama-server for a native plan, and back)
NO_SPEC = "no-speculation"  # the plan's placement decoding without its draft


def variants(c: Candidate, cpu_count: int | None = None) -> dict[str, EngineParams | str]:
    """Every variant of the plan's candidate: its parameters, or why it is not measured."""
    defaults = llama_cpp_python_defaults(c.params, cpu_count)
    return {name: fn(c, defaults) for name, fn in VARIANTS.items()}


def _row(name: str, params: EngineParams, ctx: BenchContext, table: Any, opts: AblateOptions,
         common: dict[str, Any]) -> SummaryRow:
    draft = ctx.plan.candidate.draft
    changed = (f"engine {plan_engine(ctx).kind} -> {other_engine(ctx).kind}" if name == OTHER else
               f"drafting {draft.kind if draft else 'none'} -> none" if name == NO_SPEC else _changes(ctx.params, params))
    metrics = {**common, "variant": params.model_dump(mode="json"), "changed": changed}
    err = engine_error(table, "plan") or engine_error(table, name)
    if err:
        return SummaryRow(baseline=name, verdict="info", detail=f"not compared: {err}", metrics=metrics)
    pre, dec = compare(table, "plan", name, opts.n_boot, opts.seed)
    hurts = pre.outcome == "slower" and dec.outcome == "slower" and not common.get("busy")
    detail = (f"{metrics['changed']}: plan/variant prefill {pre.text()} ({pre.outcome}), decode {dec.text()} "
              f"({dec.outcome})" + (f"; {common['busy']}" if common.get("busy") else ""))
    return ratio_row(name, pre, dec, "fail" if hurts else "info", detail, metrics)


def _changes(plan: EngineParams, variant: EngineParams) -> str:
    a, b = plan.model_dump(), variant.model_dump()
    return ", ".join(f"{k} {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k])


def bench_ablate(ctx: BenchContext, opts: AblateOptions, progress: Progress | None = None) -> BenchRun:
    """Race the plan against each variant that undoes one of its choices; one row per variant."""
    found = variants(ctx.plan.candidate)
    on_server = ctx.plan.engine is not None and ctx.plan.engine.kind == "llama-server"
    specs = [server_spec(n, p) if on_server else EngineSpec(name=n, kind="worker", params=p, note=" ".join(p.cli_args()))
             for n, p in found.items() if isinstance(p, EngineParams)]  # each variant on the plan's own engine
    if ctx.plan.engine is not None and ctx.plan.engine.kind == "command":
        found[OTHER] = f"not measured: the plan's engine {ctx.plan.engine.name} is a configured command"
    elif ctx.llama_server is None:
        found[OTHER] = "not measured: llama-server is not built for this backend"
    else:
        other = other_engine(ctx, OTHER)
        found[OTHER] = ctx.params
        specs.append(other)
    if ctx.plan.candidate.draft is None:
        found[NO_SPEC] = "not chosen by the plan (it does not draft)"
    else:
        found[NO_SPEC] = ctx.params
        specs.append(no_drafting(ctx, NO_SPEC))
    lengths = prompt_lengths(ctx.params.n_ctx, opts.n_gen, opts.prompts)
    common: dict[str, Any] = {"options": opts.model_dump(mode="json"), "prompt_lengths": lengths,
                              "load_avg_start": load_avg(), "plan_engine": plan_engine(ctx).note}
    if not specs:
        rows = [SummaryRow(baseline=n, verdict="info", detail=str(why), metrics=common) for n, why in found.items()]
        return BenchRun(suite="ablate", ctx=ctx, rows=rows, raw=race([], ctx, [], opts.n_gen, 0))
    t0 = time.monotonic()
    prompts = tokenize_prompts(ctx, lengths, "held_out", opts.seed)
    table = race([plan_engine(ctx), *specs], ctx, prompts, opts.n_gen, opts.rounds, opts.seed, progress)
    common.update(seconds=time.monotonic() - t0, load_avg_end=load_avg(), busy=trial_busy(table))
    rows = [_row(n, p, ctx, table, opts, common) if isinstance(p, EngineParams)
            else SummaryRow(baseline=n, verdict="info", detail=p, metrics=common) for n, p in found.items()]
    return BenchRun(suite="ablate", ctx=ctx, rows=rows, raw=table)


SUITE = Suite(
    name="ablate", help="compare the full plan with variants that each undo one of its choices",
    description="Threads, n_ubatch, flash attention, load mode, KV offload, offload threshold, expert placement, "
                "engine, drafting: each choice the plan made differently from the default is undone in one variant "
                "(the engine's: the same placement on the other engine, llama-server or the native worker; "
                "drafting's: the plan decoding without its draft), raced in paired rounds; prints what each choice "
                "is worth.",
    options=AblateOptions, run=bench_ablate, flags=("rounds", "prompts", "n_gen", "seed"),
    help_text={"rounds": "paired rounds", "prompts": "corpus prompts per round", "n_gen": "tokens decoded per prompt"})
