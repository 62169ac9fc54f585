"""The KV cache and recurrent state one decoded token moves, by where it is read from (the cost model's traffic
terms, :mod:`tasks.costmodel`): the host, a GPU, or the bus between them (a KV window's cells past the window,
patch 0009, which the GPU reads from pinned host memory)."""

from __future__ import annotations

from artifacts.model_info import ModelInfo, kv_cache_bytes, kv_read_bytes
from artifacts.records.search import Candidate


def kv_reads(info: ModelInfo, cand: Candidate, depth: float) -> tuple[float, float]:
    """(host, GPU) bytes of KV cache one decoded token reads at ``depth`` tokens of context.

    Each sequence reads its own cells: a device's share of the KV cache in proportion to the cells it holds at
    that depth (a sliding-window layer's at most its window-sized cache). A candidate without a per-device KV
    budget (hand-made) reads it where its layers are. With a KV window (``kv_vram_cells``) the GPU reads the
    cells up to the window from VRAM; those past it are read over the bus (:func:`kv_bus_reads`), not here.
    """
    p = cand.params
    if p.kv_vram_cells and cand.kv_bytes:
        per_tok = kv_read_bytes(info, p.type_k, min(depth, p.n_ctx, p.kv_vram_cells), p.n_ubatch)
        share = _window_gpu_share(info, cand)
        return (1.0 - share) * kv_read_bytes(info, p.type_k, min(depth, p.n_ctx), p.n_ubatch), share * per_tok
    if not cand.kv_bytes:
        per_tok = kv_read_bytes(info, p.type_k, depth, p.n_ubatch)
        on_cpu = not any(d != "CPU" for d in cand.placement.layer_device) or not p.offload_kqv
        return (per_tok, 0.0) if on_cpu else (0.0, per_tok)
    scale = min(depth, p.n_ctx) / (p.n_ctx * max(1, p.n_seq_max))
    if info.n_swa:
        scale = kv_read_bytes(info, p.type_k, min(depth, p.n_ctx), p.n_ubatch) / max(1, kv_cache_bytes(
            info, p.type_k, p.n_ctx, max(1, p.n_seq_max), p.n_ubatch))
    cpu = cand.kv_bytes.get("CPU", 0) * scale
    return cpu, sum(b for d, b in cand.kv_bytes.items() if d != "CPU") * scale


def _window_gpu_share(info: ModelInfo, cand: Candidate) -> float:
    """Share of a windowed cache's layers whose window is on a GPU (the rest keep every cell on the host): the
    GPUs' KV bytes over the window's bytes of every layer."""
    p = cand.params
    whole = kv_cache_bytes(info, p.type_k, min(p.kv_vram_cells or p.n_ctx, p.n_ctx * max(1, p.n_seq_max)), 1,
                           p.n_ubatch) + info.recurrent_state_bytes
    gpu = sum(b for d, b in cand.kv_bytes.items() if d != "CPU")
    return min(1.0, gpu / whole) if whole else 0.0


def kv_bus_reads(info: ModelInfo, cand: Candidate, depth: float) -> float:
    """KV bytes one decoded token at ``depth`` reads over the bus: with a KV window (patch 0009), every cell past
    the window lives in pinned host memory only, and the GPU's attention reads those cells from there each step
    (concatenated with the window's); none below the window, none without one."""
    p = cand.params
    w = p.kv_vram_cells
    if not w or not cand.kv_bytes or depth <= w:
        return 0.0
    past = kv_read_bytes(info, p.type_k, min(depth, p.n_ctx), p.n_ubatch) - kv_read_bytes(info, p.type_k, w, p.n_ubatch)
    return _window_gpu_share(info, cand) * max(0.0, past)


def state_reads(info: ModelInfo, cand: Candidate) -> tuple[float, float]:
    """(host, GPU) bytes of recurrent state one decoded token moves (hybrid models: each recurrent layer reads its
    fixed-size state and writes it back, whatever the depth). The state lives with the layer's cache: on the
    layer's device when the cache is offloaded, else on the host; spread evenly over the layers' devices."""
    if not info.recurrent_state_bytes:
        return 0.0, 0.0
    moved = 2.0 * info.recurrent_state_bytes
    devs = cand.placement.layer_device
    on_gpu = sum(1 for d in devs if d != "CPU") / max(1, len(devs)) if cand.params.offload_kqv else 0.0
    return moved * (1.0 - on_gpu), moved * on_gpu
