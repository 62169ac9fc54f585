"""The synthetic GGUF writer: sizes, headers, weight statistics, overrides, atomic writes (no llama.cpp here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from artifacts import synth
from artifacts.synth import PRESETS, QUANTS, Quant, apply_overrides, plan_tensors, planned_bytes, synthesize
from artifacts.synth import data as synth_data
from artifacts.synth.layout import vocab
from artifacts.synth.presets import MIN_VOCAB, SPECIALS

TINY = ("tiny-dense", "tiny-moe")


def _field(reader: GGUFReader, key: str) -> Any:
    return reader.fields[key].contents()


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("preset", TINY)
def test_tiny_twin_header_matches_plan(tmp_path: Path, preset: str, quant: Quant) -> None:
    result = synthesize(preset, tmp_path / "m.gguf", quant=quant, seed=3)
    spec = PRESETS[preset]
    assert result.file_bytes == (tmp_path / "m.gguf").stat().st_size == planned_bytes(preset, quant)
    assert result.file_bytes < 10_000_000
    assert list(tmp_path.iterdir()) == [tmp_path / "m.gguf"]  # no temp file left behind

    reader = GGUFReader(result.path)
    arch = spec.arch
    assert _field(reader, "general.architecture") == arch
    assert _field(reader, "general.name") == f"flux-synth-{preset}-{quant}"
    assert _field(reader, "flux.synth.preset") == preset
    assert _field(reader, "flux.synth.seed") == 3
    assert _field(reader, f"{arch}.block_count") == spec.n_layer
    if spec.n_expert:
        assert _field(reader, f"{arch}.expert_count") == spec.n_expert
        assert _field(reader, f"{arch}.expert_used_count") == spec.n_expert_used
    plan = plan_tensors(spec, quant)
    assert result.n_tensors == len(plan) == len(reader.tensors)
    for planned, tensor in zip(plan, reader.tensors, strict=True):
        assert tensor.name == planned.name
        assert tuple(int(d) for d in tensor.shape) == planned.shape
        assert tensor.tensor_type == planned.ggml_type


def test_tokenizer_metadata_is_what_llama_cpp_needs(tmp_path: Path) -> None:
    reader = GGUFReader(synthesize("tiny-moe", tmp_path / "m.gguf").path)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert isinstance(tokens, list) and len(tokens) == PRESETS["tiny-moe"].n_vocab
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    assert _field(reader, "tokenizer.ggml.pre") == "qwen2"
    assert _field(reader, "tokenizer.ggml.merges")  # llama.cpp: "cannot find tokenizer merges"
    assert tokens[_field(reader, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert _field(reader, "tokenizer.ggml.add_bos_token") is False
    assert "<|im_start|>" in str(_field(reader, "tokenizer.chat_template"))
    assert reader.fields["flux.synth.seed"].types == [GGUFValueType.UINT64]


def test_vocab_merges_are_consistent() -> None:
    tokens, types, merges = vocab(MIN_VOCAB + 100)
    assert len(tokens) == len(types) == MIN_VOCAB + 100 == len(set(tokens))
    assert tokens[-3:] == list(SPECIALS) and types[-3:] == [3, 3, 3]
    assert merges[0] == "Ġ a"
    for merge in merges:
        left, right = merge.split(" ")
        assert {left, right, left + right} <= set(tokens)


@pytest.mark.parametrize("quant", QUANTS)
def test_weights_are_zero_mean_at_the_planned_std(tmp_path: Path, quant: Quant) -> None:
    # Zero-mean blocks are what keeps MoE routing realistic (notes/llama-cpp.md, "Synthetic GGUF models").
    reader = GGUFReader(synthesize("tiny-moe", tmp_path / "m.gguf", quant=quant).path)
    plan = {t.name: t for t in plan_tensors(PRESETS["tiny-moe"], quant)}
    for tensor in reader.tensors:
        planned = plan[tensor.name]
        w = dequantize(tensor.data, tensor.tensor_type).astype(np.float64)
        if planned.fill == "ones":
            assert np.all(w == 1.0)
            continue
        assert abs(w.mean()) < 5 * planned.std / np.sqrt(w.size), tensor.name  # sampling noise only
        assert w.std() == pytest.approx(planned.std, rel=0.05), tensor.name


def test_output_layer_recipe_and_k_quant_fallback() -> None:
    types = {q: {t.name: t.ggml_type.name for t in plan_tensors(PRESETS["tiny-moe"], q)} for q in QUANTS}
    assert types["Q4_0"]["output.weight"] == types["Q4_K"]["output.weight"] == "Q6_K"
    assert types["Q8_0"]["output.weight"] == "Q8_0" and types["F16"]["output.weight"] == "F16"
    # tiny-moe's n_ff_exp = 128 is not a multiple of 256: Q4_K falls back to Q4_0 for ffn_down_exps only
    assert types["Q4_K"]["blk.0.ffn_down_exps.weight"] == "Q4_0"
    assert types["Q4_K"]["blk.0.ffn_up_exps.weight"] == "Q4_K"
    assert types["Q4_0"]["blk.0.ffn_gate_inp.weight"] == "F32"


def test_big_presets_are_planned_without_writing(tmp_path: Path) -> None:
    assert planned_bytes("qwen3-30b-a3b", "Q4_0") == pytest.approx(17.3e9, rel=0.02)
    assert planned_bytes("qwen3moe-small", "Q4_0") == pytest.approx(0.7e9, rel=0.1)
    # published Q4_0 files made by llama-quantize: 4.66 GB, 0.64 GB, 26.4 GB
    assert planned_bytes("llama3-8b", "Q4_0") == pytest.approx(4.66e9, rel=0.02)
    assert planned_bytes("tinyllama-1.1b", "Q4_0") == pytest.approx(0.64e9, rel=0.03)
    assert planned_bytes("mixtral-8x7b", "Q4_0") == pytest.approx(26.4e9, rel=0.02)
    assert list(tmp_path.iterdir()) == []


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    a = synthesize("tiny-dense", tmp_path / "a.gguf", seed=7).path.read_bytes()
    b = synthesize("tiny-dense", tmp_path / "b.gguf", seed=7).path.read_bytes()
    c = synthesize("tiny-dense", tmp_path / "c.gguf", seed=8).path.read_bytes()
    assert a == b and len(a) == len(c) and a != c


def test_overrides_convert_text_and_reach_the_file(tmp_path: Path) -> None:
    spec = apply_overrides(PRESETS["tiny-moe"], {"n_layer": "2", "rope_base": "1e4", "tied": "true"})
    assert (spec.n_layer, spec.rope_base, spec.tied) == (2, 10000.0, True)
    result = synthesize("tiny-moe", tmp_path / "m.gguf", overrides={"n_layer": "2", "n_expert": "4"})
    reader = GGUFReader(result.path)
    assert _field(reader, "qwen3moe.block_count") == 2
    assert _field(reader, "qwen3moe.expert_count") == 4
    assert _field(reader, "flux.synth.preset") == "tiny-moe"


def test_unknown_override_key_names_it_and_the_valid_keys() -> None:
    with pytest.raises(ValueError, match=r"'n_layers'.*n_layer, n_embd"):
        apply_overrides(PRESETS["tiny-dense"], {"n_layers": "4"})


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"n_layer": "four"}, "n_layer"),
        ({"n_expert_used": "16"}, "n_expert_used"),
        ({"n_vocab": "100"}, "n_vocab"),
    ],
)
def test_bad_override_values_raise(overrides: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        apply_overrides(PRESETS["tiny-moe"], overrides)


def test_unknown_preset_and_quant_raise(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-moe"):
        synthesize("no-such-model", tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="Q4_K"):
        synthesize("tiny-moe", tmp_path / "m.gguf", quant="Q5_K")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(synth, "write_data", fail)
    with pytest.raises(OSError, match="disk full"):
        synthesize("tiny-dense", tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    n_embd=st.sampled_from([48, 64, 96, 256, 320]),
    n_ff=st.sampled_from([64, 96, 256, 288]),
    n_vocab=st.integers(MIN_VOCAB, 700),
    n_expert=st.sampled_from([0, 2, 4]),
    quant=st.sampled_from(QUANTS),
)
def test_any_small_spec_writes_the_planned_bytes(
    tmp_path: Path, n_embd: int, n_ff: int, n_vocab: int, n_expert: int, quant: Quant
) -> None:
    # Odd widths exercise the block-size fallbacks (96 -> no K quant, 48 -> F16 for Q4_0/Q8_0 rows).
    arch = "qwen3moe" if n_expert else "llama"
    base = PRESETS["tiny-moe" if n_expert else "tiny-dense"]
    overrides = {"n_layer": "1", "n_embd": str(n_embd), "n_vocab": str(n_vocab), "n_ff": str(n_ff)}
    if n_expert:
        overrides |= {"n_expert": str(n_expert), "n_expert_used": "2", "n_ff_exp": str(n_ff)}
    result = synthesize(base, tmp_path / "m.gguf", quant=quant, overrides=overrides)
    assert result.file_bytes == result.path.stat().st_size
    reader = GGUFReader(result.path)
    assert _field(reader, "general.architecture") == arch
    assert reader.tensors[0].name == "token_embd.weight"
    assert tuple(int(d) for d in reader.tensors[0].shape) == (n_embd, n_vocab)


def test_output_rows_are_all_distinct_even_when_pooled_chunks_overlap(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Shrink the pools and chunks so a tiny twin's tensors are written as many overlapping chunks, as a
    # real-size twin's are: repeated output rows would be tokens with exactly tied logits.
    monkeypatch.setattr(synth_data, "_POOL_BYTES", 64 * 1024)
    monkeypatch.setattr(synth_data, "_CHUNK_BYTES", 8 * 1024)
    out = tmp_path / "t.gguf"
    synthesize("tiny-dense", out, quant="Q4_0")
    tensors = {t.name: t for t in GGUFReader(out).tensors}

    def distinct_rows(name: str) -> tuple[int, int]:
        t = tensors[name]
        rows = np.asarray(t.data).reshape(int(t.shape[-1]), -1)
        return len(np.unique(rows, axis=0)), rows.shape[0]

    uniq, n = distinct_rows("output.weight")
    assert uniq == n, f"{n - uniq} repeated output rows"
    pooled_uniq, pooled_n = distinct_rows("blk.0.ffn_up.weight")
    assert pooled_uniq < pooled_n, "the pooled tensors do repeat rows at these sizes: the test would prove nothing"
