"""A hybrid model (Qwen3-Next-80B-A3B's twin) is sized by its 12 full-attention layers' KV cache and its 36
recurrent layers' fixed state, so a plan at its trained 262,144 tokens fits where RAM holds those."""

from __future__ import annotations

import os
from pathlib import Path

from artifacts import synth
from artifacts.model_info import ModelInfo, model_info
from artifacts.records.plan import PlanRequest
from tasks.enumerate import kv_at, resolve_context
from tasks.testing import h200_report

GIB = 2**30


def header_only_twin(preset: str, out: Path) -> Path:
    """The preset's real header on a sparse file of the twin's full size (model_info reads headers only)."""
    name, spec = synth._resolve(preset, None, "Q4_0", 0)
    plan = synth.plan_tensors(spec, "Q4_0")
    header, _ = synth._layout(spec, plan, name, "Q4_0", 0)
    with open(out, "wb") as f:
        f.write(header)
        f.truncate(len(header) + synth._data_bytes(plan))
    os.utime(out, ns=(1_600_000_000 * 10**9,) * 2)
    return out


def _info(tmp_path: Path) -> ModelInfo:
    return model_info(header_only_twin("qwen3-next-80b-a3b", tmp_path / "q3n-80b.gguf"))


def test_the_80b_twins_kv_cache_and_recurrent_state(tmp_path: Path) -> None:
    info = _info(tmp_path)
    assert (info.n_layer, info.n_kv_layers) == (48, 12)
    assert info.kv_bytes_per_token["f16"] == 12 * 2 * (256 + 256) * 2  # 24 KiB per token
    per_layer = (4 - 1) * (4096 + 2 * 16 * 128) + 128 * 4096  # conv state + delta-rule state, f32 values
    assert info.recurrent_state_bytes == 36 * 4 * per_layer  # 79 MB per sequence
    assert kv_at(info, 262144) == 262144 * 24576 + info.recurrent_state_bytes  # 6 GiB + 79 MB


def test_a_plan_at_the_trained_context_fits_where_ram_holds_the_attention_layers_kv(tmp_path: Path) -> None:
    info = _info(tmp_path)
    assert info.n_ctx_train == 262144
    big = h200_report()
    assert resolve_context(info, big, PlanRequest(model="m"), 10) == (262144, False)
    # 56 GiB usable: the 42 GiB of weights and 6 GiB of KV fit; counting KV on all 48 layers (24 GiB) did not
    small = big.model_copy(update={"ram_total": 60 * GIB, "ram_available": 56 * GIB})
    assert resolve_context(info, small, PlanRequest(model="m"), 5) == (262144, False)
    four = resolve_context(info, small, PlanRequest(model="m", concurrency=4), 5)
    assert four[1] and four[0] < 262144, "four sequences' KV do not fit: capped by RAM"
