"""`flux convert` with the pinned llama.cpp's own converter (unpacked from the checked sdist the backend build uses).

What runs everywhere: the converter unpacked from the sdist and the architectures it registers, and the bad input
(no checkpoint, an architecture it does not know, the `convert` extra missing), each one line and exit 2.

With the `convert` extra installed (CI does not install it), tiny random checkpoints written here are converted,
inspected and loaded by the real llama.cpp: a Mixtral-shaped MoE whose vocabulary is a SentencePiece model trained
here (the Llama converter reads ``tokenizer.model`` first), and a Qwen3-MoE-shaped one. The Qwen converter takes a
BPE ``tokenizer.json`` only when the hash of a test string's tokens names a pre-tokenizer it knows, so a made-up
tokenizer is refused; the real Qwen2 vocabulary and merges come from the pinned sdist's own
``models/ggml-vocab-qwen2.gguf`` (llama.cpp's tokenizer test file), rebuilt here into a ``tokenizer.json``.
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine_bridge.convert import converter_dir, known_architectures, missing_extra, sdist_path
from tests.conftest import FluxRunner

# the backend build's cache (the one tests/conftest.py links the isolated environments' backend to)
REAL_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flux"
MISSING = missing_extra()
needs_extra = pytest.mark.skipif(bool(MISSING), reason=f"the convert extra is missing ({', '.join(MISSING)}): "
                                                       "pip install -e '.[convert]' (CI does not install it)")
# Qwen2's pre-tokenizer regex, as its tokenizer.json spells it (llama-vocab.cpp quotes it for LLAMA_VOCAB_PRE_TYPE_QWEN2)
QWEN2_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


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
def test_a_directory_that_is_no_checkpoint_is_one_line(flux: FluxRunner, tmp_path: Path,
                                                       make: Callable[[Path], Path], says: str) -> None:
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


def _weights(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, Any]:
    """Random float32 tensors (norms all ones), as a checkpoint's safetensors holds them."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {name: np.ones(shape, np.float32) if name.endswith("norm.weight")
            else (rng.standard_normal(shape) * 0.02).astype(np.float32) for name, shape in shapes.items()}


def _attention(p: str, h: int, nh: int, nkv: int, hd: int) -> dict[str, tuple[int, ...]]:
    return {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nh * hd, h), p + "self_attn.k_proj.weight": (nkv * hd, h),
            p + "self_attn.v_proj.weight": (nkv * hd, h), p + "self_attn.o_proj.weight": (h, nh * hd)}


def _tiny_mixtral(ckpt: Path) -> dict[str, int]:
    """A random Mixtral checkpoint (2 layers of 4 experts, 2 per token) with a SentencePiece vocabulary trained here."""
    import sentencepiece as spm
    from safetensors.numpy import save_file

    words = ("the a of model expert token layer weight plan measure flux llama convert tiny random checkpoint gguf "
             "route gate up down attention head norm cache prompt decode").split()
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) for i in range(400)]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(ckpt / "tokenizer"),
                                   vocab_size=300, model_type="bpe", byte_fallback=True, unk_id=0, bos_id=1, eos_id=2,
                                   pad_id=-1, character_coverage=1.0, minloglevel=2)
    (ckpt / "tokenizer.vocab").unlink()
    n_vocab = spm.SentencePieceProcessor(model_file=str(ckpt / "tokenizer.model")).vocab_size()
    h, nh, nkv, ff, n_exp, n_layer = 64, 4, 2, 128, 4, 2
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": n_vocab, "hidden_size": h,
           "intermediate_size": ff, "num_hidden_layers": n_layer, "num_attention_heads": nh,
           "num_key_value_heads": nkv, "num_local_experts": n_exp, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5,
           "rope_theta": 1e6, "max_position_embeddings": 2048, "tie_word_embeddings": False, "hidden_act": "silu",
           "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (n_vocab, h), "lm_head.weight": (n_vocab, h),
                                          "model.norm.weight": (h,)}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        shapes |= _attention(p, h, nh, nkv, h // nh) | {p + "block_sparse_moe.gate.weight": (n_exp, h)}
        for j in range(n_exp):
            e = f"{p}block_sparse_moe.experts.{j}."
            shapes |= {e + "w1.weight": (ff, h), e + "w3.weight": (ff, h), e + "w2.weight": (h, ff)}
    save_file(_weights(shapes), str(ckpt / "model.safetensors"))
    return {"n_layer": n_layer, "n_expert": n_exp, "n_vocab": n_vocab}


def _qwen2_tokenizer(out: Path) -> Path:
    """Qwen2's real tokenizer.json (the Qwen3 family's), rebuilt from the pinned sdist's ggml-vocab-qwen2.gguf."""
    from gguf import GGUFReader
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    with tarfile.open(sdist_path(REAL_CACHE)) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf"))
        member.name = "qwen2.gguf"
        tar.extractall(out, members=[member], filter="data")
    fields = GGUFReader(out / "qwen2.gguf").fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
    types = fields["tokenizer.ggml.token_type"].contents()
    vocab = {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k == 1}  # NORMAL
    special = [t for t, k in zip(tokens, types, strict=True) if k != 1 and not t.startswith("[PAD")]  # <|endoftext|>, <|im_*|>
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    folder = out / "tokenizer"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "add_prefix_space": False, "model_max_length": 4096}))
    return folder


def _tiny_qwen3_moe(ckpt: Path, tokenizer: Path) -> dict[str, int]:
    """A random Qwen3-MoE checkpoint: 2 layers of 4 experts (2 per token), the family's real tokenizer."""
    from safetensors.numpy import save_file

    for f in tokenizer.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    n_vocab, h, hd, nh, nkv, ff, n_exp, n_layer = 151936, 64, 16, 4, 2, 32, 4, 2  # Qwen3's padded vocabulary
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": n_vocab,
           "hidden_size": h, "intermediate_size": 4 * h, "moe_intermediate_size": ff, "num_hidden_layers": n_layer,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "num_experts": n_exp,
           "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
           "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096, "tie_word_embeddings": True,
           "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 151643, "eos_token_id": 151645}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (n_vocab, h), "model.norm.weight": (h,)}
    for i in range(n_layer):
        p = f"model.layers.{i}."
        shapes |= _attention(p, h, nh, nkv, hd) | {
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,), p + "mlp.gate.weight": (n_exp, h)}
        for j in range(n_exp):
            e = f"{p}mlp.experts.{j}."
            shapes |= {e + "gate_proj.weight": (ff, h), e + "up_proj.weight": (ff, h), e + "down_proj.weight": (h, ff)}
    save_file(_weights(shapes), str(ckpt / "model.safetensors"))
    return {"n_layer": n_layer, "n_expert": n_exp, "n_vocab": n_vocab}


def _convert_and_generate(flux: FluxRunner, ckpt: Path, outtype: str, out: Path, arch: str,
                          shape: dict[str, int], prompt: str) -> str:
    """`flux convert` (its `flux inspect` checked), then `flux generate` on the GGUF; the generate output."""
    done = flux("convert", str(ckpt), "--outtype", outtype, "-o", str(out), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.is_file() and f"wrote {out} (" in done.stderr and " MB) in " in done.stderr
    assert f"architecture {arch} (supported)" in done.stdout, done.stdout
    assert f"layers {shape['n_layer']};" in done.stdout and f"vocab {shape['n_vocab']};" in done.stdout
    assert f"experts {shape['n_expert']} total, 2 used per token" in done.stdout
    quants = next(ln for ln in done.stdout.splitlines() if ln.startswith("quant types:"))
    assert f" {outtype.upper()} " in quants and " F32 " in quants, quants  # the weights, and the norms kept in f32
    gen = flux("generate", str(out), "--prompt", prompt, "-n", "8", "--ctx", "256", timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert "8 tokens; prompt" in gen.stdout + gen.stderr, gen.stdout + gen.stderr
    return gen.stdout + gen.stderr


@needs_extra
@pytest.mark.parametrize("outtype", ["f16", "q8_0"])
def test_a_tiny_random_mixtral_checkpoint_converts_and_loads(flux: FluxRunner, tmp_path: Path, outtype: str) -> None:
    _cache_with_sdist()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shape = _tiny_mixtral(ckpt)
    _convert_and_generate(flux, ckpt, outtype, tmp_path / "m.gguf", "llama", shape, "the model expert")


@needs_extra
def test_a_tiny_random_qwen3_moe_checkpoint_converts_and_loads(flux: FluxRunner, tmp_path: Path) -> None:
    _cache_with_sdist()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shape = _tiny_qwen3_moe(ckpt, _qwen2_tokenizer(tmp_path))
    said = _convert_and_generate(flux, ckpt, "q8_0", tmp_path / "m.gguf", "qwen3moe", shape, "Hello world")
    assert "prompt 2 tokens (9707, 1879)" in said  # Qwen's own ids for "Hello" and " world": the real vocabulary
