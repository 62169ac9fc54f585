"""A hybrid model (Qwen3-Next-80B-A3B's twin) is sized by its 12 full-attention layers' KV cache and its 36
recurrent layers' fixed state, so a plan at its trained 262,144 tokens fits where RAM holds those."""

from __future__ import annotations

import os
from pathlib import Path

from artifacts import synth
from artifacts.model_info import ModelInfo, model_info
from artifacts.records.plan import PlanRequest
from tasks.search.context import resolve_context
from tasks.search.space import kv_at
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


def test_a_decoded_token_moves_the_recurrent_state_where_the_layers_cache_is(tmp_path: Path) -> None:
    """The 80B twin's 79 MB of delta-net state is read and written back each decoded token (2 x 79 MB), on the
    GPU with the layers there, on the host with their cache on the host (-nkvo) or the layers there."""
    from artifacts.engine_params import EngineParams
    from artifacts.records.search import Candidate, Placement
    from tasks.costmodel import decode_reads, state_reads

    info = _info(tmp_path)
    state = info.recurrent_state_bytes

    def cand(devs: list[str], offload_kqv: bool = True) -> Candidate:
        return Candidate(id="c", family="t", placement=Placement(layer_device=devs), weights_bytes={}, kv_bytes={},
                         compute_bytes={}, params=EngineParams(n_ctx=4096, n_gpu_layers=99, offload_kqv=offload_kqv))

    assert state_reads(info, cand(["CUDA0"] * 48)) == (0.0, 2.0 * state)
    assert state_reads(info, cand(["CUDA0"] * 48, offload_kqv=False)) == (2.0 * state, 0.0)
    assert state_reads(info, cand(["CPU"] * 24 + ["CUDA0"] * 24)) == (state, state)
    host, gpu = decode_reads(info, cand(["CUDA0"] * 48))
    host0, gpu0 = decode_reads(info.model_copy(update={"recurrent_state_bytes": 0}), cand(["CUDA0"] * 48))
    assert (host - host0, gpu - gpu0) == (0.0, 2.0 * state)
    dense = model_info(header_only_twin("llama3-8b", tmp_path / "l.gguf"))
    assert state_reads(dense, cand(["CUDA0"] * 32)) == (0.0, 0.0)
