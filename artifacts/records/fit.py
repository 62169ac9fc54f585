"""A plan on the memory free now: a device with less free memory than the plan measured drops cached experts.

A per-expert plan keeps copies of its most-picked experts on a GPU (``EngineParams.expert_split``) while their
whole tensors stay on the host, so dropping copies is always safe: the dropped experts' picks run on the host,
slower but the same. When ``flux serve`` finds a device short of what the plan measured there, it drops the
least-routed copies until the shortfall is covered, and says how many and what that costs; when dropping them
all cannot cover it, it refuses the plan. Pure arithmetic: the caller reads free memory and the routing trace.
"""

from __future__ import annotations

import logging

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict

from artifacts.engine_params import EngineParams, ExpertSplit
from artifacts.model_info import ModelInfo, expert_bytes
from artifacts.records.errors import SplitShortfall
from artifacts.records.plan import Plan

log = logging.getLogger(__name__)
GIB = 2**30


class Dropped(BaseModel):
    """What serving gave up to fit: cached experts (their picks now run on the host)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    device: str
    free: int
    need: int
    experts: int
    of_experts: int
    bytes: int
    picks_moved: float  # share of all picks that move from the device's copies to the host
    host_picks_before: float
    host_picks_after: float

    def message(self) -> str:
        """The warning ``flux serve`` logs."""
        slower = self.host_picks_after / max(self.host_picks_before, 1e-9)
        return (f"{self.device} has {self.free / GIB:.2f} GiB free, the plan measured {self.need / GIB:.2f} GiB: dropped "
                f"{self.experts} of {self.of_experts} cached experts ({self.bytes / GIB:.2f} GiB, the least routed, "
                f"{self.picks_moved:.1%} of the picks); the host now computes {self.host_picks_after:.0%} of the expert "
                f"picks instead of {self.host_picks_before:.0%}, so each decode step's host expert work grows about "
                f"{slower:.2f}x; `flux plan --replan` measures a plan for this memory")


def device_need(plan: Plan, device: str) -> int:
    """Bytes the plan holds on ``device``: measured (NVML, its only GPU) or else predicted."""
    c = plan.candidate
    predicted = c.weights_bytes.get(device, 0) + c.kv_bytes.get(device, 0) + c.compute_bytes.get(device, 0)
    gpus = c.placement.gpus()
    return int(plan.measured.gpu_bytes) if plan.measured.gpu_bytes and gpus == {device} else predicted


def fit_split(plan: Plan, info: ModelInfo, free: dict[str, int], shares: NDArray[np.float64] | None) -> tuple[
        EngineParams, list[Dropped]]:
    """The plan's parameters with as few cached experts dropped as the devices' free memory requires.

    Args:
        free: free bytes of each device that holds expert copies (devices left out are not checked).
        shares: each expert's share of its layer's picks [n_layer, n_expert] (the plan's routing trace); without
            it, a layer's hot share is spread evenly over its copies.

    Raises:
        SplitShortfall: a device is short by more than its cached experts take.
    """
    params, split = plan.candidate.params, plan.candidate.params.expert_split
    dropped: list[Dropped] = []
    for device, have in sorted(free.items()):
        need = device_need(plan, device)
        if have >= need:
            continue
        cached = with_shares(_cached(info, split, device), shares, plan.candidate.hot_share)
        if split is None or sum(b for _, _, b, _ in cached) < need - have:
            raise SplitShortfall(plan, device, have, need, sum(b for _, _, b, _ in cached))
        order = sorted(cached, key=lambda x: x[3])  # least-routed first
        freed, gone, moved = 0, set(), 0.0
        for layer, expert, size, share in order:
            if freed >= need - have:
                break
            freed += size
            moved += share
            gone.add((layer, expert))
        before = 1.0 - sum(s for *_, s in cached) / max(1, info.n_layer)
        split = _without(split, gone)
        dropped.append(Dropped(device=device, free=have, need=need, experts=len(gone), of_experts=len(cached), bytes=freed,
                               picks_moved=moved / max(1, info.n_layer), host_picks_before=before,
                               host_picks_after=before + moved / max(1, info.n_layer)))
        params = params.model_copy(update={"expert_split": split})
    return params, dropped


def _cached(info: ModelInfo, split: ExpertSplit | None, device: str) -> list[tuple[int, int, int, float]]:
    """(layer, expert, bytes, share of the layer's picks) of every copy the split keeps on ``device``."""
    if split is None:
        return []
    per = expert_bytes(info)
    return [(h.layer, e, per[h.layer], 0.0) for h in split.layers if h.device == device for e in h.experts]


def with_shares(cached: list[tuple[int, int, int, float]], shares: NDArray[np.float64] | None,
                hot_share: list[float]) -> list[tuple[int, int, int, float]]:
    """The copies with their share of picks: from the trace, else the layer's hot share spread evenly."""
    per_layer: dict[int, int] = {}
    for layer, *_ in cached:
        per_layer[layer] = per_layer.get(layer, 0) + 1
    out = []
    for layer, expert, size, _ in cached:
        share = float(shares[layer, expert]) if shares is not None else (
            hot_share[layer] / per_layer[layer] if layer < len(hot_share) else 0.0)
        out.append((layer, expert, size, share))
    return out


def _without(split: ExpertSplit, gone: set[tuple[int, int]]) -> ExpertSplit | None:
    """The split less the ``gone`` (layer, expert) copies; None when nothing is left."""
    kept = {h.layer: [e for e in h.experts if (h.layer, e) not in gone] for h in split.layers}
    devices = {h.layer: h.device for h in split.layers}
    layers = [(i, ids) for i, ids in kept.items() if ids]
    if not layers:
        return None
    by_dev: dict[str, dict[int, list[int] | tuple[int, ...]]] = {}
    for i, ids in layers:
        by_dev.setdefault(devices[i], {})[i] = ids
    parts = [ExpertSplit.on(dev, hot).layers for dev, hot in by_dev.items()]
    return ExpertSplit(layers=tuple(sorted((h for p in parts for h in p), key=lambda h: h.layer)))
