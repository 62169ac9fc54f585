"""Storage streaming (issue 54 item 5): weights beyond RAM refused with their decode limit from the drive, or, with
--allow-storage-streaming, planned as mapped placements that carry that limit (tasks/streaming.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from artifacts.model_info import ModelInfo, kv_cache_bytes, model_info
from artifacts.records.plan import PlanRequest
from tasks.costmodel import all_on, layer_bytes
from tasks.errors import ImpossiblePlan, NeedsStorageStreaming
from tasks.gpu_memory import compute_bytes
from tasks.search.space import enumerate_placements
from tasks.streaming import candidate_streaming, drive_bytes_per_token
from tasks.testing import h200_report

GIB = 2**30


@pytest.fixture(scope="module")
def moe(tiny_moe: Path) -> ModelInfo:
    return model_info(tiny_moe)


@given(read=st.floats(1, 1e10), mapped=st.integers(1, 10**11), ram=st.integers(-10**11, 10**11))
def test_drive_reads_grow_as_ram_shrinks_and_stay_within_the_tokens_reads(read: float, mapped: int, ram: int) -> None:
    got = drive_bytes_per_token(read, mapped, ram)
    assert 0 <= got <= read * (1 + 1e-12)
    assert drive_bytes_per_token(read, mapped, ram - 1000) >= got
    if ram >= mapped:
        assert got == 0
    if ram <= 0:
        assert got == pytest.approx(read)


def test_weights_beyond_the_host_budget_are_refused_with_their_decode_limit(moe: ModelInfo) -> None:
    hw = h200_report(0)
    beside = kv_cache_bytes(moe, "f16", 512) + compute_bytes(moe, 128, 512, True)  # the least a CPU plan holds
    host = beside + moe.weight_bytes // 2  # half the weights fit beside them
    with pytest.raises(NeedsStorageStreaming) as refused:
        enumerate_placements(moe, hw, PlanRequest(model="m", ctx=512, host_mem_budget_gib=host / GIB), 10)
    s = refused.value.streaming
    read = layer_bytes(moe, all_on(moe, "CPU"))["CPU"][0]
    assert s.drive_bytes_per_token == pytest.approx(read / 2, rel=1e-6)
    assert s.decode_limit_tps == pytest.approx(hw.storage_read_gbs * 1e9 / s.drive_bytes_per_token)
    msg = str(refused.value)
    assert f"bound decode to {s.decode_limit_tps:,.2f} tok/s" in msg and "--allow-storage-streaming" in msg
    assert f"at {hw.storage_read_gbs:.2f} GB/s" in msg


def test_without_ctx_the_refusal_comes_before_sizing_the_context(moe: ModelInfo) -> None:
    hw = h200_report(0)
    with pytest.raises(NeedsStorageStreaming, match="tok/s"):
        enumerate_placements(moe, hw, PlanRequest(model="m", host_mem_budget_gib=moe.weight_bytes / GIB), 10)


def test_a_budget_the_kv_cache_and_compute_buffers_alone_exceed_is_no_streaming_refusal(moe: ModelInfo) -> None:
    with pytest.raises(ImpossiblePlan, match="no placement fits") as refused:
        enumerate_placements(moe, h200_report(0), PlanRequest(model="m", ctx=512, host_mem_budget_gib=0.001), 10)
    assert not isinstance(refused.value, NeedsStorageStreaming)


def test_with_the_flag_mapped_candidates_carry_their_limit(moe: ModelInfo) -> None:
    hw = h200_report(0)
    budget = 31 * 2**20  # kv + the largest compute buffer fit, those plus the weights do not (tiny-moe: 2.4 MB)
    req = PlanRequest(model="m", ctx=512, host_mem_budget_gib=budget / GIB, allow_storage_streaming=True)
    space = enumerate_placements(moe, hw, req, 10)
    streaming = [c for c in space.candidates if c.needs_storage_streaming]
    assert streaming and all(c.params.load_mode == "mmap" for c in streaming)
    for c in space.candidates:  # every candidate either fits whole or maps its weights
        whole = c.weights_bytes["CPU"] + c.kv_bytes.get("CPU", 0) + c.compute_bytes["CPU"]
        assert c.needs_storage_streaming == (whole > budget)
        s = candidate_streaming(moe, hw, c, space.memory_limits["CPU"])
        assert (s.decode_limit_tps is not None) == c.needs_storage_streaming
