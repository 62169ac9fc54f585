"""`flux convert` with the pinned llama.cpp's own converter (unpacked from the checked sdist the backend build uses).

What runs everywhere: the converter unpacked from the sdist and the architectures it registers, and the bad input
(no checkpoint, an architecture it does not know, the `convert` extra missing), each one line and exit 2. A real
conversion needs the extra (PyTorch, transformers) and a tokenizer the converter recognizes (it names the
pre-tokenizer by hashing how a test string tokenizes), which no offline test can write: see docs/models.md.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from engine_bridge.convert import converter_dir, known_architectures, missing_extra
from tests.conftest import FluxRunner

# the backend build's cache (the one tests/conftest.py links the isolated environments' backend to)
REAL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flux"
# A Hugging Face tokenizer folder of the Qwen3 family (tokenizer.json, tokenizer_config.json): the converter
# names a BPE pre-tokenizer by the hash of a test string's tokens, so a made-up tokenizer is refused
TOKENIZER = os.environ.get("FLUX_TEST_QWEN3_TOKENIZER", "")


def _cache_with_sdist() -> Path:
    try:
        converter_dir(REAL_CACHE)
    except Exception as exc:  # the backend was never built here: nothing to convert with
        pytest.skip(f"the pinned sdist is not in {REAL_CACHE / 'sdist'} ({exc}); scripts/build-backend.sh fetches it")
    return REAL_CACHE


def _checkpoint(tmp_path: Path, arch: str) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "qwen3_moe"}))
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return ckpt


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert [ln for ln in lines if ln.startswith("error")] == lines[-1:], stderr
    assert "Traceback" not in stderr
    return lines[-1]


def test_the_pinned_converter_knows_the_architectures_flux_plans() -> None:
    conv = converter_dir(_cache_with_sdist())
    assert (conv / "convert_hf_to_gguf.py").is_file() and (conv / "gguf-py" / "gguf").is_dir()
    known = known_architectures(conv)
    assert {"Qwen3MoeForCausalLM", "LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen3NextForCausalLM"} <= known


@pytest.mark.parametrize(("make", "says"), [
    (lambda p: p / "missing", "missing: not a directory"),
    (lambda p: p, "no config.json: not a Hugging Face checkpoint"),
])
def test_a_directory_that_is_no_checkpoint_is_one_line(flux: FluxRunner, tmp_path: Path, make, says: str) -> None:  # type: ignore[no-untyped-def]
    target = make(tmp_path)
    out = flux("convert", str(target), "-o", str(tmp_path / "m.gguf"))
    assert out.returncode == 2
    line = _one_error_line(out.stderr)
    assert f"flux convert {target}" in line and says in line
    assert not (tmp_path / "m.gguf").exists()


def test_an_architecture_the_converter_does_not_know_is_named(flux: FluxRunner, tmp_path: Path) -> None:
    _cache_with_sdist()
    ckpt = _checkpoint(tmp_path, "FluxImaginaryForCausalLM")
    out = flux("convert", str(ckpt), "-o", str(tmp_path / "m.gguf"))
    assert out.returncode == 2
    assert "architecture FluxImaginaryForCausalLM is not known to the pinned llama.cpp's converter" in \
        _one_error_line(out.stderr)


def test_without_the_extra_the_install_line_is_given(flux: FluxRunner, tmp_path: Path) -> None:
    _cache_with_sdist()
    if not missing_extra():
        pytest.skip("the convert extra is installed")
    out = flux("convert", str(_checkpoint(tmp_path, "Qwen3MoeForCausalLM")), "-o", str(tmp_path / "m.gguf"))
    assert out.returncode == 2
    assert "pip install -e '.[convert]'" in _one_error_line(out.stderr)


def _tiny_qwen3_moe(ckpt: Path, tokenizer: Path) -> dict[str, int]:
    """A random Qwen3-MoE checkpoint: 2 layers of 4 experts (2 per token), the family's real tokenizer."""
    import numpy as np
    from safetensors.numpy import save_file

    for f in tokenizer.iterdir():
        if f.name.startswith(("tokenizer", "vocab", "merges", "special_tokens", "generation_config")):
            shutil.copy(f, ckpt / f.name)
    vocab = json.loads((tokenizer / "tokenizer.json").read_text())["model"]["vocab"]
    n_vocab = (max(vocab.values()) + 1 + 400 + 127) // 128 * 128  # the added tokens, padded as Qwen pads
    h, hd, nh, nkv, ff, n_exp, n_layer = 64, 16, 4, 2, 32, 4, 2
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": n_vocab,
           "hidden_size": h, "intermediate_size": 4 * h, "moe_intermediate_size": ff, "num_hidden_layers": n_layer,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "num_experts": n_exp,
           "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
           "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 151643, "eos_token_id": 151645}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    t = {"model.embed_tokens.weight": w(n_vocab, h), "lm_head.weight": w(n_vocab, h),
         "model.norm.weight": np.ones(h, np.float32)}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": np.ones(h, np.float32),
              p + "post_attention_layernorm.weight": np.ones(h, np.float32),
              p + "self_attn.q_proj.weight": w(nh * hd, h), p + "self_attn.k_proj.weight": w(nkv * hd, h),
              p + "self_attn.v_proj.weight": w(nkv * hd, h), p + "self_attn.o_proj.weight": w(h, nh * hd),
              p + "self_attn.q_norm.weight": np.ones(hd, np.float32),
              p + "self_attn.k_norm.weight": np.ones(hd, np.float32), p + "mlp.gate.weight": w(n_exp, h)}
        for j in range(n_exp):
            e = f"{p}mlp.experts.{j}."
            t |= {e + "gate_proj.weight": w(ff, h), e + "up_proj.weight": w(ff, h), e + "down_proj.weight": w(h, ff)}
    save_file(t, str(ckpt / "model.safetensors"))
    return {"n_layer": n_layer, "n_expert": n_exp, "n_vocab": n_vocab}


@pytest.mark.skipif(not TOKENIZER, reason="set FLUX_TEST_QWEN3_TOKENIZER to a Qwen3 tokenizer folder: the "
                                          "converter refuses a tokenizer whose pre-tokenizer it does not recognize")
@pytest.mark.skipif(bool(missing_extra()), reason=f"the convert extra is missing ({', '.join(missing_extra())}): "
                                                  "pip install -e '.[convert]'")
def test_a_tiny_random_qwen3_moe_checkpoint_converts_and_loads(flux: FluxRunner, tmp_path: Path) -> None:
    _cache_with_sdist()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shape = _tiny_qwen3_moe(ckpt, Path(TOKENIZER))
    out = flux("convert", str(ckpt), "--outtype", "f16", "-o", str(tmp_path / "m.gguf"), timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "m.gguf").is_file()
    assert "architecture qwen3moe (supported)" in out.stdout
    assert f"layers {shape['n_layer']};" in out.stdout and f"experts {shape['n_expert']} total, 2 used" in out.stdout
