"""MoE routing of a synthetic twin, observed inside real llama.cpp, spreads tokens over all experts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from artifacts.synth.catalog import PRESETS

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
from engine_bridge.worker.routing import expert_counts  # noqa: E402  # needs llama_cpp

# Varied English, long enough for 256 tokens with the twins' byte-level tokenizer.
TEXT = (
    "The committee met on a rainy Tuesday to discuss the harbour bridge, the new library budget, and whether "
    "the old tram line could be rebuilt before winter. Seven engineers argued about steel prices; a baker "
    "from Quayside Street asked why the fountain had been dry since 1987. Jazz, physics, gardening, vaccines, "
    "medieval poetry and quantum computing were mentioned, oddly, in the same breath. Afterwards, everyone "
    "walked home past the lighthouse, counting gulls and arguing about the price of fresh oysters."
)


def test_every_expert_is_used_and_none_dominates(tiny_moe: Path) -> None:
    spec = PRESETS["tiny-moe"]
    counts = expert_counts(tiny_moe, TEXT, n_tokens=256)
    assert counts.shape == (spec.n_layer, spec.n_expert)
    assert (counts.sum(axis=1) == 256 * spec.n_expert_used).all()  # the last layer routes every token too
    assert (counts >= 1).all(), counts
    busiest = counts.max(axis=1) / counts.mean(axis=1)
    assert (busiest <= 3.0).all(), counts


def test_token_ids_and_too_short_input(tiny_moe: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, PRESETS["tiny-moe"].n_vocab - 3, size=64).tolist()
    assert (
        expert_counts(tiny_moe, tokens, n_tokens=64).sum(axis=1) == 64 * PRESETS["tiny-moe"].n_expert_used
    ).all()
    with pytest.raises(ValueError, match="fewer than n_tokens"):
        expert_counts(tiny_moe, "short", n_tokens=256)
