"""The minicpm (MiniCPM4) twins: muP scales and LongRoPE as llama.cpp's converter writes them, loaded by real llama.cpp."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFReader
from twin_checks import field, greedy_twice, kinds_by_layer, load_log, written_tiny_twin

from artifacts.model_info import model_info
from artifacts.synth import PRESETS, QUANTS, Quant, plan_tensors, planned_bytes, synthesize
from artifacts.synth.presets import SynthSpec

TINY = "tiny-minicpm"
FULL = "minicpm4-8b"
EVERY_LAYER = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
               "ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(TINY, tmp_path_factory.mktemp("mcpm") / "m.gguf", quant="Q4_0").path


@pytest.mark.parametrize("quant", QUANTS)
def test_tiny_twin_lists_the_converters_tensors(tmp_path: Path, quant: Quant) -> None:
    reader = written_tiny_twin(TINY, tmp_path / "m.gguf", quant)
    kinds = kinds_by_layer([t.name for t in reader.tensors])
    assert sorted(kinds) == [0, 1, 2, 3] and all(k == EVERY_LAYER for k in kinds.values())
    top = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors if not t.name.startswith("blk.")}
    # LongRoPE: one factor per rotated pair of a 64-wide head, written once (every layer's loader shares it)
    assert top == {"token_embd.weight": (256, 512), "output_norm.weight": (256,), "output.weight": (256, 512),
                   "rope_factors_long.weight": (32,), "rope_factors_short.weight": (32,)}


def test_tiny_twin_header_keys(tiny: Path) -> None:
    reader = GGUFReader(tiny)
    a = "minicpm"
    assert field(reader, "general.architecture") == a
    expected = {"block_count": 4, "embedding_length": 256, "feed_forward_length": 512, "attention.head_count": 4,
                "attention.head_count_kv": 1, "context_length": 4096}
    assert {k: field(reader, f"{a}.{k}") for k in expected} == expected
    # the converter's muP keys: scale_emb, scale_depth / sqrt(n_layer), hidden_size / dim_model_base
    assert field(reader, f"{a}.embedding_scale") == pytest.approx(12.0)
    assert field(reader, f"{a}.residual_scale") == pytest.approx(1.4 / 2)
    assert field(reader, f"{a}.logit_scale") == pytest.approx(256 / 16)
    assert field(reader, f"{a}.rope.scaling.type") == "longrope"
    for absent in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        assert f"{a}.{absent}" not in reader.fields  # no head_dim in the config: llama.cpp uses n_embd / n_head
    record = json.loads(field(reader, "flux.synth.spec"))
    assert SynthSpec.model_validate(record) == PRESETS[TINY]


def test_other_twins_record_no_minicpm_fields(tmp_path: Path) -> None:
    for preset in ("tiny-dense", "tiny-qwen35moe"):
        record = json.loads(field(GGUFReader(synthesize(preset, tmp_path / f"{preset}.gguf").path), "flux.synth.spec"))
        assert not {"scale_emb", "scale_depth", "dim_model_base", "longrope"} & set(record)


def test_full_preset_has_minicpm4_8b_shapes() -> None:
    spec = PRESETS[FULL]
    plan = {t.name: t.shape for t in plan_tensors(spec, "Q4_0")}
    assert sorted(kinds_by_layer(list(plan))) == list(range(32))
    assert plan["blk.0.attn_q.weight"] == (4096, 4096)
    assert plan["blk.0.attn_k.weight"] == plan["blk.0.attn_v.weight"] == (4096, 2 * 128)
    assert plan["blk.0.ffn_up.weight"] == (4096, 16384) and plan["blk.0.ffn_down.weight"] == (16384, 4096)
    assert plan["token_embd.weight"] == plan["output.weight"] == (4096, 73448)
    assert plan["rope_factors_long.weight"] == (64,)
    # llama.cpp (no_alloc load of this header): 8.19 B params, 4.68 GB at Q4_0
    assert 4.6e9 < planned_bytes(spec, "Q4_0") < 4.8e9


def test_weights_undo_the_mup_scales() -> None:
    """llama.cpp multiplies the embedding by 12, each layer's outputs by 1.4 / sqrt(32) and divides the logits by
    4096 / 256: the twin's weights carry the inverse, so its activations are those of the other deep twins."""
    spec, llama = PRESETS[FULL], PRESETS["llama3-8b"]
    residual = 1.4 / 32**0.5
    assert spec.embd_std * 12 == pytest.approx(1.0, rel=1e-2)
    assert spec.attn_out_std * residual == pytest.approx(llama.attn_out_std, rel=1e-2)  # DEEP_ATTN_OUT
    assert spec.logit_std / 16 == pytest.approx(llama.logit_std)
    assert spec.down_std is not None and spec.down_std * residual == pytest.approx(
        0.15 / 32**0.5 / (0.5 * 16384**0.5), rel=1e-2)  # conditioned's drift for a 32-layer dense FFN


def test_minicpm_fields_are_checked() -> None:
    base = PRESETS[TINY].model_dump()
    with pytest.raises(ValueError, match="needs scale_emb"):
        SynthSpec.model_validate({**base, "scale_depth": 0.0})
    with pytest.raises(ValueError, match="apply to arch minicpm only"):
        SynthSpec.model_validate({**PRESETS["tiny-dense"].model_dump(), "scale_emb": 12.0})


def test_llama_cpp_loads_and_generates_deterministically(tiny: Path) -> None:
    runs = greedy_twice(tiny, "minicpm")
    assert runs[0] == runs[1]


def test_model_info_matches_what_llama_cpp_allocates(tiny: Path) -> None:
    """llama.cpp printed `KV buffer size = 0.25 MiB` (256 cells x 4 layers x 1 kv head x (64 + 64) x 2 bytes),
    `rope scaling = longrope` and the muP scales for the tiny twin; model_info must give the same KV figure."""
    log = load_log(tiny)
    assert re.search(r"rope scaling\s+= longrope", log) and re.search(r"f_embedding_scale\s+= 12\.0", log)
    assert re.search(r"f_residual_scale\s+= 0\.70", log) and re.search(r"f_logit_scale\s+= 1\.6e\+01", log)
    kv = re.search(r"CPU KV buffer size =\s+([\d.]+) MiB", log)
    assert kv and re.search(r"llama_kv_cache: size = .*\(\s*256 cells,\s+4 layers", log)
    info = model_info(tiny)
    assert (info.n_kv_layers, info.recurrent_state_bytes, info.key_length) == (4, 0, 64)
    assert float(kv.group(1)) == round(info.kv_bytes_per_token["f16"] * 256 / 2**20, 2) == 0.25
    assert "RS buffer" not in log  # no recurrent state


def test_flux_inspect_reads_the_twin(flux: Any, tmp_path: Path) -> None:
    model = tmp_path / "t.gguf"
    made = flux("synth", "--like", TINY, "-o", str(model))
    assert made.returncode == 0, made.stderr
    out = flux("inspect", str(model), "--json", "--no-hash")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["architecture"] == "minicpm" and info["supported"] is True
    assert (info["n_layer"], info["n_head_kv"], info["key_length"]) == (4, 1, 64)
    assert info["bytes_by_role"]["other"] == 2 * 32 * 4  # the two f32 LongRoPE factor tensors
    human = flux("inspect", str(model), "--no-hash")
    assert human.returncode == 0 and "minicpm (supported)" in human.stdout
