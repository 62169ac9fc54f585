"""The "local" routing profile: routing with temporal locality, written into a qwen3moe twin's weights.

Real MoE routing has temporal locality: consecutive tokens pick overlapping experts (Qwen3-30B-A3B: about 45% of
a token's picks were picked by the previous token too, docs/routing.md). A twin's router reads a hidden state
that is mostly its token's embedding, so consecutive tokens route independently (the uniform twin repeats
k / n_expert of its picks, 6% for 128 x 8). This profile adds a slowly varying part that the router reads:

* **A constant direction.** Every token's embedding holds the same value ``beta`` in dims ``0..31``, and zeros in
  a *context region* of ``n_slot`` slots of ``head_dim`` dims after it; its other dims are as drawn.
* **A recency head per layer.** Query head 0 reads only the constant dims, and so does key/value head 0's key,
  with the same pattern on the rotated pairs whose frequency is in [1/128, 1/4]: after the per-head norm the
  query and key are fixed vectors, and their rope-rotated product depends on the distance alone,
  ``sqrt(head_dim) * mean_i cos(theta_i * d)``: a softmax window of about 8 recent tokens (weights 0.21, 0.20,
  0.17, 0.13, ... at 128 dims), whatever the context length up to thousands of tokens (at 64 dims, whose
  scores peak at 8 rather than 11.3, far tokens take a growing share beyond ~512 tokens: the twin's locality
  is fitted at 512). Value head 0 reads the
  token dims only (no constant: that would be a static bias), so the head outputs a moving average of recent
  tokens; consecutive averages correlate (0.83 for the window above).
* **A context slot.** The output projection writes head 0 into the layer's slot of the context region
  (``layer % n_slot``), ``gamma`` per dim, where no embedding is; other heads' columns into it are as drawn.
* **A router that reads it.** Each router row keeps its random weights on the token dims, is zero on the
  constant dims and the other slots, and reads its layer's slot with weight ``rho_l``, chosen so that a share
  ``f`` of the router logit's variance is the context's; the whole router is then scaled by ``_ROUTER_GAIN``
  (flatter gate weights, the same picks: see there why). ``f`` is fitted by Monte Carlo to the target share of
  repeated picks (``routing_repeat``, 0.45), with the skewed profile's popularity applied on top (the profile is
  skewed *and* local, as real routing is).

Everything else is drawn as the uniform twin's. The profile needs query/key norms and full attention in every
layer (qwen3moe), and quant blocks this module can write (Q4_0, Q8_0, F16).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants
from numpy.typing import NDArray

from artifacts.synth.layout import PlannedTensor
from artifacts.synth.presets import SynthSpec
from artifacts.synth.routing import RouterTransform, router_scales, skewed_router

CONST_DIMS = 32  # the constant direction: one quant block of every embedding row
_THETA = (1 / 128, 1 / 4)  # rotated pairs of the recency head: a window of ~8 tokens
_KAPPA = 0.35  # each layer's context part, rms per slot dim, in units of the embedding's std
_BETA = 1.0  # the constant dims' value, in units of the embedding's std
_WRITABLE = (Q.Q4_0, Q.Q8_0, Q.F16)
# The router's logits are scaled by this after the fit (the picks, a top-k, do not change; the gate weights of the
# picked experts flatten). A router that reads a computed context is as exact as that context: CPU flash
# attention accumulates the recency head's values in f16, and at the uniform twin's logit scale the picked
# experts' weights moved enough with it that flash attention, a correct kernel, differed from the reference by a
# mean KL of 1.2e-2 (16-layer qwen3moe-small twin, random tokens; the skewed twin: 9.4e-4), above the quality
# gate's cap. At 0.25 it is 1.8e-3 (x2: 2.2e-2, x0.5: 4.4e-3).
_ROUTER_GAIN = 0.25
_FIT_TOKENS = 4096


def check(spec: SynthSpec, quant_type: Q) -> None:
    """Raise ValueError when the profile cannot be written for this spec and weight type."""
    if spec.arch != "qwen3moe":
        raise ValueError(f"routing=local is written into qwen3moe twins (query/key norms and full attention in every "
                         f"layer), not {spec.arch}: use routing=skewed")
    if quant_type not in _WRITABLE:
        raise ValueError(f"routing=local writes its weights as Q4_0, Q8_0 or F16 blocks, not {quant_type.name}: "
                         "use --quant Q4_0")
    if n_slots(spec) < 1:
        raise ValueError(f"routing=local needs n_embd >= {2 * (CONST_DIMS + spec.head_dim)} for its context region")


def n_slots(spec: SynthSpec) -> int:
    """Context slots: up to 4, leaving at least half of the dims to the token embedding."""
    return max(0, min(4, (spec.n_embd // 2 - CONST_DIMS) // spec.head_dim))


def window(head_dim: int, rope_base: float, n_ctx: int = 512) -> NDArray[np.float64]:
    """The recency head's attention weights over distances 0..n_ctx-1 (softmax of its rope-only scores)."""
    theta = rope_base ** (-2 * np.arange(head_dim // 2) / head_dim)
    pairs = np.flatnonzero((theta >= _THETA[0]) & (theta <= _THETA[1]))
    d = np.arange(n_ctx)
    score = math.sqrt(head_dim) * np.cos(np.outer(d, theta[pairs])).mean(axis=1)
    w = np.exp(score - score.max())
    return np.asarray(w / w.sum(), dtype=np.float64)


def _pairs(spec: SynthSpec) -> NDArray[np.int64]:
    theta = spec.rope_base ** (-2 * np.arange(spec.head_dim // 2) / spec.head_dim)
    return np.flatnonzero((theta >= _THETA[0]) & (theta <= _THETA[1]))


@functools.lru_cache(maxsize=16)
def context_share(n_expert: int, n_expert_used: int, top_half: float, corr: float, repeat: float) -> float:
    """The share ``f`` of router-logit variance from the context that repeats ``repeat`` of the picks on the next
    token, when consecutive context parts correlate ``corr`` and the skewed profile's popularity applies."""
    scales, _ = router_scales(n_expert, n_expert_used, top_half)
    rng = np.random.default_rng(7)
    z_tok = rng.standard_normal((_FIT_TOKENS, n_expert))
    noise = rng.standard_normal((_FIT_TOKENS, n_expert))
    ctx = np.empty_like(noise)
    ctx[0] = noise[0]
    for t in range(1, _FIT_TOKENS):
        ctx[t] = corr * ctx[t - 1] + math.sqrt(1 - corr**2) * noise[t]

    def repeated(f: float) -> float:
        logits = scales * (math.sqrt(1 - f) * z_tok + math.sqrt(f) * ctx)
        top = np.argpartition(-logits, n_expert_used - 1, axis=1)[:, :n_expert_used]
        picked = np.zeros(logits.shape, dtype=bool)
        np.put_along_axis(picked, top, True, axis=1)
        return float((picked[1:] & picked[:-1]).sum() / ((_FIT_TOKENS - 1) * n_expert_used))

    lo, hi = 0.0, 0.995
    if repeated(hi) < repeat:
        raise ValueError(f"routing_repeat {repeat} is more than this profile reaches ({repeated(hi):.2f})")
    for _ in range(14):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if repeated(mid) < repeat else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Locality:
    """What the profile writes into one twin (see the module's docstring)."""

    spec: SynthSpec
    seed: int

    @functools.cached_property
    def slots(self) -> int:
        return n_slots(self.spec)

    @functools.cached_property
    def token_dims(self) -> int:
        return self.spec.n_embd - CONST_DIMS - self.slots * self.spec.head_dim

    def slot(self, layer: int) -> slice:
        start = CONST_DIMS + (layer % self.slots) * self.spec.head_dim
        return slice(start, start + self.spec.head_dim)

    @functools.cached_property
    def gamma(self) -> float:
        """Output weight of head 0 into its slot: the slot's context part gets rms ``_KAPPA * embd_std``."""
        s = self.spec
        w = window(s.head_dim, s.rope_base)
        # value head 0 reads the token dims of the normed hidden state (rms ~1 there): one output dim has std
        # weight_std * sqrt(token dims); the window averages that over ~8 tokens
        v_std = s.weight_std * math.sqrt(self.token_dims) * math.sqrt(float((w**2).sum()))
        return _KAPPA * s.embd_std / v_std

    @functools.cached_property
    def share(self) -> float:
        """The share of router-logit variance the context gets (fitted to ``routing_repeat``)."""
        s = self.spec
        w = window(s.head_dim, s.rope_base)
        corr = float((w[1:] * w[:-1]).sum() / (w**2).sum())
        return context_share(s.n_expert, s.n_expert_used, s.routing_top_half, corr, s.routing_repeat)

    def rho(self, layer: int) -> float:
        """Router weight on the layer's slot, relative to its random weights on the token dims."""
        writers = layer // self.slots + 1  # layers that wrote into this slot by now (their parts add up)
        ctx_var = self.spec.head_dim * writers * _KAPPA**2
        return math.sqrt(self.share / (1 - self.share) * self.token_dims / ctx_var)

    # ---- quant tensors ------------------------------------------------------------------------------

    def claims(self, name: str) -> bool:
        return name == "token_embd.weight" or name.rsplit(".", 2)[-2] in ("attn_q", "attn_k", "attn_v", "attn_output")

    def edit(self, t: PlannedTensor, data: NDArray[np.uint8]) -> None:
        """Write the profile's structure into a claimed tensor's drawn bytes, ``data`` shaped [rows, row bytes]."""
        s, hd = self.spec, self.spec.head_dim
        region = CONST_DIMS + self.slots * hd
        if t.name == "token_embd.weight":
            seg = np.zeros((1, region))
            seg[0, :CONST_DIMS] = _BETA * s.embd_std
            data[:, : self._nbytes(t, region)] = self._quant(t, seg)
            return
        layer, kind = int(t.name.split(".")[1]), t.name.split(".")[2]
        if kind in ("attn_q", "attn_k"):  # head 0 (query head 0, key/value head 0) reads the constant dims
            rows = np.zeros((hd, s.n_embd))
            rows[_pairs(s), :CONST_DIMS] = 1.0
            data[:hd] = self._quant(t, rows)
        elif kind == "attn_v":  # value head 0 reads the token dims only
            data[:hd, : self._nbytes(t, region)] = self._quant(t, np.zeros((hd, region)))
        else:  # attn_output: head 0's columns write into the layer's slot only
            cols = np.zeros((s.n_embd, hd))
            sl = self.slot(layer)
            cols[np.arange(sl.start, sl.stop), np.arange(hd)] = self.gamma
            data[:, : self._nbytes(t, hd)] = self._quant(t, cols)

    @staticmethod
    def _nbytes(t: PlannedTensor, n_values: int) -> int:
        return int(quants.quant_shape_to_byte_shape((n_values,), t.ggml_type)[0])

    @staticmethod
    def _quant(t: PlannedTensor, values: NDArray[np.float64]) -> NDArray[np.uint8]:
        q = quants.quantize(values.astype(np.float32), t.ggml_type)
        return np.ascontiguousarray(q).view(np.uint8).reshape(values.shape[0], -1)

    # ---- router ---------------------------------------------------------------------------------------

    def router(self) -> RouterTransform:
        """Router rows: random on the token dims, ``rho`` on the layer's slot, zero elsewhere; then the skew."""
        s = self.spec
        skew = skewed_router(s.n_expert, s.n_expert_used, s.routing_top_half, self.seed)
        region = CONST_DIMS + self.slots * s.head_dim

        def transform(name: str, rows: NDArray[np.float64]) -> NDArray[np.float64]:
            if not name.endswith(".ffn_gate_inp.weight"):
                return rows
            layer = int(name.split(".")[1])
            out = rows.copy()
            sl = self.slot(layer)
            out[:, sl] *= self.rho(layer)
            keep = out[:, sl].copy()
            out[:, :region] = 0.0
            out[:, sl] = keep
            return _ROUTER_GAIN * skew(name, out)

        return transform
