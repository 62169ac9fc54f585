"""The qwen3next (Qwen3-Next) twins: hybrid layers as llama.cpp's converter writes them, loaded by real llama.cpp."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader
from twin_checks import field, greedy_twice, kinds_by_layer, written_tiny_twin

from artifacts.model_info import model_info
from artifacts.synth import PRESETS, QUANTS, Quant, plan_tensors, planned_bytes, synthesize
from artifacts.synth.presets import HYBRID_FIELDS, SynthSpec

TINY = "tiny-qwen3next"
RECURRENT = {"attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_ba.weight",
             "ssm_norm.weight", "ssm_out.weight"}
FULL_ATTENTION = {"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
                  "attn_k_norm.weight"}
EVERY_LAYER = {"attn_norm.weight", "post_attention_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
               "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight",
               "ffn_up_shexp.weight", "ffn_down_shexp.weight"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(TINY, tmp_path_factory.mktemp("q3n") / "m.gguf", quant="Q4_0").path


@pytest.mark.parametrize("quant", QUANTS)
def test_tiny_twin_lists_recurrent_and_attention_layers(tmp_path: Path, quant: Quant) -> None:
    reader = written_tiny_twin(TINY, tmp_path / "m.gguf", quant)
    kinds = kinds_by_layer([t.name for t in reader.tensors])
    assert sorted(kinds) == [0, 1, 2, 3]
    for layer in (0, 1, 2):  # full_attention_interval 4: layers 0-2 are gated delta-nets
        assert kinds[layer] == EVERY_LAYER | RECURRENT
    assert kinds[3] == EVERY_LAYER | FULL_ATTENTION
    assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= {t.name for t in reader.tensors}


def test_tiny_twin_metadata_is_the_converters() -> None:
    spec = PRESETS[TINY]
    plan = {t.name: t for t in plan_tensors(spec, "Q4_0")}
    # ne order, as llama.cpp's loader checks them (key_dim 4 x 32, value_dim 8 x 32, conv_dim 2 x 128 + 256)
    assert plan["blk.0.attn_qkv.weight"].shape == (256, 512)
    assert plan["blk.0.attn_gate.weight"].shape == (256, 256)
    assert plan["blk.0.ssm_conv1d.weight"].shape == (4, 512)
    assert plan["blk.0.ssm_ba.weight"].shape == (256, 16)
    assert plan["blk.0.ssm_out.weight"].shape == (256, 256)
    assert plan["blk.0.ssm_a"].shape == plan["blk.0.ssm_dt.bias"].shape == (8,)
    assert plan["blk.0.ssm_norm.weight"].shape == (32,)
    assert plan["blk.3.attn_q.weight"].shape == (256, 2 * 4 * 64)  # query and gate
    assert plan["blk.3.attn_output.weight"].shape == (4 * 64, 256)
    assert plan["blk.3.ffn_gate_inp_shexp.weight"].shape == (256, 1)
    assert plan["blk.3.ffn_down_shexp.weight"].shape == (128, 256)
    assert plan["blk.0.ssm_a"].fill == "neg_ones"  # -exp(A_log) < 0: the recurrent state decays


def test_tiny_twin_header_keys(tiny: Path) -> None:
    reader = GGUFReader(tiny)
    a = "qwen3next"
    assert field(reader, "general.architecture") == a
    expected = {
        "block_count": 4, "embedding_length": 256, "attention.head_count": 4, "attention.head_count_kv": 2,
        "attention.key_length": 64, "attention.value_length": 64, "rope.dimension_count": 16,
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 128,
        "expert_shared_feed_forward_length": 128, "ssm.conv_kernel": 4, "ssm.state_size": 32,
        "ssm.group_count": 4, "ssm.time_step_rank": 8, "ssm.inner_size": 256, "full_attention_interval": 4,
    }  # fmt: skip
    assert {k: field(reader, f"{a}.{k}") for k in expected} == expected
    assert field(reader, f"{a}.rope.freq_base") == pytest.approx(1e7)
    record = json.loads(field(reader, "flux.synth.spec"))
    assert SynthSpec.model_validate(record) == PRESETS[TINY]


def test_other_twins_record_no_hybrid_fields(tmp_path: Path) -> None:
    # their flux.synth.spec, so their bytes and hashes, are what they were before qwen3next
    record = json.loads(field(GGUFReader(synthesize("tiny-moe", tmp_path / "m.gguf").path), "flux.synth.spec"))
    assert not set(HYBRID_FIELDS) & set(record)


def test_full_preset_has_qwen3_next_80b_a3b_shapes() -> None:
    spec = PRESETS["qwen3-next-80b-a3b"]
    plan = {t.name: t.shape for t in plan_tensors(spec, "Q4_0")}
    kinds = kinds_by_layer(list(plan))
    assert [i for i in range(48) if "ssm_a" not in kinds[i]] == list(range(3, 48, 4))  # 12 attention layers
    assert plan["blk.0.attn_qkv.weight"] == (2048, 2 * 16 * 128 + 32 * 128)
    assert plan["blk.0.ssm_conv1d.weight"] == (4, 8192)
    assert plan["blk.0.ssm_ba.weight"] == (2048, 64)
    assert plan["blk.0.ssm_out.weight"] == (4096, 2048)
    assert plan["blk.3.attn_q.weight"] == (2048, 2 * 16 * 256)
    assert plan["blk.3.attn_k.weight"] == (2048, 2 * 256)
    assert plan["blk.5.ffn_gate_exps.weight"] == (2048, 512, 512)
    assert plan["blk.5.ffn_up_shexp.weight"] == (2048, 512)
    assert plan["token_embd.weight"] == plan["output.weight"] == (2048, 151936)
    assert 44e9 < planned_bytes(spec, "Q4_0") < 46e9  # 79.7 B parameters at 4.5 bits


def test_hybrid_fields_are_checked() -> None:
    base = PRESETS[TINY].model_dump()
    with pytest.raises(ValueError, match="multiple of ssm_n_group"):
        SynthSpec.model_validate({**base, "ssm_dt_rank": 6})
    with pytest.raises(ValueError, match="needs n_expert"):
        SynthSpec.model_validate({**base, "full_attn_interval": 0})
    with pytest.raises(ValueError, match="qwen3next only"):
        SynthSpec.model_validate({**PRESETS["tiny-moe"].model_dump(), "n_ff_shexp": 64})


def test_llama_cpp_loads_and_generates_deterministically(tiny: Path) -> None:
    runs = greedy_twice(tiny, "qwen3next")
    assert runs[0] == runs[1]


def test_flux_inspect_reads_the_twin(flux: Any, tmp_path: Path) -> None:
    model = tmp_path / "t.gguf"
    made = flux("synth", "--like", TINY, "-o", str(model))
    assert made.returncode == 0, made.stderr
    out = flux("inspect", str(model), "--json", "--no-hash")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["architecture"] == "qwen3next" and info["supported"] is True
    assert (info["n_layer"], info["n_expert"], info["n_expert_used"]) == (4, 8, 2)
    assert info["bytes_by_role"]["shared_expert"] > 0 and info["bytes_by_role"]["other"] == 0
    human = flux("inspect", str(model), "--no-hash")
    assert human.returncode == 0 and "qwen3next (supported)" in human.stdout


def test_kv_bytes_count_only_the_full_attention_layers(tiny: Path) -> None:
    # one full-attention layer of four: 2 kv heads x (64 + 64) x 2 bytes at f16
    info = model_info(tiny)
    assert info.kv_bytes_per_token["f16"] == 2 * 128 * 2
    assert info.n_kv_layers == 1


def test_the_recurrent_state_is_what_llama_cpp_allocates(tiny: Path) -> None:
    """llama.cpp printed `RS buffer 0.11 MiB` for the tiny twin's 3 delta-net layers (one sequence): per layer
    (d_conv - 1) x (d_inner + 2 x groups x d_state) + d_state x d_inner f32 values = 3 x 512 + 32 x 256."""
    info = model_info(tiny)
    assert info.recurrent_state_bytes == 3 * 4 * (3 * 512 + 32 * 256)
    assert round(info.recurrent_state_bytes / 2**20, 2) == 0.11


def test_inspect_says_which_layers_hold_a_kv_cache(tiny: Path, flux: Any) -> None:
    res = flux("inspect", str(tiny), timeout=120)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "KV cache on 1 of 4 layers (full attention)" in out and "recurrent" in out
