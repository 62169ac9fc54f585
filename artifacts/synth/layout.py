"""A twin's layout: its tensors in file order (types after the block-size fallback) and its tokenizer.

Declarative like :mod:`artifacts.synth.presets`, whose :class:`~artifacts.synth.presets.SynthSpec` it lays out;
:mod:`artifacts.synth` writes it.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Callable
from typing import Literal, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from artifacts.synth.presets import SPECIALS, Arch, Quant, SynthSpec

# quant -> (type of the 2-D/3-D weights, type of output.weight). Like llama-quantize's recipe, a 4-bit
# model keeps output.weight at Q6_K.
_RECIPES: dict[str, tuple[Q, Q]] = {
    "F16": (Q.F16, Q.F16),
    "Q8_0": (Q.Q8_0, Q.Q8_0),
    "Q4_0": (Q.Q4_0, Q.Q6_K),
    "Q4_K": (Q.Q4_K, Q.Q6_K),
}
# Type for a row length that is not a multiple of the block size (llama-quantize falls back Q4_K->Q5_0,
# which this writer does not produce; Q4_0 is the nearest 4-bit type it does).
_FALLBACK: dict[Q, Q] = {Q.Q4_K: Q.Q4_0, Q.Q6_K: Q.Q8_0, Q.Q4_0: Q.F16, Q.Q8_0: Q.F16}


class PlannedTensor(NamedTuple):
    """One tensor of a twin. `shape` is in ggml order: ne0, the row length, first."""

    name: str
    shape: tuple[int, ...]
    ggml_type: Q
    # pass_first: artifacts.synth.data; const: every value is `std`
    fill: Literal["ones", "neg_ones", "normal", "const", "blocks", "pass_first"]
    std: float

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor data (unpadded)."""
        block, size = GGML_QUANT_SIZES[self.ggml_type]
        return int(np.prod(self.shape, dtype=np.int64)) // block * size


def plan_tensors(spec: SynthSpec, quant: Quant) -> list[PlannedTensor]:
    """List the tensors of a twin in file order, with their types after the block-size fallback.

    A tensor whose row length is not a multiple of its type's block size (256 for K quants, 32 for
    Q4_0/Q8_0) falls back, like llama-quantize does: Q4_K -> Q4_0, Q6_K -> Q8_0, Q4_0/Q8_0 -> F16.
    """
    wt, ot = _RECIPES[quant]
    e, v = spec.n_embd, spec.n_vocab
    plan = [
        _planned("token_embd.weight", (e, v), ot if spec.tied else wt, spec.embd_std),
        _output_norm(spec),
    ]
    if not spec.tied:
        plan.append(_planned("output.weight", (e, v), ot, spec.logit_std / float(np.sqrt(e))))
    if spec.longrope:  # the converter's generate_extra_tensors: one factor per rotated pair (1: plain rope)
        plan += [_planned(f"rope_factors_{k}.weight", (spec.head_dim // 2,), None, 0.0) for k in ("long", "short")]
    for i in range(spec.n_layer):
        plan += _LAYERS[spec.arch](spec, f"blk.{i}.", i, wt)
    for i in range(spec.n_layer, spec.n_layer + spec.n_mtp):
        plan += _mtp_block(spec, f"blk.{i}.", wt)
    return plan


def _output_norm(spec: SynthSpec) -> PlannedTensor:
    """The final norm: ones, but a tied gemma3's is drawn around 0 with the std that gives the logits logit_std.

    Tied, the output scores each token by its embedding against the last hidden state, which the current token's
    embedding dominates (as in every twin: the layers' updates are small next to it); with a norm of ones the
    twin would repeat its input. Gains of either sign make a token's score against its own embedding no larger
    than against another's, as an untied twin's output matrix does."""
    if spec.arch == "gemma3" and spec.tied:
        std = spec.logit_std / (spec.embd_std * spec.n_embd**0.5)
        return PlannedTensor("output_norm.weight", (spec.n_embd,), Q.F32, "normal", float(f"{std:.4g}"))
    return _planned("output_norm.weight", (spec.n_embd,), None, 0.0)


def _mtp_block(spec: SynthSpec, b: str, wt: Q) -> list[PlannedTensor]:
    """A qwen35moe next-token (MTP) block as the converter writes it after the trunk: a full-attention block
    with its experts, then the nextn tensors (HF mtp.fc -> eh_proj, mtp.pre_fc_norm_embedding -> enorm,
    mtp.pre_fc_norm_hidden -> hnorm, mtp.norm -> shared_head_norm; the embedding and the head are the trunk's).
    eh_proj maps [normed embedding; normed hidden state] to the block's input: here it passes the embedding
    of the token the trunk just chose, so the head reads what the trunk would read one position on, little
    changed by the block (its updates are small next to it, as the trunk's are next to its embedding). It is
    written exactly (``pass_first``): in the weight type where gguf can encode it (Q4_0, Q8_0, F16), else Q8_0."""
    e = spec.n_embd
    eh = _planned(b + "nextn.eh_proj.weight", (2 * e, e), wt if wt in (Q.Q4_0, Q.Q8_0, Q.F16) else Q.Q8_0, 0.0)
    return _hybrid_layer(spec, b, -1, wt) + [
        eh._replace(fill="pass_first"),
        _planned(b + "nextn.enorm.weight", (e,), None, 0.0),
        _planned(b + "nextn.hnorm.weight", (e,), None, 0.0),
        _planned(b + "nextn.shared_head_norm.weight", (e,), None, 0.0),
    ]


_Raw = tuple[str, tuple[int, ...], Q | None, float]  # name, shape, weight type (None: f32), std (0: ones)


def _transformer_layer(spec: SynthSpec, b: str, i: int, wt: Q) -> list[PlannedTensor]:
    """One llama/qwen3moe/minicpm block: attention, then a dense FFN or routed experts."""
    e, hd, w = spec.n_embd, spec.head_dim, spec.weight_std
    raw: list[_Raw] = [
        (b + "attn_norm.weight", (e,), None, 0.0),
        (b + "attn_q.weight", (e, spec.n_head * hd), wt, w),
        (b + "attn_k.weight", (e, spec.n_head_kv * hd), wt, w),
        (b + "attn_v.weight", (e, spec.n_head_kv * hd), wt, w),
        (b + "attn_output.weight", (spec.n_head * hd, e), wt, spec.attn_out_std),
        (b + "ffn_norm.weight", (e,), None, 0.0),
    ]
    if spec.arch == "qwen3moe":
        raw += [
            (b + "attn_q_norm.weight", (hd,), None, 0.0),
            (b + "attn_k_norm.weight", (hd,), None, 0.0),
        ]
    if spec.n_expert:
        raw += _routed_experts(spec, b, wt)
    else:
        ff, down = spec.n_ff, spec.down_std or w
        raw += [
            (b + "ffn_gate.weight", (e, ff), wt, w),
            (b + "ffn_down.weight", (ff, e), wt, down),
            (b + "ffn_up.weight", (e, ff), wt, w),
        ]
    return [_planned(*r) for r in raw]


def _routed_experts(spec: SynthSpec, b: str, wt: Q) -> list[_Raw]:
    """The router and the stacked routed experts of a MoE block."""
    e, nx, ff, w = spec.n_embd, spec.n_expert, spec.n_ff_exp, spec.weight_std
    return [
        (b + "ffn_gate_inp.weight", (e, nx), None, spec.router_std),
        (b + "ffn_gate_exps.weight", (e, ff, nx), wt, w),
        (b + "ffn_down_exps.weight", (ff, e, nx), wt, spec.down_std or w),
        (b + "ffn_up_exps.weight", (e, ff, nx), wt, w),
    ]


def _gemma3_layer(spec: SynthSpec, b: str, i: int, wt: Q) -> list[PlannedTensor]:
    """One gemma3 block as the converter writes it: attention with q/k norms and a norm after it, a GELU FFN with a
    norm after it.

    The norm after each part sets the rms of what it adds to the residual stream, whatever the part's weights: its
    gain is the rms the spec's scales give the other twins' updates (attention: attn_out_std over the n_head x
    head_dim values, each of rms weight_std x sqrt(n_embd); FFN: down_std over n_ff, a gated output row of rms
    0.5 x sqrt(width) x std), so
    gemma3 twins are conditioned like them (small updates next to the embedding: rounding in one layer, such as
    an 8-bit activation block flipping a step, stays small instead of being normed up to a unit update).
    """
    e, hd, w = spec.n_embd, spec.head_dim, spec.weight_std
    attn_gain = spec.attn_out_std * (spec.n_head * hd) ** 0.5 * w * e**0.5
    ffn_gain = 0.5 * (spec.down_std or w) * spec.n_ff**0.5
    post = {x: PlannedTensor(b + f"post_{x}_norm.weight", (e,), Q.F32, "const", float(f"{g:.4g}"))
            for x, g in (("attention", attn_gain), ("ffw", ffn_gain))}
    raw: list[_Raw] = [
        (b + "attn_norm.weight", (e,), None, 0.0),
        (b + "attn_q.weight", (e, spec.n_head * hd), wt, w),
        (b + "attn_k.weight", (e, spec.n_head_kv * hd), wt, w),
        (b + "attn_v.weight", (e, spec.n_head_kv * hd), wt, w),
        (b + "attn_output.weight", (spec.n_head * hd, e), wt, w),
        (b + "attn_q_norm.weight", (hd,), None, 0.0),
        (b + "attn_k_norm.weight", (hd,), None, 0.0),
    ]
    ffn: list[_Raw] = [
        (b + "ffn_norm.weight", (e,), None, 0.0),
        (b + "ffn_gate.weight", (e, spec.n_ff), wt, w),
        (b + "ffn_up.weight", (e, spec.n_ff), wt, w),
        (b + "ffn_down.weight", (spec.n_ff, e), wt, w),
    ]
    return [_planned(*r) for r in raw] + [post["attention"]] + [_planned(*r) for r in ffn] + [post["ffw"]]


# std of the delta-net's depthwise conv weights: PyTorch's Conv1d init for a 4-tap kernel, U(-0.5, 0.5)
_CONV_STD = 0.29


def _hybrid_layer(spec: SynthSpec, b: str, i: int, wt: Q) -> list[PlannedTensor]:
    """One qwen3next / qwen35moe block as convert_hf_to_gguf writes it: gated delta-net or gated full
    attention, then routed experts and a sigmoid-gated shared expert."""
    e, hd, w, sh = spec.n_embd, spec.head_dim, spec.weight_std, spec.n_ff_shexp
    plan = [
        _planned(b + "attn_norm.weight", (e,), None, 0.0),
        _planned(b + "post_attention_norm.weight", (e,), None, 0.0),
    ]
    if i >= 0 and spec.is_recurrent(i):  # i < 0: a next-token block, full attention
        plan += _delta_net(spec, b, wt)
    else:
        attn: list[_Raw] = [
            (b + "attn_q.weight", (e, 2 * spec.n_head * hd), wt, w),  # the query and its output gate
            (b + "attn_k.weight", (e, spec.n_head_kv * hd), wt, w),
            (b + "attn_v.weight", (e, spec.n_head_kv * hd), wt, w),
            (b + "attn_output.weight", (spec.n_head * hd, e), wt, spec.attn_out_std),
            (b + "attn_q_norm.weight", (hd,), None, 0.0),
            (b + "attn_k_norm.weight", (hd,), None, 0.0),
        ]
        plan += [_planned(*r) for r in attn]
    ffn = _routed_experts(spec, b, wt) + [
        (b + "ffn_gate_inp_shexp.weight", (e, 1), None, spec.router_std),  # HF's Linear(hidden, 1), kept 2-D
        (b + "ffn_gate_shexp.weight", (e, sh), wt, w),
        (b + "ffn_down_shexp.weight", (sh, e), wt, spec.down_std or w),
        (b + "ffn_up_shexp.weight", (e, sh), wt, w),
    ]
    return plan + [_planned(*r) for r in ffn]


def _delta_net(spec: SynthSpec, b: str, wt: Q) -> list[PlannedTensor]:
    """A gated delta-net's tensors with the converter's fused q/k/v projection (attn_qkv) and gate (attn_gate).

    ssm_a holds -exp(A_log), negative so that the state decays; ssm_dt.bias is 1 as Qwen3-Next initialises it.
    """
    e, w, n_v = spec.n_embd, spec.weight_std, spec.ssm_dt_rank
    key_dim, value_dim = spec.ssm_d_state * spec.ssm_n_group, spec.ssm_d_state * n_v
    conv_dim = 2 * key_dim + value_dim
    return [
        _planned(b + "attn_qkv.weight", (e, conv_dim), wt, w),
        _planned(b + "attn_gate.weight", (e, value_dim), wt, w),
        _planned(b + "ssm_conv1d.weight", (spec.ssm_d_conv, conv_dim), None, _CONV_STD),
        _planned(b + "ssm_dt.bias", (n_v,), None, 0.0),
        PlannedTensor(b + "ssm_a", (n_v,), Q.F32, "neg_ones", 0.0),
        *(_planned(b + name, (e, width), wt, w) for name, width in _DECAY_PROJECTIONS[spec.arch](n_v)),
        _planned(b + "ssm_norm.weight", (spec.ssm_d_state,), None, 0.0),
        _planned(b + "ssm_out.weight", (value_dim, e), wt, spec.attn_out_std),
    ]


# The delta-net's per-head beta (write strength) and alpha (decay) projections, by architecture: Qwen3-Next
# checkpoints fuse them (in_proj_ba -> ssm_ba), Qwen3.5/3.6 keep in_proj_a / in_proj_b apart.
_DECAY_PROJECTIONS: dict[Arch, Callable[[int], list[tuple[str, int]]]] = {
    "qwen3next": lambda n_v: [("ssm_ba.weight", 2 * n_v)],
    "qwen35moe": lambda n_v: [("ssm_alpha.weight", n_v), ("ssm_beta.weight", n_v)],
}


_LAYERS: dict[Arch, Callable[[SynthSpec, str, int, Q], list[PlannedTensor]]] = {
    "llama": _transformer_layer,
    "qwen3moe": _transformer_layer,
    "qwen3next": _hybrid_layer,
    "qwen35moe": _hybrid_layer,
    "minicpm": _transformer_layer,
    "gemma3": _gemma3_layer,
}


def _planned(name: str, shape: tuple[int, ...], t: Q | None, std: float) -> PlannedTensor:
    """Make one PlannedTensor: f32 for norms and router, else `t` after the block-size fallback."""
    if t is None:
        return PlannedTensor(name, shape, Q.F32, "normal" if std else "ones", std)
    while shape[0] % GGML_QUANT_SIZES[t][0]:
        t = _FALLBACK[t]
    return PlannedTensor(name, shape, t, "blocks", std)


def _byte_tokens() -> list[str]:
    """GPT-2's bytes_to_unicode: the printable stand-in of each byte, indexed by byte value."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    shifted = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(shifted)) for b in range(256)]


def vocab(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """Return the tokenizer of a twin: (tokens, token types, merges), `n_vocab` tokens long.

    Tokens are the 256 GPT-2 byte tokens, merged pairs, fillers, then the control tokens `SPECIALS`.
    Merges (" x" for letters, then lowercase bigrams) make real text tokenize a little like a real BPE;
    llama.cpp refuses a gpt2 tokenizer without any. Fillers (never produced by tokenizing) pad the vocab.
    """
    byte_tok = _byte_tokens()
    space = byte_tok[ord(" ")]
    pairs = itertools.chain(
        ((space, c) for c in string.ascii_letters), itertools.product(string.ascii_lowercase, repeat=2)
    )
    n_free = n_vocab - len(byte_tok) - len(SPECIALS)
    merged = list(itertools.islice(pairs, n_free))
    fillers = [f"{space}synth{i}" for i in range(n_free - len(merged))]
    tokens = byte_tok + [x + y for x, y in merged] + fillers + list(SPECIALS)
    types = [1] * (n_vocab - len(SPECIALS)) + [3] * len(SPECIALS)  # 1 normal, 3 control
    return tokens, types, [f"{x} {y}" for x, y in merged]
