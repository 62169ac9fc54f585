"""KV windows (patch 0009, ``EngineParams.kv_vram_cells``): a plan for the model's whole context whose KV cache keeps
only each attention layer's first cells in VRAM, the rest in pinned host memory the GPU reads in place.

The window is a searched dimension: each of :data:`WINDOWS` shorter than the context is tried on the GPU
placements sized for a cache of the window's length, so a trained-context plan gets the expert copies of a
window-length one, and a conversation longer than the window reads its older cells over the bus.
"""

from __future__ import annotations

from artifacts.model_info import ModelInfo, kv_cache_bytes

# the windows tried, largest first (65,536 cells: the default a conversation that long runs at full speed in)
WINDOWS = (65536, 32768)


def windows(n_ctx: int, n_gpus: int) -> list[int]:
    """The windows a plan holding ``n_ctx`` tokens per sequence tries: each of :data:`WINDOWS` below it, with GPUs."""
    return [w for w in WINDOWS if w < n_ctx] if n_gpus else []


def window_cells(window: int, n_ctx: int, n_seq: int) -> tuple[int, int]:
    """(cells per sequence in VRAM, sequences they serve): a window splits one cache, unified when several
    sequences share it, so the window's cells serve them all."""
    return min(window, n_ctx * n_seq), 1


def concat_bytes(info: ModelInfo, kv_type: str, n_ctx: int, window: int, n_seq: int) -> int:
    """Compute-buffer bytes the attention holds past the window: one KV layer's K and V for every cell after it,
    concatenated on the GPU with the window's (the graph allocator reuses the buffer from layer to layer)."""
    past = max(0, n_ctx * n_seq - window)
    return int(kv_cache_bytes(info, kv_type, past, 1) / max(1, info.n_kv_layers or info.n_layer))
