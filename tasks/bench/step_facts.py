"""The headline numbers of a hybrid decode step's anatomy (patches/llama.cpp/README.md), for the GPU record's rows.

The anatomy (scripts/gpu_anatomy.py, a diagnosis) says where a split step's time goes: the share of the expert
picks that run on GPU copies, how many layers pay a host round trip per step, and the step against the whole model
on the GPU. A record row carries the same figures for the plan it raced, from the plan itself
(:func:`step_facts`) and its race (:func:`step_times`); rows made before these columns existed get them from the
``flux show`` log saved beside them (:func:`step_facts_from_show`).
"""

from __future__ import annotations

import re
from typing import Any

from artifacts.records.search import Candidate


def step_facts(cand: Candidate) -> dict[str, Any]:
    """The plan's step: per-expert split or not, experts copied and their share of the traced picks, and the host
    round trips a decode step pays (a host split's every split layer; a mapped split none, its GPU reads the cold
    experts in place; a layer placement each hand-over between the GPU and the host along its layers)."""
    split = cand.params.expert_split
    devices = [*cand.placement.layer_device, cand.placement.output_device]
    hand_overs = sum(1 for a, b in zip(devices, devices[1:], strict=False) if (a == "CPU") != (b == "CPU"))
    trips = (hand_overs + 1) // 2 + sum(  # a layer on the GPU with experts on the host: down and up again
        1 for d, ex in zip(devices, cand.placement.expert_device, strict=False)
        if d != "CPU" and any(v == "CPU" for v in ex.values()))
    if split is None:
        return {"expert_path": None, "split_layers": 0, "experts_copied": 0, "hot_pick_share": None,
                "expert_cache": None, "host_round_trips": trips}
    mapped = cand.params.expert_mapped
    return {"expert_path": "mapped" if mapped else "host", "split_layers": len(split.layers),
            "experts_copied": sum(len(h.experts) for h in split.layers),
            "hot_pick_share": sum(cand.hot_share) / len(cand.hot_share) if cand.hot_share else None,
            "expert_cache": cand.params.expert_cache, "host_round_trips": 0 if mapped else len(split.layers)}


def step_times(served_decode_tps: float | None, all_gpu_decode_tps: float | None) -> dict[str, Any]:
    """The served step in ms, the whole model's on the GPU (the probe's, same build), and the plan's share of it."""
    served, whole = served_decode_tps or 0.0, all_gpu_decode_tps or 0.0
    return {"step_ms": 1e3 / served if served else None, "whole_gpu_step_ms": 1e3 / whole if whole else None,
            "of_whole_gpu": served / whole if served and whole else None}


_SPLIT = re.compile(r"per-expert split: (\d+) experts of (\d+) layers copied to \S+, taking (\d+)% of the picks"
                    r" \((the rest read by the GPU|the rest on the host)")


def step_facts_from_show(text: str) -> dict[str, Any]:
    """:func:`step_facts`' split figures from a saved ``flux show`` (no host round trips: the log does not give
    the layer placement's hand-overs), or {} where the text is not a plan's show."""
    if "llama.cpp flags:" not in text:
        return {}
    m = _SPLIT.search(text)
    if m is None:
        return {"expert_path": None, "split_layers": 0, "experts_copied": 0, "hot_pick_share": None}
    mapped = m.group(4).startswith("the rest read")
    return {"expert_path": "mapped" if mapped else "host", "split_layers": int(m.group(2)),
            "experts_copied": int(m.group(1)), "hot_pick_share": int(m.group(3)) / 100,
            "host_round_trips": 0 if mapped else int(m.group(2))}
