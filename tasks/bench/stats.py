"""Bench statistics: speed claims are ratios of paired trials (same round, same prompt) with a bootstrap 95%
interval of their median; "faster" and "slower" need the whole interval on one side of 1."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

Outcome = Literal["faster", "same", "slower", "n/a"]


class RatioCI(BaseModel):
    """Ratio of paired samples (median of the pairs' ratios) with a bootstrap interval; None where undefined."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    ratio: float | None
    low: float | None
    high: float | None
    n: int
    geomean: float | None = Field(None, description="geometric mean of the pairs' ratios (not robust to bursts)")
    p_value: float | None = Field(None, description="Wilcoxon signed-rank test of the log ratios (n >= 6)")

    @property
    def outcome(self) -> Outcome:
        """'faster'/'slower' when the whole interval is above/below 1, 'same' when it straddles 1."""
        if self.low is None or self.high is None:
            return "n/a"
        return "faster" if self.low > 1.0 else "slower" if self.high < 1.0 else "same"

    def text(self) -> str:
        """``1.23x [1.10, 1.35]``."""
        if self.ratio is None:
            return "n/a"
        ci = f" [{self.low:.2f}, {self.high:.2f}]" if self.low is not None and self.high is not None else ""
        return f"{self.ratio:.2f}x{ci}"


def paired_ratio(num: Sequence[float], den: Sequence[float], *, n_boot: int = 4000, seed: int = 0,
                 level: float = 0.95) -> RatioCI:
    """Ratio num/den over paired samples: exp(median(log num - log den)), bootstrap percentile interval.

    The median, not the mean: on a shared machine a burst of load can slow one engine's visit 10x, and one
    such pair must not decide the verdict (the geometric mean is kept alongside). Pairs where either side
    is missing or not positive are dropped.
    """
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    ok = np.isfinite(a) & np.isfinite(b) & (a > 0) & (b > 0)
    d = np.log(a[ok]) - np.log(b[ok])
    if d.size == 0:
        return RatioCI(ratio=None, low=None, high=None, n=0)
    ratio, geomean = float(np.exp(np.median(d))), float(np.exp(d.mean()))
    if d.size < 2:
        return RatioCI(ratio=ratio, low=None, high=None, n=1, geomean=geomean)
    medians = np.median(d[np.random.default_rng(seed).integers(0, d.size, size=(n_boot, d.size))], axis=1)
    lo, hi = np.quantile(medians, [(1 - level) / 2, 1 - (1 - level) / 2])
    p = None
    if d.size >= 6 and np.any(d != 0):
        from scipy.stats import wilcoxon

        p = float(wilcoxon(d).pvalue)
    return RatioCI(ratio=ratio, low=float(np.exp(lo)), high=float(np.exp(hi)), n=int(d.size), geomean=geomean,
                   p_value=p)

