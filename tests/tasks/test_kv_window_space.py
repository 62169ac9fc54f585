"""KV windows in the search space (issue 53, patch 0009): a plan for the trained context whose VRAM holds only each
layer's first cells, sized like a plan of the window's length, on the 30B twin with the H200's probe."""

from __future__ import annotations

import pytest

from artifacts.model_info import ModelInfo, kv_cache_bytes
from artifacts.records.hardware import HardwareReport
from artifacts.records.plan import PlanRequest
from artifacts.records.search import PlacementSpace
from tasks.gpu_memory import predicted_gpu_bytes
from tasks.search.kv_window import WINDOWS, concat_bytes, windows
from tasks.search.space import enumerate_placements
from tests.tasks.test_costmodel_attention import _recorded
from tests.tasks.test_expert_hot import skewed
from tests.tasks.test_prefill_ubatch import RUN13

GIB = 2**30


@pytest.fixture(scope="module")
def run13() -> tuple[ModelInfo, HardwareReport]:
    info, hw, _ = _recorded(RUN13)
    return info, hw


def _space(run13: tuple[ModelInfo, HardwareReport], **req: object) -> PlacementSpace:
    info, hw = run13
    return enumerate_placements(info, hw, PlanRequest(model="m", workload="chat", gpu_mem_budget_gib=[9.0], **req),
                                10, skewed(info))


def test_the_windows_tried_are_those_shorter_than_the_context() -> None:
    assert WINDOWS[0] == 65536
    assert windows(262144, 1) == [65536, 32768] and windows(40960, 1) == [32768]
    assert windows(32768, 1) == [] and windows(262144, 0) == []


def test_a_window_plan_holds_the_trained_context_with_a_window_lengths_vram(
        run13: tuple[ModelInfo, HardwareReport]) -> None:
    info, hw = run13
    space = _space(run13)
    win = [c for c in space.candidates if c.params.kv_vram_cells]
    assert win, "the trained context (40,960) gets window candidates"
    short = {c.family.split("@")[0]: c for c in space.candidates if c.params.n_ctx == 32768}
    for c in win:
        assert c.params.n_ctx == info.n_ctx_train == 40960 and c.params.kv_vram_cells == 32768
        assert c.params.flash_attn and c.params.offload_kqv and c.family.endswith("/kv-window32768")
        # every cell in pinned host memory, the window's on the GPU: the 32k plan's KV bytes there
        assert c.kv_bytes["CPU"] == pytest.approx(kv_cache_bytes(info, "f16", 40960), rel=1e-6)
        assert c.compute_bytes["CUDA0"] > c.compute_bytes["CPU"]  # the concatenation past the window
        twin = short.get(c.family.split("/kv-window")[0])
        if twin is not None:
            assert c.kv_bytes["CUDA0"] == twin.kv_bytes["CUDA0"]
            assert c.placement == twin.placement, "the same weights on the GPU as the window-length plan"
        for dev, b in predicted_gpu_bytes(c, hw).items():
            assert b <= space.memory_limits[dev], "a window the budget cannot hold is never a candidate"
    assert concat_bytes(info, "f16", 40960, 32768, 1) == pytest.approx(
        kv_cache_bytes(info, "f16", 8192) / info.n_layer, rel=1e-6)


def test_an_asked_context_and_a_short_one_get_no_window(run13: tuple[ModelInfo, HardwareReport]) -> None:
    assert not any(c.params.kv_vram_cells for c in _space(run13, ctx=40960).candidates)
    assert not any(c.params.kv_vram_cells for c in _space(run13, ctx=16384).candidates)
