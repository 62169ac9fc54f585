"""GPU memory a candidate will hold: the memory model's weights, KV cache and compute buffer, plus what it
does not model (the CUDA context, cuBLAS workspaces, the staging buffers the scheduler allocates to copy host
weights for offloaded micro-batches), learned from the probe's own loads on this machine.

The probe loads the model on each GPU it fits twice and reads each load's memory through NVML
(:func:`calibration_loads`): the whole model at a small micro-batch (its kernel timing), and — for a MoE
model — its experts on the host at a large micro-batch with op offload on, the shape of a hybrid finalist.
The residual of each (measured minus modelled) is the correction: ``base_bytes`` for every placement on the
GPU, plus ``offload_bytes`` for one whose host weights are copied to the GPU for large micro-batches. Without
a calibration (no GPU, an older probe) the fixed :data:`DEFAULT_MARGIN` stands in.
"""

from __future__ import annotations

from artifacts.model_info import ModelInfo
from artifacts.records.hardware import GpuMemoryFit, HardwareReport
from artifacts.records.search import Candidate
from engine_bridge.params import EngineParams, TensorOverride

GIB = 2**30
DEFAULT_MARGIN = GIB  # the old fixed margin: H200 finalists measured 0.3-0.9 GiB above the uncorrected model
DEFAULT_OFFLOAD_MIN_BATCH = 32
EXPERTS_ON_HOST = TensorOverride(pattern=r"\.ffn_(up|down|gate)_exps\.", device="CPU")
CALIBRATION_UBATCH = 2048  # the largest micro-batch the search tries


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


def correction(hw: HardwareReport | None, device: str, offloads: bool) -> int:
    """Bytes a GPU holds beyond the memory model's weights, KV cache and compute buffer."""
    fit = next((f for f in (hw.gpu_memory if hw else []) if f.device == device), None)
    if fit is None:
        return DEFAULT_MARGIN
    return max(0, fit.base_bytes + (fit.offload_bytes if offloads else 0))


def modelled(cand: Candidate, device: str) -> int:
    """The memory model's bytes of ``cand`` on ``device``: weights, KV cache, compute buffer."""
    return cand.weights_bytes.get(device, 0) + cand.kv_bytes.get(device, 0) + cand.compute_bytes.get(device, 0)


def predicted_gpu_bytes(cand: Candidate, hw: HardwareReport | None) -> dict[str, int]:
    """Per GPU the candidate uses: modelled bytes plus this machine's correction (an RPC server's devices are
    another machine's memory: not here)."""
    off = offloads_host_weights(cand.params, cand.weights_bytes)
    devices = {d for d in (*cand.weights_bytes, *cand.kv_bytes) if d != "CPU" and not d.startswith("RPC")}
    return {d: modelled(cand, d) + correction(hw, d, off) for d in sorted(devices)}


def calibration_loads(info: ModelInfo, base: EngineParams) -> list[tuple[str, EngineParams]]:
    """The probe's loads whose memory fits the correction: ("whole", ``base``) — the whole model on the GPU,
    as its kernels are timed — and, for a MoE model, ("offload", experts on the host at the largest
    micro-batch with op offload on)."""
    out = [("whole", base)]
    if info.is_moe:
        out.append(("offload", base.model_copy(update={
            "tensor_overrides": (EXPERTS_ON_HOST,), "n_ubatch": CALIBRATION_UBATCH, "n_batch": CALIBRATION_UBATCH,
            "op_offload": True, "no_host": False})))
    return out


def fit(device: str, residuals: dict[str, int]) -> GpuMemoryFit:
    """The correction from the probe's residuals (measured minus modelled) per calibration load."""
    base = residuals.get("whole", DEFAULT_MARGIN)
    offload = residuals.get("offload", base) - base
    return GpuMemoryFit(device=device, base_bytes=int(base), offload_bytes=int(max(0, offload)),
                        residuals={k: int(v) for k, v in residuals.items()})


def smallest_moe_budget(info: ModelInfo, n_ctx: int, n_seq: int, kv_type: str, hw: HardwareReport | None,
                        device: str = "CUDA0", n_gpus: int = 1) -> int:
    """The least GPU memory a MoE plan can use on each of ``n_gpus`` GPUs: every layer's non-expert weights and
    the output head and the KV cache of ``n_ctx`` x ``n_seq`` tokens (shared out over the GPUs' layer runs), a
    512-token micro-batch's compute buffer and this machine's correction (the experts can all stay on the
    host; these cannot, on the GPU path Flux plans)."""
    from tasks.costmodel import head_bytes
    from tasks.expert_hot import block_bytes

    kv = (info.kv_bytes_per_token.get(kv_type, 0) * n_ctx + info.recurrent_state_bytes) * n_seq
    return int((block_bytes(info) + head_bytes(info) + kv) / max(1, n_gpus) + compute_bytes(info, 512, n_ctx, True)
               + correction(hw, device, offloads=True))


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
