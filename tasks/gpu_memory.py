"""GPU memory a candidate will hold: the memory model's weights, KV cache and compute buffer, plus what it
does not model (the CUDA context, cuBLAS workspaces, the staging buffers the scheduler allocates to copy host
weights for offloaded micro-batches), learned from the probe's own loads on this machine.

The probe loads the model on each GPU it fits and reads each load's memory through NVML
(:func:`calibration_loads`): the whole model at a small micro-batch (its kernel timing), and — for a MoE
model — its experts on the host with op offload on, the shape of a hybrid finalist, at each micro-batch the
GPU search tries (:data:`HYBRID_UBATCHES`). The residual of each (measured minus modelled) is the correction:
``base_bytes`` for every placement on the GPU, plus, for one whose host weights are copied to the GPU for
large micro-batches, the offload load's extra at the candidate's own micro-batch (``offload_by_ubatch``;
``offload_bytes``, the largest, where that micro-batch was not calibrated); for a mapped per-expert split, its
own load's (``mapped_by_ubatch``). None of them is one figure: on the H200 (run 16) the qwen35moe twin's hybrid
loads at 256 and 512 read 0.13-0.16 GiB under its whole load's residual and its mapped splits 0.07 GiB over
it, so that splits filled to the budget by the whole load's residual measured over it. (Its "2,048" load read
1.8 GiB under: llama.cpp had capped that micro-batch at the probe's 512-token context; since run 17 each load's
context holds its micro-batch, :func:`holding`, and each is read after a run, as finalists are.) Without a
calibration (no GPU, an older probe) the fixed :data:`DEFAULT_MARGIN` stands in.
"""

from __future__ import annotations

from typing import Any

from artifacts.engine_params import EngineParams, ExpertSplit, TensorOverride
from artifacts.model_info import ModelInfo, block_bytes, expert_bytes, head_bytes, kv_cache_bytes
from artifacts.records.hardware import GpuMemoryFit, HardwareReport
from artifacts.records.search import Candidate

GIB = 2**30
DEFAULT_MARGIN = GIB  # the old fixed margin: H200 finalists measured 0.3-0.9 GiB above the uncorrected model
DEFAULT_OFFLOAD_MIN_BATCH = 32
EXPERTS_ON_HOST = TensorOverride(pattern=r"\.ffn_(up|down|gate)_exps\.", device="CPU")
CALIBRATION_UBATCH = 2048  # the largest micro-batch of the search's default grid
# the GPU search's default micro-batches (tasks.search.space); the larger prefill ones (tasks.prefill_ubatch: 4,096 and
# 8,192) are not loaded by the probe and take the largest calibrated extra (correction), their compute buffers modelled
HYBRID_UBATCHES = (256, 512, CALIBRATION_UBATCH)
SIZING_UBATCH = 512  # the micro-batch a GPU placement's expert share is sized at (tasks.search.space.gpu_overhead)
MAPPED_KEY = f"mapped@{SIZING_UBATCH}"
# each calibration load is read after one run of this many prompt tokens and generated ones, as the measure
# stage reads its finalists after their runs: memory a graph takes lazily (CUDA's pools, cuBLAS) counts too
CALIBRATION_PROMPT = 256
CALIBRATION_GEN = 8
FILL_HEADROOM = 64 * 2**20  # what a placement sized to the budget leaves free: NVML's per-process reading varies


def compute_bytes(info: ModelInfo, n_ubatch: int, n_ctx: int, flash_attn: bool) -> int:
    """Estimated compute buffer of one device: activations + logits of a micro-batch (+ scores without FA)."""
    act = n_ubatch * (4 * info.n_embd + 3 * max(info.n_embd * 4, 1)) * 4
    logits = n_ubatch * info.n_vocab * 4
    scores = 0 if flash_attn else n_ubatch * n_ctx * max(info.n_head, 1) * 4
    return int(act + logits + scores + 16 * 2**20)


def offloads_host_weights(p: EngineParams, weights_bytes: dict[str, int]) -> bool:
    """Whether llama.cpp copies host weights to a GPU for large micro-batches (op offload) under ``p``."""
    host = weights_bytes.get("CPU", 0)
    on_gpu = any(d != "CPU" and b for d, b in weights_bytes.items())
    threshold = p.offload_min_batch or DEFAULT_OFFLOAD_MIN_BATCH
    return bool(on_gpu and host and p.op_offload and not p.no_host and p.n_ubatch >= threshold)


def correction(hw: HardwareReport | None, device: str, offloads: bool, n_ubatch: int | None = None,
               mapped: bool = False) -> int:
    """Bytes a GPU holds beyond the memory model's weights, KV cache and compute buffer; for a placement that
    offloads host weights, at its micro-batch ``n_ubatch`` where the probe calibrated it (else the largest);
    for a mapped per-expert split (``EngineParams.expert_mapped``), the probe's mapped load's extra."""
    fit = next((f for f in (hw.gpu_memory if hw else []) if f.device == device), None)
    if fit is None:
        return DEFAULT_MARGIN
    if mapped and fit.mapped_by_ubatch:
        return max(0, fit.base_bytes + fit.mapped_by_ubatch.get(n_ubatch or 0, max(fit.mapped_by_ubatch.values())))
    extra = fit.offload_by_ubatch.get(n_ubatch, fit.offload_bytes) if n_ubatch is not None else fit.offload_bytes
    return max(0, fit.base_bytes + (extra if offloads else 0))


def modelled(cand: Candidate, device: str) -> int:
    """The memory model's bytes of ``cand`` on ``device``: weights, KV cache, compute buffer."""
    return cand.weights_bytes.get(device, 0) + cand.kv_bytes.get(device, 0) + cand.compute_bytes.get(device, 0)


def predicted_gpu_bytes(cand: Candidate, hw: HardwareReport | None) -> dict[str, int]:
    """Per GPU the candidate uses: modelled bytes plus this machine's correction (an RPC server's devices are
    another machine's memory: not here)."""
    off = offloads_host_weights(cand.params, cand.weights_bytes)
    devices = {d for d in (*cand.weights_bytes, *cand.kv_bytes) if d != "CPU" and not d.startswith("RPC")}
    return {d: modelled(cand, d) + correction(hw, d, off, cand.params.n_ubatch, cand.params.expert_mapped)
            for d in sorted(devices)}


def offload_key(n_ubatch: int) -> str:
    """A hybrid calibration load's name: ``offload`` at :data:`CALIBRATION_UBATCH` (as older probes named
    their one), ``offload@N`` at another micro-batch."""
    return "offload" if n_ubatch == CALIBRATION_UBATCH else f"offload@{n_ubatch}"


def offload_step(hw: HardwareReport | None) -> tuple[int, float] | None:
    """(prompt tokens, prefill ms per token) of the probe's read-out run of an offloading hybrid load (every routed
    expert on the host, the weights mapped from the file as the probe loads them) at the smallest micro-batch it
    calibrated: what a micro-batch that copies pageable host experts to the GPU costs on this machine. None
    from a probe made before the read-out runs."""
    for f in hw.gpu_memory if hw else []:
        for ub in HYBRID_UBATCHES:
            step = f.step_ms_by_load.get(offload_key(ub))
            if step and step[0] > 0:
                return CALIBRATION_PROMPT, step[0]
    return None


def calibration_loads(info: ModelInfo, base: EngineParams, device: str = "CUDA0") -> list[tuple[str, EngineParams]]:
    """The probe's loads whose memory fits the correction: ("whole", ``base``) — the whole model on the GPU,
    as its kernels are timed — and, for a MoE model, one per micro-batch of :data:`HYBRID_UBATCHES`
    (:func:`offload_key`): experts on the host with op offload on, the shape of a hybrid finalist; then
    (:data:`MAPPED_KEY`) a mapped per-expert split at :data:`SIZING_UBATCH`, half the experts of each layer
    copied to ``device``, in a worker of its own (the split is read from the environment). A mapped split's
    graph holds what neither the offload load nor a split of one expert per layer shows: on the H200 (run 16)
    the qwen35moe twin's splits filled to 12 and 8 GiB (53% and 29% of the experts copied) both read 0.81 GiB
    over the model, the offload load 0.58 and a one-expert split 0.51; the qwen3moe twin's 0.66, 0.59 and 0.52.
    A split of half the experts has the finalists' shape (the whole model fits this GPU, or it is not probed)."""
    out = [("whole", base)]
    if info.is_moe:
        hybrid: dict[str, Any] = {"tensor_overrides": (EXPERTS_ON_HOST,), "op_offload": True, "no_host": False}
        out += [(offload_key(ub), base.model_copy(update={**hybrid, **holding(base, ub)})) for ub in HYBRID_UBATCHES]
        half = list(range(max(1, info.n_expert // 2)))
        layers: dict[int, list[int] | tuple[int, ...]] = {i: half for i, b in enumerate(expert_bytes(info)) if b}
        if layers:
            out.append((MAPPED_KEY, base.model_copy(update={
                **hybrid, **holding(base, SIZING_UBATCH), "expert_mapped": True,
                "expert_split": ExpertSplit.on(device, layers)})))
    return out


def holding(base: EngineParams, n_ubatch: int) -> dict[str, int]:
    """A calibration load's micro-batch and a context that holds it and the probe's read-out run. llama.cpp
    caps a micro-batch at the context: the probe's 512-token context made every "2048" load a 512 one (runs 16
    and 17 read the same GiB at both), so the 2048 residual was the 512 load's against a 2048 compute buffer,
    and its extra fell to zero."""
    return {"n_ubatch": n_ubatch, "n_batch": n_ubatch,
            "n_ctx": max(base.n_ctx, n_ubatch, CALIBRATION_PROMPT + CALIBRATION_GEN + 8)}


def fit(device: str, residuals: dict[str, int],
        steps: dict[str, tuple[float, float]] | None = None) -> GpuMemoryFit:
    """The correction from the probe's residuals (measured minus modelled) per calibration load: the whole
    load's is the base; each hybrid load's excess over it, never below zero, is its micro-batch's extra."""
    base = residuals.get("whole", DEFAULT_MARGIN)
    extra = {ub: int(max(0, residuals[offload_key(ub)] - base)) for ub in HYBRID_UBATCHES
             if offload_key(ub) in residuals}
    # a mapped split's own residual, even below the base (the qwen3moe twin's split held 0.09 GiB under it)
    mapped = {SIZING_UBATCH: int(residuals[MAPPED_KEY] - base)} if MAPPED_KEY in residuals else {}
    return GpuMemoryFit(device=device, base_bytes=int(base), offload_bytes=max(extra.values(), default=0),
                        offload_by_ubatch=extra, mapped_by_ubatch=mapped,
                        residuals={k: int(v) for k, v in residuals.items()}, step_ms_by_load=steps or {})


def smallest_moe_budget(info: ModelInfo, n_ctx: int, n_seq: int, kv_type: str, hw: HardwareReport | None,
                        device: str = "CUDA0", n_gpus: int = 1) -> int:
    """The least GPU memory a MoE plan can use on each of ``n_gpus`` GPUs: every layer's non-expert weights and
    the output head and the KV cache of ``n_ctx`` x ``n_seq`` tokens (shared out over the GPUs' layer runs), a
    512-token micro-batch's compute buffer and this machine's correction (the experts can all stay on the
    host; these cannot, on the GPU path Flux plans)."""
    kv = kv_cache_bytes(info, kv_type, n_ctx, n_seq, SIZING_UBATCH) + info.recurrent_state_bytes * n_seq
    return int((block_bytes(info) + head_bytes(info) + kv) / max(1, n_gpus)
               + compute_bytes(info, SIZING_UBATCH, n_ctx, True) + correction(hw, device, True, SIZING_UBATCH))


def budget_problem(info: ModelInfo, budget: int, free: int, n_ctx: int, n_seq: int, kv_type: str,
                   hw: HardwareReport | None, device: str = "CUDA0", n_gpus: int = 1) -> tuple[str, str] | None:
    """(what is wrong, what to do) with a GPU memory budget, or None: more than the GPU has free, or (MoE
    models) less than their non-expert weights and KV cache; the fix names the budget that works."""
    if budget > free:
        return (f"--gpu-mem-budget {budget / GIB:.1f} GiB is more than {device}'s free memory ({free / GIB:.1f} GiB)",
                f"use --gpu-mem-budget {int(free // GIB * 10) / 10:g} or less")
    if info.is_moe:
        need = smallest_moe_budget(info, n_ctx, n_seq, kv_type, hw, device, n_gpus)
        if budget < need:
            return (f"--gpu-mem-budget {budget / GIB:.1f} GiB is less than the model's non-expert weights and its KV "
                    f"cache for {n_ctx} tokens x {n_seq} need on {device} ({need / GIB:.1f} GiB)",
                    f"use --gpu-mem-budget {(-(-need * 10 // GIB)) / 10:g} or more, or a smaller --ctx")
    return None
