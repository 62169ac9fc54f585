"""Shape-faithful random-weight twins: synthetic GGUF files with the tensor shapes of real models.

llama.cpp's speed depends on tensor shapes and types, not on the weight values, so a twin of a model is a
faithful benchmark stand-in when two things hold, both built in here:

* MoE routing is realistic: every quant block dequantizes to zero-mean weights (random 4-bit blocks have a
  nonzero mean, whose common component makes every token pick the same experts), the token embedding is
  large and the attention output tiny, and the router is f32 N(0, router_std).
* The output layer is large enough that logits are peaked (see `SynthSpec.logit_std`), yet finite.

The tokenizer is a byte-level BPE (gpt2 model, qwen2 pre-tokenizer) with a few real merges and ChatML
control tokens, so text prompts and `create_chat_completion` work.

The GGUF v3 container is written by hand: GGUFWriter is far too slow for a 17 GB file. Tensor data is
streamed from pools of pre-generated random blocks, at disk speed with a few hundred MB of memory.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType as VT
from gguf import LlamaFileType as FT
from pydantic import BaseModel, ConfigDict, ValidationError

from artifacts.errors import ModelFileError
from artifacts.gguf_encode import kv, kv_array, string
from artifacts.ids import canonical_json
from artifacts.model_info import tensor_layer
from artifacts.synth.catalog import PRESETS
from artifacts.synth.data import padded, write_all, write_data
from artifacts.synth.domains import Domains
from artifacts.synth.domains import check as check_domains
from artifacts.synth.layout import PlannedTensor, plan_tensors, vocab
from artifacts.synth.locality import Locality
from artifacts.synth.locality import check as check_locality
from artifacts.synth.presets import ARCH_FIELDS, CHATML, HYBRID_ARCHES, QUANTS, Quant, SynthSpec
from artifacts.synth.routing import RouterTransform, skewed_router

# fmt: off
__all__ = [
    "PRESETS", "QUANTS", "PlannedTensor", "Quant", "SynthResult", "SynthSpec",
    "apply_overrides", "plan_tensors", "planned_bytes", "synthesize",
]
# fmt: on

logger = logging.getLogger(__name__)

# Q4_K has no exact ftype (llama-quantize's Q4_K_S also mixes in Q5_K): Q4_K_S is the nearest.
_FILE_TYPE = {"F16": FT.MOSTLY_F16, "Q8_0": FT.MOSTLY_Q8_0, "Q4_0": FT.MOSTLY_Q4_0, "Q4_K": FT.MOSTLY_Q4_K_S}


class SynthResult(BaseModel):
    """A written twin."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Path
    preset: str
    quant: Quant
    n_tensors: int
    file_bytes: int
    seconds: float


def apply_overrides(spec: SynthSpec, overrides: dict[str, str]) -> SynthSpec:
    """Return `spec` with some fields replaced, converting text values to the fields' types.

    Args:
        spec: the spec to start from.
        overrides: field name -> value, e.g. `{"n_layer": "4", "n_expert": "64"}` (from `--set k=v`).

    Raises:
        ValueError: an unknown field (the message lists the valid ones) or a value that does not convert
            or makes the spec inconsistent.
    """
    valid = list(SynthSpec.model_fields)
    for key in overrides:
        if key not in SynthSpec.model_fields:
            raise ValueError(f"unknown synth override {key!r}; valid keys: {', '.join(valid)}")
    try:
        return SynthSpec.model_validate({**spec.model_dump(), **overrides})
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or 'spec'}: {err['msg']}" for err in e.errors()
        )
        raise ValueError(f"synth overrides {overrides}: {problems}") from None


def planned_bytes(
    spec_or_preset: SynthSpec | str,
    quant: Quant = "Q4_0",
    overrides: dict[str, str] | None = None,
    seed: int = 0,
) -> int:
    """Return the exact size in bytes of the file `synthesize` would write with these arguments, cheaply."""
    name, spec = _resolve(spec_or_preset, overrides, quant, seed)
    plan = plan_tensors(spec, quant)
    header, _ = _layout(spec, plan, name, quant, seed)
    return len(header) + _data_bytes(plan)


def synthesize(
    spec_or_preset: SynthSpec | str,
    out: Path,
    quant: Quant = "Q4_0",
    overrides: dict[str, str] | None = None,
    seed: int = 0,
) -> SynthResult:
    """Write a synthetic GGUF twin.

    The file is written under a temporary name in the same directory and renamed into place, so a
    process that dies mid-write never leaves a partial file under `out` (there is no fsync: a power
    loss right after the rename can still lose data).

    Args:
        spec_or_preset: a `SynthSpec` or a key of `PRESETS`.
        out: the file to write; its directory is created.
        quant: the type of the 2-D/3-D weights; output.weight is Q6_K for 4-bit quants.
        overrides: spec fields to replace, see `apply_overrides`.
        seed: seed of the random weights; the same arguments give the same bytes.

    Raises:
        ValueError: unknown preset, quant or override, or a negative seed.
        ModelFileError: the written file does not have the planned size.
        OSError: the file cannot be written.
    """
    name, spec = _resolve(spec_or_preset, overrides, quant, seed)
    plan = plan_tensors(spec, quant)
    header, sizes = _layout(spec, plan, name, quant, seed)
    total = len(header) + _data_bytes(plan)
    locality: Locality | Domains | None = None
    if spec.routing in ("local", "domains"):
        check = check_locality if spec.routing == "local" else check_domains
        for qt in {t.ggml_type for t in plan if t.fill == "blocks" and t.name != "output.weight"}:
            check(spec, qt)
        locality = Locality(spec, seed) if spec.routing == "local" else Domains(spec, seed)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    logger.info("synth %s %s: %d tensors, %.3f GB -> %s", name, quant, len(plan), total / 1e9, out)
    t0 = time.perf_counter()
    try:
        with open(tmp, "wb", buffering=0) as f:
            write_all(f, memoryview(header))
            router = locality.router() if locality else _router(spec, seed)
            k = len(plan) - sum(1 for t in plan if (tensor_layer(t.name) or 0) >= spec.n_layer)
            write_data(f, plan[:k], sizes[:k], np.random.default_rng(seed), router, locality)
            # next-token blocks after the trunk, from their own draws: the trunk is the twin without them
            write_data(f, plan[k:], sizes[k:], np.random.default_rng([seed, _MTP_STREAM]), router, locality)
        written = tmp.stat().st_size
        if written != total:
            raise ModelFileError(out, f"synthesizer wrote {written} bytes, planned {total}: report this bug")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    seconds = time.perf_counter() - t0
    logger.info("synth %s: %.3f GB in %.1f s (%.0f MB/s)", out, total / 1e9, seconds, total / 1e6 / seconds)
    return SynthResult(
        path=out, preset=name, quant=quant, n_tensors=len(plan), file_bytes=total, seconds=seconds
    )


# ---- plan ----------------------------------------------------------------------------------------------


_MTP_STREAM = 0x3A7  # the random stream of next-token blocks, apart from the trunk's


def cached_twin(cache_dir: Path, preset: str, quant: Quant = "Q4_0", routing: str = "uniform") -> Path:
    """``preset``'s twin in ``cache_dir/models``, synthesized on first use (one shared copy per quant and routing)."""
    suffix = "" if routing == "uniform" else f"-{routing}"
    path = cache_dir / "models" / f"{preset}-{quant}{suffix}.gguf"
    if not path.exists():
        synthesize(preset, path, quant=quant, overrides={"routing": routing} if suffix else None)
    return path


def _resolve(
    spec_or_preset: SynthSpec | str, overrides: dict[str, str] | None, quant: Quant, seed: int
) -> tuple[str, SynthSpec]:
    """Check the arguments and return (preset name or "custom", spec with overrides)."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; choose one of {', '.join(QUANTS)}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if isinstance(spec_or_preset, SynthSpec):
        name, spec = "custom", spec_or_preset
    elif spec_or_preset in PRESETS:
        name, spec = spec_or_preset, PRESETS[spec_or_preset]
    else:
        raise ValueError(f"unknown synth preset {spec_or_preset!r}; presets: {', '.join(PRESETS)}")
    return name, apply_overrides(spec, overrides) if overrides else spec


def _router(spec: SynthSpec, seed: int) -> RouterTransform | None:
    """The router transform of the spec's routing profile (None: the random router as drawn)."""
    if spec.routing == "uniform":
        return None
    return skewed_router(spec.n_expert, spec.n_expert_used, spec.routing_top_half, seed)


def _spec_record(spec: SynthSpec) -> dict[str, Any]:
    """The spec as flux.synth.spec records it; a uniform twin's record leaves the routing fields out, and every
    twin the fields of other architectures (ARCH_FIELDS: records, hence bytes, as before those fields)."""
    record = spec.model_dump(mode="json")
    if spec.routing == "uniform":
        for key in ("routing", "routing_top_half"):
            record.pop(key)
    if spec.routing != "local":
        record.pop("routing_repeat")
    if spec.routing != "domains":
        record.pop("routing_overlap")
    for key, arches in ARCH_FIELDS.items():
        if spec.arch not in arches:
            record.pop(key)
    return record


def _data_bytes(plan: Iterable[PlannedTensor]) -> int:
    """Bytes of the data section: every tensor padded to ALIGN."""
    return sum(padded(t.nbytes) for t in plan)


def _layout(
    spec: SynthSpec, plan: list[PlannedTensor], name: str, quant: Quant, seed: int
) -> tuple[bytes, list[int]]:
    """Return (header padded to ALIGN, tensor data sizes)."""
    kvs = _metadata(spec, name, quant, seed)
    infos, sizes, off = [], [], 0
    for t in plan:
        dims = struct.pack(f"<I{len(t.shape)}Q", len(t.shape), *t.shape)
        infos.append(string(t.name) + dims + struct.pack("<IQ", t.ggml_type, off))
        sizes.append(t.nbytes)
        off += padded(t.nbytes)
    header = b"GGUF" + struct.pack("<IQQ", 3, len(plan), len(kvs)) + b"".join(kvs) + b"".join(infos)
    return header + b"\0" * (padded(len(header)) - len(header)), sizes


def _metadata(spec: SynthSpec, name: str, quant: Quant, seed: int) -> list[bytes]:
    """GGUF key/values: general, architecture hparams, tokenizer, and flux.synth.* to recognise a twin."""
    u32, f32, s = VT.UINT32, VT.FLOAT32, VT.STRING
    a = spec.arch
    hparams = {
        "block_count": spec.n_layer + spec.n_mtp, "context_length": spec.n_ctx_train, "embedding_length": spec.n_embd,
        "feed_forward_length": spec.n_ff, "attention.head_count": spec.n_head,
        "attention.head_count_kv": spec.n_head_kv, "attention.key_length": spec.head_dim,
        "attention.value_length": spec.head_dim, "rope.dimension_count": spec.n_rot or spec.head_dim,
        "vocab_size": spec.n_vocab,
    }  # fmt: skip
    if not spec.n_ff:  # the config has no intermediate_size: the converter writes no feed_forward_length
        del hparams["feed_forward_length"]
    if spec.arch == "minicpm":  # MiniCPMModel writes no head_dim keys (its config has none): n_embd / n_head
        for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
            del hparams[key]
    if spec.arch == "gemma3":  # Gemma3Model writes no rope.dimension_count (llama.cpp: head_dim), and the window
        del hparams["rope.dimension_count"]
        if spec.n_swa:
            hparams["attention.sliding_window"] = spec.n_swa
    if spec.n_expert:
        hparams |= {"expert_count": spec.n_expert, "expert_used_count": spec.n_expert_used}
    if spec.arch in ("qwen3moe", *HYBRID_ARCHES):
        hparams["expert_feed_forward_length"] = spec.n_ff_exp
    if spec.arch in HYBRID_ARCHES:
        hparams |= _hybrid_hparams(spec)
    if spec.n_mtp:
        hparams["nextn_predict_layers"] = spec.n_mtp
    kvs = [
        kv("general.architecture", s, a),
        kv("general.name", s, f"flux-synth-{name}-{quant}"),
        kv("general.file_type", u32, _FILE_TYPE[quant]),
        kv("general.quantization_version", u32, 2),
        *(kv(f"{a}.{key}", u32, value) for key, value in hparams.items()),
        kv(f"{a}.rope.freq_base", f32, spec.rope_base),
        *([kv(f"{a}.rope.freq_base_swa", f32, spec.rope_base_swa)] if spec.rope_base_swa else []),
        kv(f"{a}.attention.layer_norm_rms_epsilon", f32, spec.eps),
        *_layer_arrays(spec),
        *_mup_scales(spec),
    ]
    tokens, types, merges = vocab(spec.n_vocab)
    bos, eos = spec.n_vocab - 3, spec.n_vocab - 1  # <|endoftext|>, <|im_end|>
    kvs += [
        kv("tokenizer.ggml.model", s, "gpt2"),
        kv("tokenizer.ggml.pre", s, "qwen2"),
        kv_array("tokenizer.ggml.tokens", s, tokens),
        kv_array("tokenizer.ggml.token_type", VT.INT32, types),
        kv_array("tokenizer.ggml.merges", s, merges),
        kv("tokenizer.ggml.bos_token_id", u32, bos),
        kv("tokenizer.ggml.eos_token_id", u32, eos),
        kv("tokenizer.ggml.padding_token_id", u32, bos),
        kv("tokenizer.ggml.add_bos_token", VT.BOOL, False),
        kv("tokenizer.chat_template", s, CHATML),
        kv("flux.synth.preset", s, name),
        kv("flux.synth.seed", VT.UINT64, seed),
        kv("flux.synth.spec", s, canonical_json(_spec_record(spec))),
    ]
    return kvs


def _layer_arrays(spec: SynthSpec) -> list[bytes]:
    """qwen35moe's array keys, as Qwen3_5MoeTextModel writes them from a config with layer_types and
    rope_parameters.mrope_section: which layers are recurrent (bool per layer) and the rope sections (int32)."""
    if spec.arch != "qwen35moe":
        return []
    recurrent = [spec.is_recurrent(i) for i in range(spec.n_layer)] + [False] * spec.n_mtp  # MTP: attention
    return [
        kv_array(f"{spec.arch}.attention.recurrent_layers", VT.BOOL, recurrent),
        kv_array(f"{spec.arch}.rope.dimension_sections", VT.INT32, list(spec.rope_sections)),
    ]


def _mup_scales(spec: SynthSpec) -> list[bytes]:
    """minicpm's keys as conversion/minicpm.py's MiniCPMModel writes them: its muP scales (f32) and, with
    LongRoPE, the rope scaling type."""
    if spec.arch != "minicpm":
        return []
    a, f32 = spec.arch, VT.FLOAT32
    kvs = [
        kv(f"{a}.embedding_scale", f32, spec.scale_emb),
        kv(f"{a}.residual_scale", f32, spec.scale_depth / spec.n_layer**0.5),
        kv(f"{a}.logit_scale", f32, spec.n_embd / spec.dim_model_base),
    ]
    if spec.longrope:
        kvs.append(kv(f"{a}.rope.scaling.type", VT.STRING, "longrope"))
    return kvs


def _hybrid_hparams(spec: SynthSpec) -> dict[str, int]:
    """qwen3next's and qwen35moe's keys as convert_hf_to_gguf's Qwen3NextModel writes them (all u32)."""
    return {
        "expert_shared_feed_forward_length": spec.n_ff_shexp,
        "ssm.conv_kernel": spec.ssm_d_conv,
        "ssm.state_size": spec.ssm_d_state,
        "ssm.group_count": spec.ssm_n_group,
        "ssm.time_step_rank": spec.ssm_dt_rank,
        "ssm.inner_size": spec.ssm_d_state * spec.ssm_dt_rank,
        "full_attention_interval": spec.full_attn_interval,
    }
