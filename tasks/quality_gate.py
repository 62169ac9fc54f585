"""The quality gate: does a configuration's output match the reference placement's?

Pure arithmetic on log-softmax rows (no llama.cpp), so the criterion is tested on recorded logits.

A correct placement changes only which kernels run and in which order they sum: its next-token
distributions differ from the reference's by rounding, which a deep model amplifies. The gate therefore
compares a candidate with two things: fixed limits (``[plan] max_kl``, ``min_top1``) and the *noise
floor* measured on the same machine and prompts — the reference against itself with other, equally
correct kernels (flash attention and another micro-batch on the CPU; on a GPU machine the same layers on
the GPU). A candidate passes when its mean KL is at most ``floor_factor`` times the floor's (never below
``min_kl``, so that a floor of zero leaves room for a reordered sum, and never above ``max_kl``, the most a
plan may differ whatever the floor) and its top-1 agreement at least ``min(min_top1, floor top-1 -
top1_slack)``. Real errors — fewer experts, a wrong rope base, two tensors swapped — move the
distributions by far more than any kernel change does (``scripts/quality_floor.py`` measures both on a twin).
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from artifacts.records.evidence import FloorResult, QualityStats


class Gate(BaseModel):
    """The pass criterion: fixed limits, widened to the measured noise floor of correct kernels."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    max_kl: float = Field(0.01, ge=0)
    min_top1: float = Field(0.90, ge=0, le=1)
    floor_factor: float = Field(4.0, ge=1, description="a candidate may differ this many times the floor's mean KL")
    min_kl: float = Field(1e-4, ge=0, description="the KL limit is never tighter than this")
    top1_slack: float = Field(0.05, ge=0, le=1)

    def limits(self, floor: list[FloorResult]) -> tuple[float, float]:
        """(largest mean KL, smallest top-1 agreement) a candidate may show, given the noise floor."""
        if not floor:
            return self.max_kl, self.min_top1
        worst_kl = max(f.stats.mean_kl for f in floor)
        worst_top1 = min(f.stats.top1 for f in floor)
        kl = min(self.max_kl, max(self.min_kl, self.floor_factor * worst_kl))
        return kl, min(self.min_top1, worst_top1 - self.top1_slack)

    def verdict(self, stats: QualityStats, floor: list[FloorResult]) -> tuple[bool, str]:
        """Whether ``stats`` passes, and why, in words."""
        kl_limit, top1_limit = self.limits(floor)
        ok = stats.mean_kl <= kl_limit and stats.top1 >= top1_limit
        return ok, (f"mean KL {stats.mean_kl:.2e} {'<=' if stats.mean_kl <= kl_limit else '>'} {kl_limit:.2e}, "
                    f"top-1 {stats.top1:.3f} {'>=' if stats.top1 >= top1_limit else '<'} {top1_limit:.3f}")


def compare(ref: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-position KL(ref || cand) and top-1 agreement of two log-softmax arrays [n, vocab]."""
    p = np.exp(ref)
    kl = np.maximum((p * (ref - cand)).sum(axis=1), 0.0)
    agree = ref.argmax(axis=1) == cand.argmax(axis=1)
    return kl, agree


def quality_stats(kl: np.ndarray, agree: np.ndarray) -> QualityStats:
    """Summary statistics of per-position KL divergences and top-1 agreements."""
    if kl.size == 0:
        return QualityStats(mean_kl=0.0, p90_kl=0.0, max_kl=0.0, top1=1.0, n=0)
    return QualityStats(mean_kl=float(kl.mean()), p90_kl=float(np.quantile(kl, 0.9)), max_kl=float(kl.max()),
                        top1=float(agree.mean()), n=int(kl.size))


def compare_all(ref: list[np.ndarray], cand: list[np.ndarray]) -> QualityStats:
    """Statistics over every position of every sequence."""
    kls, agrees = zip(*(compare(r, c) for r, c in zip(ref, cand, strict=True)), strict=True)
    return quality_stats(np.concatenate(kls), np.concatenate(agrees))
