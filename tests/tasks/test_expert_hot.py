"""Per-expert placement in the planner: hot sets from routing, their budget, price and place among finalists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from artifacts.model_info import ModelInfo, expert_bytes, model_info
from artifacts.records.keys import plan_key
from artifacts.records.plan import PlanRequest
from tasks.costmodel import predict
from tasks.expert_hot import block_bytes, hot_placement, split_bytes
from tasks.search.ranking import prune
from tasks.search.space import enumerate_placements, gpu_overhead, kv_at
from tasks.testing import h200_report
from tests.tasks.test_placement import WORK, scaled


@pytest.fixture(scope="module")
def moe(tiny_moe: Path) -> ModelInfo:
    return model_info(tiny_moe)


def skewed(info: ModelInfo, s: float = 2.0, seed: int = 0) -> np.ndarray:
    """Zipf-like per-layer pick shares, each layer in its own expert order."""
    rng = np.random.default_rng(seed)
    ranks = (np.arange(info.n_expert) + 1.0) ** -s
    rows = [rng.permutation(ranks) for _ in range(info.n_layer)]
    a = np.array(rows)
    return a / a.sum(axis=1, keepdims=True)


def uniform(info: ModelInfo) -> np.ndarray:
    return np.full((info.n_layer, info.n_expert), 1.0 / info.n_expert)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(extra=st.floats(0.0, 1.0))
def test_hot_sets_fit_the_budget_and_take_the_most_picked_first(moe: ModelInfo, extra: float) -> None:
    shares = skewed(moe)
    experts_total = sum(expert_bytes(moe)) * moe.n_expert
    budget = int(block_bytes(moe) + 64 * 1024 + extra * experts_total)  # + head room, then a share of the experts
    hp = hot_placement(moe, shares, budget)
    if hp is None:
        return
    assert hp.hot_bytes == sum(split_bytes(moe, hp.split).values())
    assert block_bytes(moe) + hp.hot_bytes <= budget
    picked = {(h.layer, e) for h in hp.split.layers for e in h.experts}
    least_picked = min(shares[i, e] for i, e in picked)
    left = [shares[i, e] for i in range(moe.n_layer) for e in range(moe.n_expert) if (i, e) not in picked]
    assert not left or max(left) <= least_picked + 1e-12, "a less-picked expert was taken before a busier one"
    for h in hp.split.layers:
        assert hp.hot_share[h.layer] == pytest.approx(shares[h.layer, list(h.experts)].sum())
    assert all(d == "CPU" for ex in hp.placement.expert_device for d in ex.values()), "whole expert tensors stay on the host"


def _space(info: ModelInfo, shares: np.ndarray, frac: float):  # type: ignore[no-untyped-def]
    budget_gib = (block_bytes(info) + frac * info.weight_bytes + gpu_overhead(info, 512, kv_at(info, 512))) / 2**30
    return enumerate_placements(info, h200_report(1), PlanRequest(model="m", ctx=512, gpu_mem_budget_gib=[budget_gib]),
                                10, shares)


def test_routing_adds_split_candidates_that_keep_their_experts_on_the_host(moe: ModelInfo) -> None:
    space = _space(moe, skewed(moe), 0.3)
    split = [c for c in space.candidates if c.params.expert_split is not None]
    assert split and {c.family for c in split} == {"experts-hot", "experts-mapped"}
    for c in split:
        assert "FLUX_MOE_SPLIT" in c.params.environment()
        assert any("exps" in o.pattern and o.device == "CPU" for o in c.params.tensor_overrides)
        assert c.weights_bytes["CUDA0"] >= block_bytes(moe) + sum(split_bytes(moe, c.params.expert_split).values())
        assert c.params.offload_min_batch is None, "a split layer below the threshold runs its host picks on the CPU"
    assert not any(c.params.expert_split for c in _space(moe, skewed(moe), 0.3).candidates
                   if c.family not in ("experts-hot", "experts-mapped"))
    no_routing = enumerate_placements(moe, h200_report(1), PlanRequest(model="m", ctx=512, gpu_mem_budget_gib=[
        (block_bytes(moe) + 0.3 * moe.weight_bytes + gpu_overhead(moe, 512, kv_at(moe, 512))) / 2**30]), 10)
    assert not any(c.params.expert_split for c in no_routing.candidates)


def test_skewed_routing_prices_the_split_above_whole_tensors_and_both_are_finalists(moe: ModelInfo) -> None:
    big = scaled(moe, 2000)  # a real model's scale, where bytes per token dominate decode
    for shares, split_wins in ((skewed(big, 3.0), True), (uniform(big), False)):
        space = _space(big, shares, 0.25)
        hw = h200_report(1)
        split = min((c for c in space.candidates if c.params.expert_split), key=lambda c: -predict(big, hw, c, WORK).decode_tps)
        whole = min((c for c in space.candidates if c.family.startswith("milp-decode") and c.placement.is_hybrid()
                     and c.params.load_mode == split.params.load_mode and c.params.no_host == split.params.no_host
                     and c.params.n_threads == split.params.n_threads and c.params.flash_attn == split.params.flash_attn
                     and c.params.n_ubatch == split.params.n_ubatch and c.params.offload_min_batch is None),
                    key=lambda c: -predict(big, hw, c, WORK).decode_tps)
        ratio = predict(big, hw, split, WORK).decode_tps / predict(big, hw, whole, WORK).decode_tps
        assert (ratio > 1.05) == split_wins, ratio
        fin = prune(space, big, hw, WORK, 6)
        assert any(c.params.expert_split for c in fin.finalists), "the best split is measured"
        assert any(c.placement.is_hybrid() and not c.params.expert_split for c in fin.finalists), \
            "so is the best whole-tensor placement"


def test_another_routing_trace_is_another_plan() -> None:
    from artifacts.records.plan import PlanRequest

    hw, req = h200_report(1), PlanRequest(model="m")
    base = plan_key("model", hw, "build", req, {})
    assert plan_key("model", hw, "build", req, {}, "trace-a") != plan_key("model", hw, "build", req, {}, "trace-b")
    assert "routing" not in base, "a plan made without a trace keeps the key it always had"


def test_the_plan_says_how_per_expert_placement_fared_against_whole_tensors(moe: ModelInfo) -> None:
    from artifacts.records.evidence import MeasureSummary
    from tasks.recording.record import expert_split_notes

    space = _space(moe, skewed(moe), 0.3)
    hot = next(c for c in space.candidates if c.family == "experts-hot")
    whole = next(c for c in space.candidates if c.family != "experts-hot" and c.placement.gpu_layers() > 0)
    cpu = next(c for c in space.candidates if c.placement.gpu_layers() == 0)
    by_id = {c.id: c for c in (hot, whole, cpu)}

    def sums(hot_s: float, whole_s: float) -> dict[str, MeasureSummary]:
        return {c.id: MeasureSummary(candidate_id=c.id, prefill_tps=100.0, decode_tps=10.0 / t, workload_s=t, n_trials=4)
                for c, t in ((hot, hot_s), (whole, whole_s), (cpu, 0.5))}

    won = expert_split_notes(by_id, sums(1.0, 2.0), hot.id)
    assert len(won) == 1 and won[0].startswith(f"per-expert placement ({hot.id}): decode 10.0 tok/s")
    assert f"best whole-tensor finalist ({whole.id}, {whole.family}): 5.0 tok/s" in won[0] and won[0].endswith("per-expert won")
    assert expert_split_notes(by_id, sums(2.0, 1.0), whole.id)[0].endswith("whole-tensor won")
    assert expert_split_notes(by_id, sums(1.0, 2.0), cpu.id) == [], "a CPU plan compares neither"
    assert expert_split_notes({hot.id: hot, cpu.id: cpu}, {k: v for k, v in sums(1.0, 2.0).items() if k != whole.id},
                              hot.id) == [], "no whole-tensor finalist measured: nothing to say"
