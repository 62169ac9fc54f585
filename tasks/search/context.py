"""The context a plan holds (issue 53's "flux plan caps the context only when RAM cannot hold it"): the host
budget, the trained context or the asked one, capped by what RAM holds beside the weights, and the one line said
when it is capped. :mod:`tasks.search.space` sizes its candidates at it."""

from __future__ import annotations

from artifacts.model_info import ModelInfo, kv_cache_bytes
from artifacts.records.hardware import HardwareReport
from artifacts.records.plan import PlanRequest
from tasks.errors import ImpossiblePlan, NeedsStorageStreaming
from tasks.gpu_memory import compute_bytes
from tasks.streaming import whole_model_streaming

GIB = 2**30
# with --allow-storage-streaming, the share of the host budget the weights keep as page cache when they exceed it
# (a default context's KV cache takes at most the rest)
STREAMING_PAGE_SHARE = 0.75


def host_budget(hw: HardwareReport, reserve_percent: float) -> int:
    """Host bytes Flux may use: available RAM minus the host reserve."""
    return int(min(hw.ram_available, hw.ram_total * (1 - reserve_percent / 100)))


def plan_host_budget(hw: HardwareReport, req: PlanRequest, reserve_percent: float) -> int:
    """Host bytes this plan may use: :func:`host_budget`, at most ``--host-mem-budget``."""
    host = host_budget(hw, reserve_percent)
    return min(host, int(req.host_mem_budget_gib * GIB)) if req.host_mem_budget_gib is not None else host


def resolve_context(info: ModelInfo, hw: HardwareReport, req: PlanRequest, reserve_percent: float) -> tuple[int, bool]:
    """Tokens per sequence: the request, else the trained context capped by what RAM can hold. Weights beyond RAM
    are refused with their decode limit from the drive, or with ``--allow-storage-streaming`` keep at most
    STREAMING_PAGE_SHARE of the budget as page cache (the KV cache is sized from the rest)."""
    trained = info.n_ctx_train or 4096
    host = plan_host_budget(hw, req, reserve_percent)
    # compute buffers and a hybrid's fixed state, whatever the context
    fixed = compute_bytes(info, 512, 4096, True) + info.recurrent_state_bytes * req.concurrency
    least = fixed + kv_cache_bytes(info, req.kv, 256, req.concurrency)
    resident = info.weight_bytes
    if req.ctx is None and resident + least > host:
        if not req.allow_storage_streaming:
            raise NeedsStorageStreaming(info.weight_bytes, host, whole_model_streaming(info, hw, host, least))
        resident = max(0, min(resident, int(host * STREAMING_PAGE_SHARE), host - least))
    room = host - resident - fixed
    if req.ctx is not None:
        if req.ctx > trained:
            raise ImpossiblePlan(f"--ctx {req.ctx} exceeds the model's trained context {trained}",
                                 f"use --ctx {trained} or less")
        return req.ctx, False
    kv_trained = kv_cache_bytes(info, req.kv, trained, req.concurrency)
    if kv_trained <= room:
        return trained, False
    # past their window the sliding-window layers' cache stops growing: each token costs the full layers' bytes
    full_tok = (info.kv_bytes_per_token[req.kv] - info.swa_kv_bytes_per_token.get(req.kv, 0)) * req.concurrency
    fit = max(0, (room - (kv_trained - full_tok * trained)) // max(full_tok, 1))
    if fit < 256:
        need = (info.weight_bytes + kv_cache_bytes(info, req.kv, 256, req.concurrency)) / GIB
        raise ImpossiblePlan(f"RAM cannot hold the weights plus a 256-token KV cache (needs {need:.1f} GiB, "
                             f"{host / GIB:.1f} GiB usable)",
                             "lower host_reserve_percent, use a smaller quant, or --allow-storage-streaming")
    return int(fit // 256 * 256), True


def context_cap_line(info: ModelInfo, hw: HardwareReport, req: PlanRequest, reserve_percent: float, n_ctx: int) -> str:
    """The one line `flux plan` says when RAM cannot hold the trained context's KV cache (:func:`resolve_context`
    capped it at ``n_ctx``)."""
    trained = info.n_ctx_train or 4096
    need = kv_cache_bytes(info, req.kv, trained, req.concurrency)
    room = plan_host_budget(hw, req, reserve_percent) - info.weight_bytes
    return (f"context capped at {n_ctx} tokens per sequence, not the trained {trained}: its {req.kv} KV cache for "
            f"{req.concurrency} sequence(s) needs {need / GIB:.2f} GiB and RAM holds {max(0, room) / GIB:.2f} GiB "
            f"beside the weights (the {reserve_percent:g}% host reserve kept); more free RAM, a lower "
            "host_reserve_percent or a smaller --kv type plans the trained context")
