"""Several GPUs: one run of layers per GPU, and a tensor split under which llama.cpp agrees with the placement."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from artifacts.model_info import ModelInfo, model_info
from artifacts.records.plan import PlanRequest
from artifacts.records.search import Placement
from tasks import expert_select, layer_split
from tasks.costmodel import EXPERT_PARTS
from tasks.search.space import enumerate_placements, gpu_overhead, kv_at
from tasks.testing import h200_report

GPUS = ["CUDA0", "CUDA1", "CUDA2", "CUDA3"]


@pytest.fixture(scope="module")
def moe(tiny_moe: Path) -> ModelInfo:
    return model_info(tiny_moe)


def gpu_index(dev: str) -> int:
    return GPUS.index(dev)


def ts_round_trip(split: tuple[float, ...]) -> list[float]:
    """The shares as llama-server reads them back from ``-ts`` (printed with 6 significant digits)."""
    return [float(x) for x in ",".join(f"{x:g}" for x in split).split(",")]


@given(sizes=st.lists(st.integers(1, 10**9), min_size=1, max_size=96),
       budgets=st.lists(st.integers(1, 10**10), min_size=1, max_size=4))
def test_runs_are_consecutive_and_follow_the_budgets(sizes: list[int], budgets: list[int]) -> None:
    run = layer_split.runs(sizes, budgets)
    assert len(run) == len(sizes) and run == sorted(run) and set(run) <= set(range(len(budgets)))
    total, share = sum(sizes), sum(budgets)
    acc = 0
    for j in range(len(budgets) - 1):  # GPU j's run ends within one position of its share of the bytes
        acc += sum(s for s, g in zip(sizes, run, strict=True) if g == j)
        assert acc <= total * sum(budgets[: j + 1]) / share + max(sizes)


@st.composite
def placements(draw: st.DrawFn) -> tuple[Placement, int]:
    """A placement as expert_select makes them: GPUs in consecutive runs, any position possibly on the CPU."""
    g = draw(st.integers(2, 4))
    n = draw(st.integers(1, 64))
    run = sorted(draw(st.lists(st.integers(0, g - 1), min_size=n + 1, max_size=n + 1)))
    cpu = draw(st.lists(st.booleans(), min_size=n + 1, max_size=n + 1))
    devs = ["CPU" if c else GPUS[j] for j, c in zip(run, cpu, strict=True)]
    return Placement(layer_device=devs[:-1], expert_device=[dict.fromkeys(EXPERT_PARTS, d) for d in devs[:-1]],
                     output_device=devs[-1]), g


@given(placements())
def test_llama_cpp_puts_every_gpu_position_where_the_placement_does(pg: tuple[Placement, int]) -> None:
    placement, g = pg
    split = layer_split.tensor_split(placement, GPUS[:g])
    assert split is not None and len(split) == g and all(s >= 0 for s in split)
    n = len(placement.layer_device)
    for shares in (list(split), ts_round_trip(split)):  # through the native API and through -ts
        for pos, dev in enumerate([*placement.layer_device, placement.output_device]):
            if dev != "CPU":
                assert layer_split.llama_gpu(shares, n, pos) == gpu_index(dev), (pos, dev, shares)


def test_one_gpu_needs_no_split_and_one_of_two_keeps_everything(moe: ModelInfo) -> None:
    on0 = expert_select.select(moe, [moe.weight_bytes * 2])
    assert layer_split.tensor_split(on0, ["CUDA0"]) is None
    assert layer_split.kv_devices(on0, ["CUDA0"]) == ["CUDA0"] * moe.n_layer
    split = layer_split.tensor_split(on0, ["CUDA0", "CUDA1"])
    assert split == (1.0, 0.0), "without it llama.cpp would spread the layers over both GPUs by free memory"


def test_milp_gives_each_gpu_one_run_and_the_head_to_the_last(moe: ModelInfo) -> None:
    for g in (2, 3):
        budgets = [int(moe.weight_bytes * 0.8 / g)] * g
        for weight in (0.0, 0.5, 0.9):
            p = expert_select.select(moe, budgets, prefill_weight=weight)
            seq = [gpu_index(d) for d in [*p.layer_device, p.output_device] if d != "CPU"]
            assert seq == sorted(seq) and len(set(seq)) == g, (g, weight, p.layer_device)
            assert p.output_device == GPUS[g - 1]


@pytest.mark.parametrize(("frac", "family"), [(0.4, "milp-decode"), (0.6, "split-layers")])
def test_two_gpu_candidates_keep_each_kv_cache_with_its_attention(moe: ModelInfo, frac: float, family: str) -> None:
    # 0.4 of the weights per GPU: a hybrid over both GPUs; 0.6: the model fits only across both.
    budget_gib = (moe.weight_bytes * frac + gpu_overhead(moe, 512, kv_at(moe, 512) / 2)) / 2**30  # KV split over both
    space = enumerate_placements(moe, h200_report(2), PlanRequest(model="m", ctx=512, gpu_mem_budget_gib=[budget_gib]), 10)
    families = {c.family for c in space.candidates}
    assert family in families and "all-gpu" not in families
    for c in space.candidates:
        p = c.placement
        if c.family == "cpu":
            assert c.params.tensor_split is None and set(c.kv_bytes) == {"CPU"}
            continue
        assert c.params.tensor_split is not None
        if not c.params.offload_kqv:  # -nkvo: the KV cache and attention stay on the host
            assert set(c.kv_bytes) == {"CPU"} and c.family.endswith("/kv-host")
            continue
        if c.params.n_gpu_layers <= len(p.layer_device):  # -ngl N: the KV of the offloaded layers only
            assert c.family.startswith("last-") and not c.params.tensor_overrides
            first = len(p.layer_device) + 1 - c.params.n_gpu_layers
            assert all((dev == "CPU") == (il < first) for il, dev in enumerate(p.layer_device))
            assert set(c.kv_bytes) == {"CPU", "CUDA0"}
            continue
        kv = layer_split.kv_devices(p, ["CUDA0", "CUDA1"])
        for il, dev in enumerate(p.layer_device):
            if dev != "CPU":
                assert kv[il] == dev
        assert set(c.kv_bytes) == set(kv), "the KV cache is budgeted where llama.cpp will put it"
        if {"CUDA0", "CUDA1"} <= set(p.layer_device):
            assert c.kv_bytes["CUDA0"] > 0 and c.kv_bytes["CUDA1"] > 0
        for dev, limit in space.memory_limits.items():
            used = c.weights_bytes.get(dev, 0) + c.kv_bytes.get(dev, 0) + c.compute_bytes.get(dev, 0)
            assert dev == "CPU" or used <= limit


def test_unlimited_two_gpus_measure_one_gpu_against_the_layer_split(moe: ModelInfo) -> None:
    space = enumerate_placements(moe, h200_report(2), PlanRequest(model="m", ctx=512), 10)
    by_family = {c.family: c for c in space.candidates}
    assert by_family["all-gpu"].params.tensor_split == (1.0, 0.0)
    split = by_family["split-layers"]
    assert set(split.placement.layer_device) == {"CUDA0", "CUDA1"} and split.placement.output_device == "CUDA1"
    assert "-ts" in split.params.cli_args()
    for c in space.candidates:
        if c.family == "split-layers":  # no overrides and several micro-batches per batch: pipelined
            assert not c.params.tensor_overrides and c.params.n_batch == 512 >= c.params.n_ubatch


def test_finalists_race_one_gpu_against_two(moe: ModelInfo) -> None:
    from tasks.costmodel import Workload
    from tasks.search.ranking import prune

    hw = h200_report(2)
    space = enumerate_placements(moe, hw, PlanRequest(model="m", ctx=512), 10)
    fin = prune(space, moe, hw, Workload(prefill_tokens=2048, decode_tokens=128, mean_prompt_tokens=512), 3)
    used = {len({d for d in c.placement.layer_device if d != "CPU"}) for c in fin.finalists}
    assert used == {1, 2}, [(c.family, c.params.n_ubatch) for c in fin.finalists]
