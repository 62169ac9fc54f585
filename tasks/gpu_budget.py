"""The GPUs a plan may use and how much of each: llama.cpp's devices with their free memory, and the budget
``--gpu-mem-budget`` gives each (one value per GPU; the last repeats for the rest)."""

from __future__ import annotations

from artifacts.model_info import ModelInfo, kv_cache_bytes
from artifacts.records.hardware import HardwareReport
from artifacts.records.plan import PlanRequest
from tasks.errors import ImpossiblePlan, NeedsStorageStreaming
from tasks.gpu_memory import budget_problem, compute_bytes
from tasks.streaming import whole_model_streaming

GIB = 2**30


def _budget_gib(budgets: list[float], i: int) -> float | None:
    """GPU ``i``'s budget in GiB: its own value, else the last one given, else none."""
    return budgets[i] if i < len(budgets) else (budgets[-1] if budgets else None)


def gpu_devices(hw: HardwareReport) -> list[tuple[str, int]]:
    """(ggml device name, free bytes) of each GPU llama.cpp can use, in its own CUDA order.

    NVML lists every GPU of the host; llama.cpp sees only those CUDA_VISIBLE_DEVICES leaves, numbered
    from CUDA0. Placements name ggml devices, so the ggml list decides (on the H200 machine NVML saw two
    GPUs while llama.cpp had one: budgeting the NVML list put a second GPU's share on the first).
    """
    out = []
    for d in hw.ggml_devices:
        if d.get("kind") == "gpu":
            free = d.get("memory_free")
            out.append((str(d["name"]), int(free) if isinstance(free, int) else 0))
    if any(free == 0 for _, free in out):  # a probe without ggml memory figures: fall back to NVML's
        out = [(name, hw.gpus[i].memory_free if i < len(hw.gpus) else 0) for i, (name, _) in enumerate(out)]
    return out


def check_gpu_budgets(info: ModelInfo, hw: HardwareReport, req: PlanRequest, n_ctx: int) -> None:
    """Refuse a ``--gpu-mem-budget`` no plan can use (:func:`tasks.gpu_memory.budget_problem`), in one line."""
    budgets = req.gpu_mem_budget_gib or []
    devices = gpu_devices(hw)
    for i, (name, free) in enumerate(devices):
        b = _budget_gib(budgets, i)
        problem = budget_problem(info, int(b * GIB), free, n_ctx, req.concurrency, req.kv, hw, name,
                                 len(devices)) if b else None
        if problem:
            raise ImpossiblePlan(*problem)


def budget_notes(hw: HardwareReport, req: PlanRequest) -> list[str]:
    """A note when ``--gpu-mem-budget`` names more GPUs than llama.cpp sees here (none, on a machine without
    one): those values are not used."""
    budgets, n = req.gpu_mem_budget_gib or [], len(gpu_devices(hw))
    if len(budgets) <= n:
        return []
    given = ",".join(f"{b:g}" for b in budgets)
    if not n:
        return [f"--gpu-mem-budget {given}: llama.cpp sees no GPU on this machine, so the plan runs on the CPU "
                "and the budget is not used"]
    return [f"--gpu-mem-budget {given} names {len(budgets)} GPUs and llama.cpp sees {n}: only the first {n} "
            "value(s) are used"]


def gpu_limits(hw: HardwareReport, req: PlanRequest) -> list[int]:
    """Bytes each GPU llama.cpp sees may hold: its budget (``--gpu-mem-budget``), at most its free memory."""
    budgets = req.gpu_mem_budget_gib or []
    out = []
    for i, (_, free) in enumerate(gpu_devices(hw)):
        b = _budget_gib(budgets, i)
        out.append(int(min(free, b * GIB)) if b is not None else free)
    return out


def no_placement_fits(info: ModelInfo, req: PlanRequest, rejected: dict[str, int], limits: dict[str, int],
                      n_ctx: int, hw: HardwareReport) -> ImpossiblePlan:
    """The refusal when no candidate fits: the weights beyond RAM (with the decode limit reading the rest from the
    drive would set, :mod:`tasks.streaming`), else every limit against what they hold."""
    kv = kv_cache_bytes(info, req.kv, n_ctx, req.concurrency)
    host = limits["CPU"]
    # the CPU's least compute buffer (its smallest micro-batch, flash attention): beside the KV cache it fits and
    # the weights do not, not even with the other devices' (GPUs', RPC servers') room, so mapping them would fit
    beside = kv + compute_bytes(info, 128, n_ctx, True)
    elsewhere = sum(b for d, b in limits.items() if d != "CPU")
    if not req.allow_storage_streaming and beside <= host < info.weight_bytes + beside - elsewhere:
        return NeedsStorageStreaming(info.weight_bytes, host, whole_model_streaming(info, hw, host, beside))
    return ImpossiblePlan(
        f"no placement fits: weights {info.weight_bytes / GIB:.2f} GiB + KV {kv / GIB:.2f} GiB "
        f"(ctx {n_ctx} x {req.concurrency}) vs limits " +
        ", ".join(f"{d} {b / GIB:.1f} GiB" for d, b in limits.items()) + f" ({rejected})",
        "lower --ctx or --concurrency, or use --kv q8_0")
