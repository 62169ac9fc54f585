"""The qwen35moe (Qwen3.5/3.6 MoE) twins: hybrid layers as llama.cpp's converter writes them, loaded by real llama.cpp."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader
from twin_checks import BUFFER, field, greedy_twice, kinds_by_layer, load_log, written_tiny_twin

from artifacts.model_info import model_info
from artifacts.synth import PRESETS, QUANTS, Quant, plan_tensors, planned_bytes, synthesize
from artifacts.synth.presets import SynthSpec
from artifacts.synth.routing import layer_ranks, router_scales

TINY = "tiny-qwen35moe"
FULL = "qwen3.6-35b-a3b"
RECURRENT = {"attn_qkv.weight", "attn_gate.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_alpha.weight",
             "ssm_beta.weight", "ssm_norm.weight", "ssm_out.weight"}
FULL_ATTENTION = {"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q_norm.weight",
                  "attn_k_norm.weight"}
EVERY_LAYER = {"attn_norm.weight", "post_attention_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
               "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight",
               "ffn_up_shexp.weight", "ffn_down_shexp.weight"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(TINY, tmp_path_factory.mktemp("q35") / "m.gguf", quant="Q4_0").path


@pytest.mark.parametrize("quant", QUANTS)
def test_tiny_twin_lists_recurrent_and_attention_layers(tmp_path: Path, quant: Quant) -> None:
    reader = written_tiny_twin(TINY, tmp_path / "m.gguf", quant)
    kinds = kinds_by_layer([t.name for t in reader.tensors])
    assert sorted(kinds) == [0, 1, 2, 3]
    for layer in (0, 1, 2):  # full_attention_interval 4: layers 0-2 are gated delta-nets
        assert kinds[layer] == EVERY_LAYER | RECURRENT
    assert kinds[3] == EVERY_LAYER | FULL_ATTENTION
    assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= {t.name for t in reader.tensors}


def test_tiny_twin_shapes_are_the_loaders() -> None:
    plan = {t.name: t for t in plan_tensors(PRESETS[TINY], "Q4_0")}
    # ne order, as llama.cpp's qwen35moe loader checks them (key_dim 4 x 32, value_dim 8 x 32)
    assert plan["blk.0.attn_qkv.weight"].shape == (256, 2 * 128 + 256)
    assert plan["blk.0.attn_gate.weight"].shape == (256, 256)
    assert plan["blk.0.ssm_conv1d.weight"].shape == (4, 512)
    assert plan["blk.0.ssm_alpha.weight"].shape == plan["blk.0.ssm_beta.weight"].shape == (256, 8)
    assert "blk.0.ssm_ba.weight" not in plan  # Qwen3-Next's fused projection; Qwen3.5 keeps them apart
    assert plan["blk.0.ssm_out.weight"].shape == (256, 256)
    assert plan["blk.0.ssm_a"].shape == plan["blk.0.ssm_dt.bias"].shape == (8,)
    assert plan["blk.3.attn_q.weight"].shape == (256, 2 * 4 * 64)  # query and gate
    assert plan["blk.3.ffn_gate_inp_shexp.weight"].shape == (256, 1)
    assert plan["blk.3.ffn_gate_exps.weight"].shape == (256, 128, 8)  # gate and up apart, as without --fuse
    assert plan["blk.0.ssm_a"].fill == "neg_ones"


def test_tiny_twin_header_keys(tiny: Path) -> None:
    reader = GGUFReader(tiny)
    a = "qwen35moe"
    assert field(reader, "general.architecture") == a
    expected = {
        "block_count": 4, "embedding_length": 256, "attention.head_count": 4, "attention.head_count_kv": 2,
        "attention.key_length": 64, "attention.value_length": 64, "rope.dimension_count": 16,
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 128,
        "expert_shared_feed_forward_length": 128, "ssm.conv_kernel": 4, "ssm.state_size": 32,
        "ssm.group_count": 4, "ssm.time_step_rank": 8, "ssm.inner_size": 256, "full_attention_interval": 4,
    }  # fmt: skip
    assert {k: field(reader, f"{a}.{k}") for k in expected} == expected
    assert field(reader, f"{a}.attention.recurrent_layers") == [True, True, True, False]
    assert field(reader, f"{a}.rope.dimension_sections") == [3, 3, 2, 0]
    assert f"{a}.feed_forward_length" not in reader.fields  # the config has no intermediate_size
    assert field(reader, f"{a}.rope.freq_base") == pytest.approx(1e7)
    record = json.loads(field(reader, "flux.synth.spec"))
    assert SynthSpec.model_validate(record) == PRESETS[TINY]


def test_other_twins_record_no_qwen35moe_fields(tmp_path: Path) -> None:
    for preset in ("tiny-moe", "tiny-qwen3next"):
        reader = GGUFReader(synthesize(preset, tmp_path / f"{preset}.gguf").path)
        assert "rope_sections" not in json.loads(field(reader, "flux.synth.spec"))


def test_full_preset_has_qwen3_6_35b_a3b_shapes() -> None:
    spec = PRESETS[FULL]
    plan = {t.name: t.shape for t in plan_tensors(spec, "Q4_0")}
    kinds = kinds_by_layer(list(plan))
    assert sorted(kinds) == list(range(40))  # no MTP block
    assert [i for i in range(40) if "ssm_a" not in kinds[i]] == list(range(3, 40, 4))  # 10 attention layers
    assert plan["blk.0.attn_qkv.weight"] == (2048, 2 * 16 * 128 + 32 * 128)
    assert plan["blk.0.attn_gate.weight"] == (2048, 4096)
    assert plan["blk.0.ssm_conv1d.weight"] == (4, 8192)
    assert plan["blk.0.ssm_alpha.weight"] == plan["blk.0.ssm_beta.weight"] == (2048, 32)
    assert plan["blk.0.ssm_out.weight"] == (4096, 2048)
    assert plan["blk.3.attn_q.weight"] == (2048, 2 * 16 * 256)
    assert plan["blk.3.attn_k.weight"] == plan["blk.3.attn_v.weight"] == (2048, 2 * 256)
    assert plan["blk.5.ffn_gate_exps.weight"] == (2048, 512, 256)
    assert plan["blk.5.ffn_down_exps.weight"] == (512, 2048, 256)
    assert plan["blk.5.ffn_up_shexp.weight"] == (2048, 512)
    assert plan["token_embd.weight"] == plan["output.weight"] == (2048, 248320)
    # llama.cpp (no_alloc load of this header): model type 35B.A3B, 34.66 B params, 19.70 GB at Q4_0
    assert 19.5e9 < planned_bytes(spec, "Q4_0") < 20e9
    assert spec.rope_sections == (11, 11, 10, 0) and spec.n_rot == 64 and spec.down_std is not None


def test_qwen35moe_fields_are_checked() -> None:
    base = PRESETS[TINY].model_dump()
    with pytest.raises(ValueError, match="rope_sections"):
        SynthSpec.model_validate({**base, "rope_sections": (4, 4, 2, 0)})
    with pytest.raises(ValueError, match="rope_sections apply to arch qwen35moe only"):
        SynthSpec.model_validate({**PRESETS["tiny-qwen3next"].model_dump(), "rope_sections": (3, 3, 2, 0)})
    with pytest.raises(ValueError, match="needs n_ff"):
        SynthSpec.model_validate({**PRESETS["tiny-moe"].model_dump(), "n_ff": 0})
    with pytest.raises(ValueError, match="needs n_expert"):
        SynthSpec.model_validate({**base, "ssm_d_state": 0})


def test_a_skewed_twin_differs_only_in_its_routers(tmp_path: Path) -> None:
    # the routing profile reshapes the routed experts' router; the shared expert's gate stays as drawn
    uniform = synthesize(TINY, tmp_path / "u.gguf", seed=2)
    skewed = synthesize(TINY, tmp_path / "s.gguf", seed=2, overrides={"routing": "skewed"})
    tu = {t.name: np.asarray(t.data) for t in GGUFReader(uniform.path).tensors}
    ts = {t.name: np.asarray(t.data) for t in GGUFReader(skewed.path).tensors}
    spec = PRESETS[TINY]
    scales, _ = router_scales(spec.n_expert, spec.n_expert_used, 0.9)
    changed = [name for name in tu if not np.array_equal(tu[name], ts[name])]
    assert changed == [f"blk.{i}.ffn_gate_inp.weight" for i in range(4)]
    for i, name in enumerate(changed):
        norms = np.linalg.norm(ts[name], axis=1)
        want = scales[layer_ranks(spec.n_expert, i, seed=2)]
        assert np.allclose(norms / norms.mean(), want / want.mean(), rtol=1e-4)


@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_llama_cpp_loads_and_generates_deterministically(tmp_path: Path, routing: str) -> None:
    path = synthesize(TINY, tmp_path / "m.gguf", overrides={"routing": routing}).path
    runs = greedy_twice(path, "qwen35moe")
    assert runs[0] == runs[1]


def test_model_info_matches_the_buffers_llama_cpp_allocates(tiny: Path) -> None:
    """llama.cpp printed `KV buffer size = 0.12 MiB` (256 cells x 1 attention layer) and `RS buffer size =
    0.11 MiB` (3 delta-net layers, one sequence) for the tiny twin; model_info must say the same."""
    log = load_log(tiny)
    printed = {kind: float(mib) for kind, mib in BUFFER.findall(log)}
    assert re.search(r"llama_kv_cache: size = .*\(\s*256 cells,\s+1 layers", log)  # one attention layer
    info = model_info(tiny)
    assert info.n_kv_layers == 1
    assert printed["KV"] == round(info.kv_bytes_per_token["f16"] * 256 / 2**20, 2) == 0.12
    assert info.recurrent_state_bytes == 3 * 4 * (3 * 512 + 32 * 256)
    assert printed["RS"] == round(info.recurrent_state_bytes / 2**20, 2) == 0.11


def test_flux_inspect_reads_the_twin(flux: Any, tmp_path: Path) -> None:
    model = tmp_path / "t.gguf"
    made = flux("synth", "--like", TINY, "-o", str(model))
    assert made.returncode == 0, made.stderr
    out = flux("inspect", str(model), "--json", "--no-hash")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["architecture"] == "qwen35moe" and info["supported"] is True
    assert (info["n_layer"], info["n_expert"], info["n_expert_used"]) == (4, 8, 2)
    assert info["bytes_by_role"]["shared_expert"] > 0 and info["bytes_by_role"]["other"] == 0
    human = flux("inspect", str(model), "--no-hash")
    assert human.returncode == 0 and "qwen35moe (supported)" in human.stdout
    assert "KV cache on 1 of 4 layers (full attention)" in human.stdout
