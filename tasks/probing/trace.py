"""Route: how often the model's routers pick each expert on the planning workload (MoE models on a GPU machine).

``trace(...)`` counts the picks, ``profile(...) -> RoutingProfile`` (a record: :mod:`artifacts.records.routing`).
A worker prefills the workload's prompts (cut to :data:`TRACE_TOKENS` in all) and decodes a few tokens after
each, and llama.cpp's own router choices are counted per layer (:mod:`engine_bridge.routing_trace`). The counts decide which experts a per-expert placement keeps on the GPU;
the trace is stored as a table, and its id is part of every plan key it shaped: another workload (another
routing profile) is another plan.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from artifacts.engine_params import EngineParams
from artifacts.records.hardware import HardwareReport
from artifacts.records.routing import RoutingProfile
from engine_bridge import ops
from engine_bridge.client import HIDE_GPUS, WorkerClient
from engine_bridge.ops import RoutingCounts, RoutingRequest

TRACE_TOKENS = 2048  # prompt tokens traced in all: 2048 x 8 picks per layer is ~128 per expert of 128 (on the
# H200 host's CPU, 4096 tokens took 78 s, a first plan's largest fixed cost after the reference)
TRACE_GEN = 8


def trace_prompts(prompts: list[list[int]], budget: int = TRACE_TOKENS) -> list[list[int]]:
    """The workload's prompts, longest last, cut so that they hold ``budget`` tokens in all (at least one)."""
    out, left = [], budget
    for p in sorted(prompts, key=len):
        if left <= 0:
            break
        out.append(p[:left])
        left -= len(out[-1])
    return out or [prompts[0][:budget]]


# The fewest prompt tokens a trace is cut to for a small budget: 256 x 8 picks per layer still ranks a layer's
# busiest experts (what a per-expert placement keeps), if not its cold tail.
MIN_TRACE_TOKENS = 256


def trace_tokens(hw: HardwareReport | None, budget_s: float, share: float) -> int:
    """Prompt tokens to trace: TRACE_TOKENS, halved (down to MIN_TRACE_TOKENS) while the trace predicted from the
    probe's CPU kernels (a load, then the tokens at its prefill speed: the trace runs on the CPU) exceeds
    ``share`` of ``budget_s``; a routing trace scales with the budget as the measuring rounds do."""
    cpu = next((k for k in hw.kernels if k.device == "CPU"), None) if hw else None
    n = TRACE_TOKENS
    if cpu is None:
        return n
    while n > MIN_TRACE_TOKENS and ((cpu.load_ms or 0.0) + n * cpu.prefill_ms_per_token) / 1e3 > share * budget_s:
        n //= 2
    return n


def trace(model: Path, prompts: list[list[int]], params: EngineParams, log_path: Path,
          timeout_s: float, threads_file: Path | None = None, tokens: int = TRACE_TOKENS) -> RoutingCounts:
    """Count the router's picks of every layer over ``prompts`` cut to ``tokens`` in all (prefilled, then
    TRACE_GEN greedy tokens each); with ``threads_file``, the worker's threads follow it
    (:class:`tasks.cores.CoreShare`)."""
    cut = trace_prompts(prompts, tokens)
    req = RoutingRequest(model=str(model), params=params, prompts=tuple(tuple(p) for p in cut),
                         n_gen=TRACE_GEN, threads_file=str(threads_file) if threads_file else None)
    # On the CPU with the GPUs hidden (as the probe's CPU kernels): the router's picks do not depend on the
    # device, and a CUDA build's evaluation callback crashed the worker reading ids computed on the GPU.
    with WorkerClient(log_path=log_path, env={**params.environment(), **HIDE_GPUS}) as w:
        return w.request(ops.ROUTING_COUNTS, req, timeout_s)


def trace_params(n_ctx: int, threads: int) -> EngineParams:
    """The trace's configuration: the CPU, ``threads`` of it (the choices are the router's, not the placement's;
    a share of the cores beside the reference, :class:`tasks.cores.CoreShare`), CPU
    weights in llama.cpp's plain layout (``--no-repack``): the tracing worker died on the H200 host, whose CPU
    (with AMX) gives llama.cpp's extra buffer types a path the CPUs the trace was tested on do not take."""
    return EngineParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
                        repack=False)


def profile(counts: RoutingCounts, trace_id: str) -> RoutingProfile:
    """The planner's view of a stored trace."""
    repeat = float(np.median(counts.repeat_share())) if counts.pairs and sum(counts.pairs) else None
    return RoutingProfile(trace_id=trace_id, n_tokens=counts.n_tokens, n_expert_used=counts.n_expert_used,
                          counts=counts.counts, repeat=repeat)


class HotSummary(BaseModel):
    """What ``flux show`` says of a plan's routing and split."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    coverage: dict[str, float] = Field(description="share of picks in each layer's busiest 10/25/50% (median)")
    hot_experts: int = 0
    split_layers: int = 0
    hot_share: float = Field(0.0, description="share of all picks that hit a GPU copy")
