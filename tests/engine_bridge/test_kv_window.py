"""A KV cache split by position (patch 0009, ``EngineParams.kv_vram_cells``), on the CPU.

With a window of 256 cells, each attention layer keeps its first 256 cells in a window tensor and every cell in a
second host tensor; attention reads the window alone while the cells in use fit in it, else the window and the
cells after it, concatenated. The window lives in the layer's device buffer and the rest in host memory that
device reads: here both are host buffers of the CPU, so the split's graph, writes and state round trip are
exercised for real and the logits must be the unsplit cache's, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from artifacts import native_switches as sw
from artifacts.engine_params import EngineParams

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")

from engine_bridge.worker import parking  # noqa: E402  # after the skip
from engine_bridge.worker.native import NativeModel  # noqa: E402

WINDOW = 256
BASE = {"n_ctx": 1024, "n_batch": 128, "n_ubatch": 128, "flash_attn": True}
RNG = np.random.default_rng(0)
PROMPT = RNG.integers(10, 500, size=600).tolist()  # past the window: 2 of its 5 batches read across it
CONTINUATION = RNG.integers(10, 500, size=40).tolist()


def _logprobs_and_greedy(model: Path, params: EngineParams) -> tuple[np.ndarray, list[int], list[int]]:
    m = NativeModel(model, params)
    try:
        # greedy from 240 tokens: its decode steps cross the window's end (cell 256)
        return m.logprobs(PROMPT, CONTINUATION), m.greedy(PROMPT[:240], 40, stop_eog=False), \
            m.greedy(PROMPT[:500], 8, stop_eog=False)
    finally:
        m.close()


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_a_split_cache_gives_the_logits_of_the_unsplit_one(tiny_moe: Path, kv_type: str) -> None:
    kv = {"type_k": kv_type, "type_v": kv_type}
    ref = _logprobs_and_greedy(tiny_moe, EngineParams(**BASE, **kv))
    got = _logprobs_and_greedy(tiny_moe, EngineParams(**BASE, **kv, kv_vram_cells=WINDOW))
    assert np.abs(got[0] - ref[0]).max() == 0.0
    assert got[1] == ref[1] and got[2] == ref[2]


def _after_a_restore(model: Path, params: EngineParams) -> np.ndarray:
    """Prefill 400 tokens, park the sequence, clear the cache, restore it, decode the next token's logits."""
    m = NativeModel(model, params)
    try:
        tokens = np.array(PROMPT[:400], dtype=np.int32)
        m._decode(PROMPT[:400], 0)
        entry = parking.capture(m.ctx, 0, tokens, None, limit=1 << 30)
        assert entry is not None
        m._clear()
        assert parking.restore(m.ctx, 0, entry)
        m._decode([PROMPT[400]], 400)
        return m._logits().copy()
    finally:
        m.close()


def test_a_parked_sequence_restores_into_the_window(tiny_moe: Path) -> None:
    # a state read fills the host copy; the window is refreshed from it before the next batch reads it
    ref = _after_a_restore(tiny_moe, EngineParams(**BASE))
    got = _after_a_restore(tiny_moe, EngineParams(**BASE, kv_vram_cells=WINDOW))
    assert np.abs(got - ref).max() == 0.0


def test_a_window_needs_flash_attention_and_an_offloaded_cache() -> None:
    with pytest.raises(ValidationError, match="flash_attn=True and offload_kqv=True"):
        EngineParams(n_ctx=1024, kv_vram_cells=WINDOW)
    with pytest.raises(ValidationError, match="flash_attn=True and offload_kqv=True"):
        EngineParams(n_ctx=1024, flash_attn=True, offload_kqv=False, kv_vram_cells=WINDOW)
    with pytest.raises(ValidationError):
        EngineParams(n_ctx=1024, flash_attn=True, kv_vram_cells=8)  # below one padded block of cells


def test_the_window_travels_as_its_switch_and_several_sequences_share_one_cache() -> None:
    one = EngineParams(**BASE, kv_vram_cells=WINDOW)
    assert one.environment()[sw.KV_VRAM_CELLS.name] == str(WINDOW)
    assert not one.kv_unified and "--kv-unified" not in one.server_args()
    two = one.model_copy(update={"n_seq_max": 2})
    assert two.kv_unified and "--kv-unified" in two.server_args()
    assert sw.KV_VRAM_CELLS.name not in EngineParams(**BASE).environment()
