"""Decode's bytes bound at a depth (tasks/costmodel.py: roofline_decode, the figure `flux bench run --via serve
--depths` prints beside each plan reading) for a KV window (patch 0009): below the window the cache is read from
VRAM, past it the GPU reads the cells after the window from pinned host memory over the bus, so every cell past
the window lowers the bound by its bytes at the bus rate; the window's cells are never priced as host attention."""

from __future__ import annotations

import pytest

from artifacts.model_info import ModelInfo, kv_cache_bytes, kv_read_bytes
from artifacts.records.hardware import HardwareReport
from artifacts.records.plan import PlanRequest
from artifacts.records.search import Candidate
from tasks.costmodel import Workload, _gpu_probe_fa, mapped_bandwidth, predict, roofline_decode
from tasks.kv_traffic import kv_bus_reads, kv_reads
from tasks.search.space import enumerate_placements
from tests.tasks.test_costmodel_attention import _recorded
from tests.tasks.test_expert_hot import skewed
from tests.tasks.test_prefill_ubatch import RUN13


@pytest.fixture(scope="module")
def run13() -> tuple[ModelInfo, HardwareReport, Candidate, Candidate]:
    """The 30B twin with the H200's probe: a window candidate for its trained context (40,960 tokens, a window of
    32,768 cells) and the same placement with its whole cache in VRAM."""
    info, hw, _ = _recorded(RUN13)
    space = enumerate_placements(info, hw, PlanRequest(model="m", workload="chat", gpu_mem_budget_gib=[9.0]), 10,
                                 skewed(info))
    win = next(c for c in space.candidates if c.params.kv_vram_cells)
    whole = win.model_copy(update={
        "params": win.params.model_copy(update={"kv_vram_cells": None}),
        "kv_bytes": {d: kv_cache_bytes(info, win.params.type_k, win.params.n_ctx) for d in win.kv_bytes if d != "CPU"}})
    return info, hw, win, whole


def test_cells_past_the_window_are_read_over_the_bus_and_lower_the_bound(
        run13: tuple[ModelInfo, HardwareReport, Candidate, Candidate]) -> None:
    info, hw, win, _ = run13
    w, n_ctx, kv = win.params.kv_vram_cells, win.params.n_ctx, win.params.type_k
    assert w == 32768 and n_ctx == 40960
    assert kv_bus_reads(info, win, 4096) == 0.0 and kv_bus_reads(info, win, w) == 0.0
    past = kv_read_bytes(info, kv, n_ctx) - kv_read_bytes(info, kv, w)
    assert kv_bus_reads(info, win, n_ctx) == pytest.approx(past, rel=1e-9)
    assert kv_bus_reads(info, win, 2 * n_ctx) == kv_bus_reads(info, win, n_ctx), "no cell past the context"
    # the GPU reads the window's cells from VRAM, the host none of them
    host, gpu = kv_reads(info, win, n_ctx)
    assert host == 0.0 and gpu == pytest.approx(kv_read_bytes(info, kv, w), rel=1e-9)
    depths = [4096, w, (w + n_ctx) // 2, n_ctx]
    bounds = [roofline_decode(info, hw, win, d) or 0.0 for d in depths]
    assert all(bounds)
    assert bounds == sorted(bounds, reverse=True) and bounds[1] > bounds[2] > bounds[3], bounds
    # each cell past the window costs its bytes at the bus rate: 1/bound grows by exactly that
    step = 1 / bounds[3] - 1 / bounds[1]
    assert step == pytest.approx(past / mapped_bandwidth(hw), rel=1e-6)


def test_the_bound_at_a_depth_reads_the_cache_where_it_lives(
        run13: tuple[ModelInfo, HardwareReport, Candidate, Candidate]) -> None:
    info, hw, win, whole = run13
    # below the window a windowed cache reads what a cache wholly in VRAM reads
    assert roofline_decode(info, hw, win, 4096) == pytest.approx(roofline_decode(info, hw, whole, 4096), rel=1e-9)
    # past it, the bus is slower than VRAM: the window's bound falls below the whole cache's
    assert roofline_decode(info, hw, win, 40960) < roofline_decode(info, hw, whole, 40960)  # type: ignore[operator]
    # depth 0 is the plan's recorded roofline (flux show): the default is unchanged
    assert roofline_decode(info, hw, win) == roofline_decode(info, hw, win, 0.0)


def test_the_prediction_at_a_depth_pays_the_bus_too(
        run13: tuple[ModelInfo, HardwareReport, Candidate, Candidate]) -> None:
    info, hw, win, whole = run13

    def decode(c: Candidate, depth: int) -> float:
        return predict(info, hw, c, Workload(prefill_tokens=depth, decode_tokens=64, mean_prompt_tokens=depth)
                       ).decode_tps

    assert decode(win, 4096) == pytest.approx(decode(whole, 4096), rel=1e-9), "no host attention for the window"
    extra_ms = 1e3 / decode(win, 40960) - 1e3 / decode(whole, 40960)
    bus_ms = kv_bus_reads(info, win, 40960) / mapped_bandwidth(hw) * 1e3
    vram_ms = 1e3 / decode(whole, 40960) - 1e3 / decode(whole, 32768)  # what the whole cache's extra cells cost
    fa = 0.85 if win.params.flash_attn and not _gpu_probe_fa(hw) else 1.0  # the step's flash-attention factor
    assert extra_ms > 0 and extra_ms + vram_ms == pytest.approx(fa * bus_ms, rel=1e-6)
