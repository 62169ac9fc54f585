"""Checks of a per-expert placement (:class:`~artifacts.engine_params.ExpertSplit`) against a model's header.

The patched llama.cpp checks the same things again when it loads (and, there only, that each split layer's
full expert tensors ended up in host memory); checking here first gives a typed error before any weight is
read. Nothing here imports llama_cpp.
"""

from __future__ import annotations

from artifacts.engine_params import ExpertSplit
from artifacts.model_info import ModelInfo
from engine_bridge.errors import ExpertSplitMismatch

# general.architecture values whose llama.cpp graph builds the plain gate/up/down expert path the split patches
# (qwen3next and qwen35moe add a gated shared expert beside it, which stays with its layer's placement).
SPLIT_ARCHITECTURES = frozenset({"qwen3moe", "llama", "qwen3next", "qwen35moe"})


def check_expert_split(split: ExpertSplit, info: ModelInfo) -> None:
    """Refuse a split that names a layer, layer kind or expert the model does not have.

    Raises:
        ExpertSplitMismatch: the first problem found, naming the layer and expert.
    """
    def bad(reason: str) -> ExpertSplitMismatch:
        return ExpertSplitMismatch(info.path, reason)

    if info.architecture not in SPLIT_ARCHITECTURES:
        raise bad(f"expert splits support {', '.join(sorted(SPLIT_ARCHITECTURES))}, not {info.architecture}")
    if not info.is_moe:
        raise bad("the model has no routed experts")
    for h in split.layers:
        if h.layer >= info.n_layer:
            raise bad(f"layer {h.layer} does not exist: the model has {info.n_layer} layers")
        if info.layers[h.layer].expert_bytes == 0:
            raise bad(f"layer {h.layer} has no routed expert tensors")
        if h.experts[-1] >= info.n_expert:
            raise bad(f"layer {h.layer}: expert {h.experts[-1]} does not exist (the model has {info.n_expert} experts)")
