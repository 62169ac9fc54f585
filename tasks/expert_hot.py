"""Per-expert placement: which experts get a GPU copy, chosen from the measured routing.

Every layer's attention block and the output head go to the GPU; the routed expert tensors stay whole on the
host; then the GPU takes copies of single experts, most-picked first across all layers, while the budget
lasts (the patched backend computes a split layer's hot picks on the GPU and the rest on the host:
patches/llama.cpp/README.md). All experts of a model are the same size, so taking them by pick share is the
knapsack's optimum by routing mass per byte. Under uniform routing a hot set holds little mass per byte and
the whole-tensor placements of :mod:`tasks.expert_select` win; measurement decides between them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from artifacts.engine_params import ExpertSplit
from artifacts.model_info import ModelInfo, block_bytes, expert_bytes
from artifacts.records.search import Placement
from tasks.costmodel import EXPERT_PARTS, head_bytes


@dataclass(frozen=True)
class HotPlacement:
    """A placement with a per-expert split and the share of each layer's picks its GPU copies take."""

    placement: Placement
    split: ExpertSplit
    hot_share: tuple[float, ...]
    hot_bytes: int


def hot_placement(info: ModelInfo, shares: NDArray[np.float64], budget: int, device: str = "CUDA0",
                  max_share: float = 1.0, cover_layers: bool = False) -> HotPlacement | None:
    """Blocks and head on ``device``, whole expert tensors on the host, and GPU copies of the most-picked
    experts within ``budget`` bytes (until ``max_share`` of all picks is covered); None when nothing fits.

    Args:
        shares: each expert's share of its layer's picks, [n_layer, n_expert] (rows sum to 1).
        cover_layers: each layer's most-picked expert first, so every layer is split (a split whose cold
            experts the GPU reads from host memory has no host layer left: ``EngineParams.expert_mapped``).
    """
    if not info.is_moe or shares.shape != (info.n_layer, info.n_expert):
        return None
    room = budget - block_bytes(info) - head_bytes(info)
    per = expert_bytes(info)
    if room <= 0 or not min(per):
        return None
    order = np.argsort(-shares, axis=None, kind="stable")
    if cover_layers:  # each layer's top expert, then the rest by share
        tops = np.argmax(shares, axis=1) + np.arange(info.n_layer) * info.n_expert
        order = np.concatenate([tops[np.argsort(-shares.max(axis=1), kind="stable")],
                                order[~np.isin(order, tops)]])
    hot: dict[int, list[int] | tuple[int, ...]] = {}
    used, covered, total = 0, 0.0, float(shares.sum())
    for flat in order:
        layer, expert = divmod(int(flat), info.n_expert)
        if used + per[layer] > room or covered >= max_share * total:
            break
        hot[layer] = [*hot.get(layer, ()), expert]
        used += per[layer]
        covered += float(shares[layer, expert])
    if not hot:
        return None
    split = ExpertSplit.on(device, hot)
    hot_share = tuple(float(shares[i, list(hot[i])].sum()) if i in hot else 0.0 for i in range(info.n_layer))
    placement = Placement(layer_device=[device] * info.n_layer,
                          expert_device=[dict.fromkeys(EXPERT_PARTS, "CPU") for _ in range(info.n_layer)],
                          output_device=device)
    return HotPlacement(placement=placement, split=split, hot_share=hot_share, hot_bytes=used)


def split_bytes(info: ModelInfo, split: ExpertSplit | None) -> dict[str, int]:
    """Bytes of the GPU copies a split holds, per device."""
    if split is None:
        return {}
    per = expert_bytes(info)
    out: dict[str, int] = {}
    for h in split.layers:
        out[h.device] = out.get(h.device, 0) + per[h.layer] * len(h.experts)
    return out


def mapped_bytes(info: ModelInfo, split: ExpertSplit | None) -> int:
    """Host bytes of the cold experts' copies in pinned memory that a mapped split adds (EngineParams.expert_mapped)."""
    if split is None:
        return 0
    per = expert_bytes(info)
    return sum(per[h.layer] * max(0, info.n_expert - len(h.experts)) for h in split.layers)
