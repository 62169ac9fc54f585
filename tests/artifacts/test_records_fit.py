"""Serve-time shortfall: the least-routed cached experts go first; a shortfall they cannot cover is refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from artifacts.config import Settings, load_settings
from artifacts.engine_params import EngineParams, ExpertSplit
from artifacts.model_info import expert_bytes, model_info
from artifacts.records.errors import SplitShortfall
from artifacts.records.fit import device_need, fit_split
from artifacts.records.search import Candidate, Placement
from tasks.testing import stored_plan

HOT = {0: [0, 1, 2], 1: [3, 4], 2: [5], 3: [6, 7]}


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    home = tmp_path_factory.mktemp("shortfall-home")
    return load_settings({"HOME": str(home), "XDG_DATA_HOME": str(home / "data"), "XDG_CACHE_HOME": str(home / "cache")})


def split_plan(settings: Settings, model: Path):  # type: ignore[no-untyped-def]
    info = model_info(model)
    split = ExpertSplit.on("CPU", HOT)  # a CPU build splits between two host buffers
    params = EngineParams(n_ctx=256, n_batch=64, n_ubatch=64, expert_split=split)
    per = expert_bytes(info)
    cand = Candidate(id="c000", family="experts-hot", placement=Placement(layer_device=["CPU"] * info.n_layer),
                     params=params, weights_bytes={"CPU": info.weight_bytes + sum(per[i] * len(e) for i, e in HOT.items())},
                     kv_bytes={"CPU": 1 << 20}, compute_bytes={"CPU": 1 << 20}, hot_share=[0.6, 0.4, 0.2, 0.5])
    return stored_plan(settings, model, params, candidate=cand.model_dump()), info


def shares(info) -> np.ndarray:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    a = rng.random((info.n_layer, info.n_expert))
    return a / a.sum(axis=1, keepdims=True)


def test_enough_memory_changes_nothing(settings: Settings, tiny_moe: Path) -> None:
    plan, info = split_plan(settings, tiny_moe)
    params, dropped = fit_split(plan, info, {"CPU": device_need(plan, "CPU")}, shares(info))
    assert params == plan.candidate.params and not dropped


def test_a_shortfall_drops_the_least_routed_copies_first(settings: Settings, tiny_moe: Path) -> None:
    plan, info = split_plan(settings, tiny_moe)
    per = expert_bytes(info)
    sh = shares(info)
    need = device_need(plan, "CPU")
    params, (d,) = fit_split(plan, info, {"CPU": need - per[0] - 1}, sh)  # two copies' worth short
    kept = {(h.layer, e) for h in params.expert_split.layers for e in h.experts} if params.expert_split else set()
    gone = {(i, e) for i, es in HOT.items() for e in es} - kept
    assert d.experts == len(gone) == 2 and d.bytes >= per[0] + 1
    least = sorted(((sh[i, e], (i, e)) for i, es in HOT.items() for e in es))[:2]
    assert gone == {x for _, x in least}, "the two least-routed copies went"
    assert d.host_picks_after > d.host_picks_before and "dropped 2 of 8 cached experts" in d.message()


def test_a_shortfall_beyond_the_copies_is_refused(settings: Settings, tiny_moe: Path) -> None:
    plan, info = split_plan(settings, tiny_moe)
    with pytest.raises(SplitShortfall, match="dropping all its cached experts frees only") as exc:
        fit_split(plan, info, {"CPU": 1 << 20}, shares(info))
    assert "--replan" in str(exc.value)


def test_dropping_every_copy_leaves_the_stock_placement(settings: Settings, tiny_moe: Path) -> None:
    plan, info = split_plan(settings, tiny_moe)
    per = expert_bytes(info)
    all_copies = sum(per[i] * len(e) for i, e in HOT.items())
    params, (d,) = fit_split(plan, info, {"CPU": device_need(plan, "CPU") - all_copies}, None)
    assert params.expert_split is None and d.experts == d.of_experts == 8
