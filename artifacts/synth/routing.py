"""Routing profiles of synthetic twins: how often each expert of a layer gets picked.

A twin's router (``ffn_gate_inp``) is random, so every expert is about as popular as any other ("uniform"). Real
MoE routing is skewed, and a per-expert placement is only worth something on a skewed twin. The "skewed" profile
gives each layer a popularity curve over its experts' ranks, a Zipf-Mandelbrot law in the rank fraction
``r = (i + 0.5) / n_expert``::

    share(r) ~ (r + q) ** -s,   q = 0.316, s chosen so the busiest half of the experts gets ``routing_top_half``

With ``routing_top_half = 0.9`` and 128 experts, that is the published Qwen3-30B-A3B statistics (docs/routing.md):
90% of picks in the busiest half, the top expert 5.0% of picks. Each layer ranks its experts in its own random
order (seeded), as real layers do.

The twin gets that curve by scaling its router rows: expert e's row is normalised and multiplied by ``scale[e]``,
so its logit has ``scale[e]`` times the spread of the others'. Router logits of a twin are close to independent
normals across experts (random rows, a random-looking hidden state), so the scales are fitted once per
(n_expert, n_expert_used, top_half) by Monte Carlo on ``top_k(scale * z)``, z ~ N(0, 1). A scale only spreads a
logit, so an expert is picked on at most about half the tokens: no expert can get more than ``0.5 / n_expert_used``
of the picks. That bound is far from Qwen3's 128 x 8 (the fit matches the target there), but it flattens the curve
of shapes with few experts per pick slot; :func:`router_scales` returns the shares the fit reaches, which is what
a test should hold llama.cpp's measured routing to.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

ZIPF_Q = 0.316  # fitted with s to Qwen3-30B-A3B (128 experts): top expert 5.0% of picks, 90% in the busiest half
_FIT_SAMPLES = 8192
_FIT_STEPS = 200
_FIT_RATE = 0.3
_MAX_LOG_SCALE = 4.0  # scales within e^-4..e^4 of their geometric mean: bounded logits, not a one-hot router
_ROUTER_SUFFIX = ".ffn_gate_inp.weight"

RouterTransform = Callable[[str, NDArray[np.float64]], NDArray[np.float64]]


def target_shares(n_expert: int, top_half: float) -> NDArray[np.float64]:
    """The skewed profile's share of picks per expert rank (busiest first), summing to 1."""
    if not 0.5 < top_half < 1.0:
        raise ValueError(f"routing_top_half must be in (0.5, 1), got {top_half}")
    r = (np.arange(n_expert) + 0.5) / n_expert
    half = math.ceil(n_expert / 2)
    lo, hi = 0.0, 64.0
    for _ in range(60):  # the top half's share rises with s: bisect for it
        s = (lo + hi) / 2
        p = (r + ZIPF_Q) ** -s
        lo, hi = (s, hi) if p[:half].sum() / p.sum() < top_half else (lo, s)
    p = (r + ZIPF_Q) ** -((lo + hi) / 2)
    return np.asarray(p / p.sum(), dtype=np.float64)


@functools.lru_cache(maxsize=16)
def router_scales(n_expert: int, n_expert_used: int, top_half: float) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Fit the router-row scales of the skewed profile: (scales by rank, expected share of picks by rank).

    Deterministic: the Monte Carlo sample has a fixed seed, independent of the twin's.
    """
    k = n_expert_used
    target = np.minimum(k * target_shares(n_expert, top_half), 0.5)  # picked on at most about half the tokens
    z = np.random.default_rng(0).standard_normal((_FIT_SAMPLES, n_expert))
    log_scale = np.zeros(n_expert)
    for _ in range(_FIT_STEPS):
        picked = _pick_rate(log_scale, z, k)
        log_scale += _FIT_RATE * (np.log(np.maximum(target, 1e-4)) - np.log(np.maximum(picked, 1e-4)))
        log_scale = np.clip(log_scale - log_scale.mean(), -_MAX_LOG_SCALE, _MAX_LOG_SCALE)
    check = np.random.default_rng(1).standard_normal((4 * _FIT_SAMPLES, n_expert))
    return np.exp(log_scale), _pick_rate(log_scale, check, k) / k


def _pick_rate(log_scale: NDArray[np.float64], z: NDArray[np.float64], k: int) -> NDArray[np.float64]:
    """How often each expert is among the top k of ``exp(log_scale) * z`` over the rows of z."""
    top = np.argpartition(-(z * np.exp(log_scale)), k - 1, axis=1)[:, :k]
    return np.bincount(top.ravel(), minlength=z.shape[1]) / z.shape[0]


def layer_ranks(n_expert: int, layer: int, seed: int) -> NDArray[np.int64]:
    """Each expert's popularity rank in ``layer`` (0 = busiest): a permutation drawn from (seed, layer)."""
    return np.random.default_rng([seed, layer, 0x5EED]).permutation(n_expert)


def skewed_router(n_expert: int, n_expert_used: int, top_half: float, seed: int) -> RouterTransform:
    """The transform of router tensors that gives a twin the skewed profile (other tensors pass through)."""
    scales, _ = router_scales(n_expert, n_expert_used, top_half)

    def transform(name: str, rows: NDArray[np.float64]) -> NDArray[np.float64]:
        if not name.endswith(_ROUTER_SUFFIX):
            return rows
        layer = int(name.split(".")[1])
        norms = np.linalg.norm(rows, axis=1, keepdims=True)
        nominal = np.sqrt((rows**2).mean() * rows.shape[1])  # the average row norm, kept
        return rows / norms * nominal * scales[layer_ranks(n_expert, layer, seed)][:, None]

    return transform
