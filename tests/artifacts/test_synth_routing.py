"""Routing profiles of twins: the skewed curve, its router fit, and what the profile changes in a file (no llama.cpp)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from artifacts.synth import PRESETS, apply_overrides, planned_bytes, synthesize
from artifacts.synth.routing import layer_ranks, router_scales, target_shares

SKEWED = {"routing": "skewed"}


@settings(max_examples=30, deadline=None)
@given(n_expert=st.integers(2, 256), top_half=st.floats(0.55, 0.98))
def test_the_curve_is_a_distribution_whose_busiest_half_gets_top_half(n_expert: int, top_half: float) -> None:
    # the busiest ceil(n/2) of n experts hold at least that share under uniform routing (2/3 of 3 experts)
    assume(top_half > math.ceil(n_expert / 2) / n_expert)
    p = target_shares(n_expert, top_half)
    assert p.shape == (n_expert,) and p.sum() == pytest.approx(1.0)
    assert (np.diff(p) <= 0).all()  # busiest first
    assert p[: math.ceil(n_expert / 2)].sum() == pytest.approx(top_half, abs=1e-6)


def test_the_qwen3_30b_a3b_fit_matches_the_published_statistics() -> None:
    # docs/routing.md: 90% of picks in about half the 128 experts, the busiest 4.3-6.3% of picks
    spec = PRESETS["qwen3-30b-a3b"]
    p = target_shares(spec.n_expert, 0.9)
    assert p[0] == pytest.approx(0.050, abs=0.002)
    scales, expected = router_scales(spec.n_expert, spec.n_expert_used, 0.9)
    assert expected.sum() == pytest.approx(1.0)
    assert np.sort(expected)[::-1][:64].sum() == pytest.approx(0.90, abs=0.01)
    assert 0.043 <= expected.max() <= 0.063
    assert scales.max() / scales.min() < 20  # a spread, not a one-hot router


def test_few_experts_per_pick_cap_the_curve() -> None:
    # a scale only spreads a logit: no expert is picked on more than about half the tokens
    _, expected = router_scales(8, 2, 0.9)
    assert expected.max() <= 0.5 / 2 + 0.01
    assert 0.75 < np.sort(expected)[::-1][:4].sum() < 0.9


def test_the_fit_is_deterministic_and_each_layer_ranks_its_own_experts() -> None:
    router_scales.cache_clear()
    a = router_scales(16, 2, 0.8)
    router_scales.cache_clear()
    b = router_scales(16, 2, 0.8)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert sorted(layer_ranks(16, 0, seed=0)) == list(range(16))
    assert not np.array_equal(layer_ranks(16, 0, seed=0), layer_ranks(16, 1, seed=0))
    assert np.array_equal(layer_ranks(16, 3, seed=5), layer_ranks(16, 3, seed=5))


def test_a_skewed_twin_differs_from_the_uniform_one_only_in_its_routers(tmp_path: Path) -> None:
    uniform = synthesize("tiny-moe", tmp_path / "u.gguf", seed=2)
    skewed = synthesize("tiny-moe", tmp_path / "s.gguf", seed=2, overrides=SKEWED)
    assert planned_bytes("tiny-moe", overrides=SKEWED) == skewed.file_bytes
    tu = {t.name: t for t in GGUFReader(uniform.path).tensors}
    ts = {t.name: t for t in GGUFReader(skewed.path).tensors}
    assert tu.keys() == ts.keys()
    spec = PRESETS["tiny-moe"]
    scales, _ = router_scales(spec.n_expert, spec.n_expert_used, 0.9)
    for name, t in tu.items():
        a, b = np.asarray(t.data), np.asarray(ts[name].data)
        if not name.endswith("ffn_gate_inp.weight"):
            assert np.array_equal(a, b), name
            continue
        # the same random directions, each row normalised and scaled by its expert's rank in this layer
        layer = int(name.split(".")[1])
        cos = (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        assert np.allclose(cos, 1.0, atol=1e-5)
        norms = np.linalg.norm(b, axis=1)
        want = scales[layer_ranks(spec.n_expert, layer, seed=2)]
        assert np.allclose(norms / norms.mean(), want / want.mean(), rtol=1e-4)


def test_the_profile_is_recorded_only_when_it_is_not_uniform(tmp_path: Path) -> None:
    def spec_of(path: Path) -> dict[str, object]:
        field = GGUFReader(path).fields["flux.synth.spec"].contents()
        assert isinstance(field, str)
        return dict(json.loads(field))

    assert "routing" not in spec_of(synthesize("tiny-moe", tmp_path / "u.gguf").path)
    recorded = spec_of(synthesize("tiny-moe", tmp_path / "s.gguf", overrides={**SKEWED, "routing_top_half": "0.8"}).path)
    assert (recorded["routing"], recorded["routing_top_half"]) == ("skewed", 0.8)


@pytest.mark.parametrize(("overrides", "match"), [
    ({"routing": "skewed", "n_expert": "0", "n_expert_used": "0", "n_ff_exp": "0", "arch": "llama", "n_ff": "512"},
     "needs experts"),
    ({"routing": "zipf"}, "routing"),
    ({"routing": "skewed", "routing_top_half": "0.4"}, "routing_top_half"),
])
def test_bad_profiles_are_refused(overrides: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_overrides(PRESETS["tiny-moe"], overrides)


def test_flux_synth_routing_flag(flux: Any, tmp_path: Path) -> None:
    out = tmp_path / "s.gguf"
    made = flux("synth", "--like", "tiny-moe", "--routing", "skewed", "-o", str(out))
    assert made.returncode == 0, made.stderr
    field = GGUFReader(out).fields["flux.synth.spec"].contents()
    assert isinstance(field, str) and json.loads(field)["routing"] == "skewed"
    dense = flux("synth", "--like", "tiny-dense", "--routing", "skewed", "-o", str(tmp_path / "d.gguf"))
    assert dense.returncode == 2 and "needs experts" in dense.stderr
