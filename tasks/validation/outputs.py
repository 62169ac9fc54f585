"""Reference: what the quality gate compares finalists with, computed once per model, machine and build.

``reference(...) -> ReferenceOutputs``. The validation sequences (agent conversations and held-out prompts,
each cut to :data:`tasks.workload.VALIDATION_CAP` tokens) get the reference's greedy continuation and its
log-probabilities of it. The reference is the plainest correct configuration that holds the whole model on
one device (:func:`reference_placement`: a GPU that holds it, else the CPU in llama.cpp's plain layout;
f16 KV, no flash attention); the noise-floor variants (other correct kernels: the CPU, its repacked layout,
flash attention, another micro-batch, the GPU) score the first :data:`FLOOR_SEQUENCES` sequences
too. The gate's limits come from that floor.

It runs before measurement, so a finalist's measuring visit can score the same continuations while it is
loaded (:func:`tasks.validation.gate.score_loaded`) and validation needs no load of its own. Results live in the
cache directory under keys of everything they depend on; a second plan of the model (another budget or
context) reuses them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from artifacts.engine_params import EngineParams
from artifacts.ids import content_id
from artifacts.model_info import ModelInfo
from artifacts.records.hardware import HardwareReport
from tasks.cores import CoreShare
from tasks.quality_gate import FloorResult, Gate
from tasks.validation.gate import (
    Cache,
    floor_results,
    reference_continuations,
    reference_params,
    validation_context,
)

GIB = 2**30
FLOOR_GPU_HEADROOM = 2 * GIB  # KV cache, compute buffers and the CUDA context of a GPU variant
# Sequences the noise floor's variants score (the first ones: agent conversations): a floor is a statistic
# of correct kernels, and on a big model each CPU variant pays a pass over what it scores.
FLOOR_SEQUENCES = 5
Progress = Callable[[str], None]


class ReferenceOutputs(BaseModel):
    """The reference's sequences and where its outputs are cached, with the floor and the gate's limits."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    prompts: list[list[int]]
    held_out: list[list[int]]
    continuations: list[list[int]]
    cache_dir: str
    reference_key: str
    floor_key: str
    reference: EngineParams
    floor: list[FloorResult]
    kl_limit: float
    top1_limit: float
    computed: bool
    seconds: float
    device: str

    @property
    def cache(self) -> Cache:
        """Where the reference's log-probabilities are kept."""
        return Cache(Path(self.cache_dir), self.reference_key, self.floor_key)

    def seqs(self) -> list[tuple[list[int], list[int]]]:
        """(prompt, continuation) pairs every scorer scores."""
        return list(zip(self.prompts, self.continuations, strict=True))


def _gpus(hw: HardwareReport) -> list[tuple[str, int]]:
    from tasks.gpu_budget import gpu_devices

    return gpu_devices(hw)


def _whole_on_gpu(info: ModelInfo, hw: HardwareReport) -> int | None:
    """Index (llama.cpp's order) of the first GPU whose free memory holds the whole model, if any."""
    for i, (_, free) in enumerate(_gpus(hw)):
        if info.file_bytes + FLOOR_GPU_HEADROOM <= free:
            return i
    return None


def reference_placement(info: ModelInfo, hw: HardwareReport, n_ctx: int, threads: int, seed: int) -> EngineParams:
    """The reference: the plainest correct configuration that holds the whole model on one device — a GPU
    whose free memory holds it (every layer there, f16 KV, no flash attention: seconds instead of minutes
    on a big model), else the CPU (:func:`tasks.validation.gate.reference_params`)."""
    cpu = reference_params(n_ctx, threads, seed)
    k = _whole_on_gpu(info, hw)
    if k is None:
        return cpu
    n = len(_gpus(hw))
    return cpu.model_copy(update={"n_gpu_layers": -1, "main_gpu": k, "split_mode": "none",
                                  "tensor_split": tuple(1.0 if j == k else 0.0 for j in range(n)) if n > 1 else None})


def device_of(ref: EngineParams, hw: HardwareReport) -> str:
    """The ggml device the reference computes on."""
    gpus = _gpus(hw)
    return "CPU" if ref.n_gpu_layers == 0 else (gpus[ref.main_gpu][0] if ref.main_gpu < len(gpus) else "GPU")


def floor_variants(info: ModelInfo, hw: HardwareReport, ref: EngineParams,
                   cpu_threads: int | None = None) -> list[tuple[str, EngineParams]]:
    """Correct variants of the reference whose differences from it are the noise floor on this machine.

    With the reference on a GPU: the CPU in its plain layout (what hybrid placements compute on the host)
    with flash attention and another micro-batch, and the GPU with flash attention and another micro-batch.
    The CPU's repacked layout is left out there: on the H200 it measured the same floor as the plain one
    (3.84e-4 vs 3.86e-4 mean KL) and cost a 47 s pass; repacked vs plain differ by ~1e-6 on the twins.
    With the reference on the CPU: the repacked layout (what CPU-only plans load) with flash attention and
    another micro-batch, and with a GPU the last layers computed on it (as many as fit). ``cpu_threads``: the
    CPU variants' threads at load when another stage shares the cores (default: the reference's).
    """
    cpu_ref = reference_params(ref.n_ctx, cpu_threads or ref.n_threads, ref.seed)
    repacked = ("CPU, repacked layout, flash attention, n_ubatch 64", cpu_ref.model_copy(update={
        "flash_attn": True, "n_ubatch": 64, "n_batch": 64, "repack": True}))
    gpus = _gpus(hw)
    if ref.n_gpu_layers != 0:
        gpu = (f"{device_of(ref, hw)}, flash attention, n_ubatch 64",
               ref.model_copy(update={"flash_attn": True, "n_ubatch": 64, "n_batch": 64}))
        plain = ("CPU, plain layout, flash attention, n_ubatch 64", cpu_ref.model_copy(update={
            "flash_attn": True, "n_ubatch": 64, "n_batch": 64}))
        return [plain, gpu]
    out = [repacked]
    if gpus:
        free = gpus[0][1] - FLOOR_GPU_HEADROOM
        per_layer = max(1, max(layer.total_bytes for layer in info.layers))
        n = int(min(info.n_layer + 1, max(0, free // per_layer)))
        if n:
            out.append((f"{gpus[0][0]}, the last {n - 1} layers, flash attention", ref.model_copy(update={
                "n_gpu_layers": n, "flash_attn": True,
                "tensor_split": (1.0,) + (0.0,) * (len(gpus) - 1) if len(gpus) > 1 else None})))
    return out


def reference(model: Path, info: ModelInfo, hw: HardwareReport, prompts: list[list[int]], held_out: list[list[int]],
              *, n_tokens: int, seed: int, gate: Gate, keys: dict[str, str], cache_dir: Path, log_path: Path,
              timeout_s: float, progress: Progress, cores: CoreShare | None = None,
              floor_sequences: int = FLOOR_SEQUENCES) -> ReferenceOutputs:
    """The reference's continuations and outputs, and the floor (from the cache when there).

    Args:
        prompts: validation prompts (agent conversations + held-out prompts), tokenized.
        held_out: the held-out prompts, timed again on each validated finalist.
        keys: what the results depend on besides the prompts (model, code, build).
        cache_dir: where results are kept across plans.
        cores: the cores this stage shares with another that runs beside it (the routing trace): the CPU floor
            variants' threads follow it.
        floor_sequences: how many of the sequences the noise floor's variants score (fewer for a small budget).
    """
    t0 = time.monotonic()
    ref = reference_placement(info, hw, validation_context(prompts, n_tokens), hw.cpu.physical_cores, seed)
    variants = floor_variants(info, hw, ref, max(1, hw.cpu.physical_cores // 2) if cores else None)
    ref_key = content_id({**keys, "prompts": prompts, "n_tokens": n_tokens, "hardware": hw.fingerprint,
                          "reference": ref.model_dump(exclude={"n_threads", "n_threads_batch"})})
    cache = Cache(cache_dir, ref_key, content_id({"reference": ref_key, "sequences": floor_sequences, "variants": [
        (n, p.model_dump(exclude={"n_threads", "n_threads_batch"})) for n, p in variants]}))
    computed = not (cache.reference().exists() and cache.floor().exists())
    # while it computes, the stage shares the host's cores (its loads, the CPU floor) with the routing trace
    with cores.busy("reference", hw.cpu.physical_cores) if cores and computed else nullcontext() as share:
        seqs, ref_lps = reference_continuations(model, ref, prompts, n_tokens, log_path, timeout_s, cache,
                                                threads_file=share.path if share else None)
        floor = floor_results(model, variants, seqs[:floor_sequences], ref_lps[:floor_sequences], log_path,
                              timeout_s, cache, progress, share.path if share else None)
    kl, top1 = gate.limits(floor)
    return ReferenceOutputs(prompts=prompts, held_out=held_out, continuations=[c for _, c in seqs],
                            cache_dir=str(cache_dir), reference_key=ref_key, floor_key=cache.floor_key, reference=ref,
                            floor=floor, kl_limit=kl, top1_limit=top1, computed=computed,
                            seconds=time.monotonic() - t0, device=device_of(ref, hw))


def predicted_seconds(info: ModelInfo, hw: HardwareReport, n_seqs: int, cap: int, n_tokens: int,
                      floor_sequences: int) -> float:
    """Seconds the reference and its noise floor are predicted to take from the probe's whole-model kernels:
    each configuration's load, the reference's prefill of ``n_seqs`` prompts of up to ``cap`` tokens and its
    ``n_tokens`` greedy tokens each, and every floor variant's pass over ``floor_sequences`` of them (a
    configuration with any layer on the host at the CPU's speed). An upper estimate: the floor's GPU lane runs
    beside its host lane."""
    ref = reference_placement(info, hw, cap + n_tokens + 8, hw.cpu.physical_cores, 0)

    def cost(p: EngineParams, prefill: int, decode: int) -> float:
        on_gpu = p.n_gpu_layers < 0 or p.n_gpu_layers > info.n_layer
        k = next((k for k in hw.kernels if (k.device != "CPU") == on_gpu), None)
        k = k or next((k for k in hw.kernels if k.device == "CPU"), None)
        if k is None:
            return 0.0
        return ((k.load_ms or 0.0) + prefill * k.prefill_ms_per_token + decode * k.decode_ms_per_token) / 1e3

    floor = sum(cost(p, floor_sequences * (cap + n_tokens), 0) for _, p in floor_variants(info, hw, ref))
    return cost(ref, n_seqs * cap, n_seqs * n_tokens) + floor
