"""A routing profile: how often the model's routers picked each expert on the planning workload.

``tasks.probing.trace`` traces it; its counts decide which experts a per-expert placement keeps on the GPU, and its id
(the stored trace's) is part of every plan key it shaped.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from artifacts.records.base import Record


def top_share(counts: NDArray[np.int64], fraction: float = 0.5) -> NDArray[np.float64]:
    """Per layer, the share of selections that go to its busiest ``fraction`` of experts (``flux show``)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    k = max(1, math.ceil(fraction * counts.shape[1]))
    ordered = -np.sort(-counts, axis=1)
    totals = counts.sum(axis=1)
    return np.divide(ordered[:, :k].sum(axis=1), totals, out=np.zeros(len(totals)), where=totals > 0)


class RoutingProfile(Record):
    """A stored routing trace: its id in the store and the counts [n_layer][n_expert]."""

    trace_id: str
    n_tokens: int
    n_expert_used: int
    counts: tuple[tuple[int, ...], ...]
    repeat: float | None = None  # median over layers: share of a token's picks its predecessor made too
    # the picks on the measured rounds' traffic where it is not the traced one (flux plan --domains TRACE:MEASURE),
    # traced alike: what the plan's GPU copies serve there
    measured: tuple[tuple[int, ...], ...] | None = None
    note: str | None = None  # what the plan says of its routing (a served trace used, or why not: --routing-from)

    def array(self) -> NDArray[np.int64]:
        """The counts as an int64 array [n_layer, n_expert]."""
        return np.asarray(self.counts, dtype=np.int64)

    def measured_array(self) -> NDArray[np.int64] | None:
        """The measured traffic's counts as an int64 array [n_layer, n_expert] (None: not traced)."""
        return None if self.measured is None else np.asarray(self.measured, dtype=np.int64)

    def shares(self) -> NDArray[np.float64]:
        """Each expert's share of its layer's picks [n_layer, n_expert] (rows sum to 1)."""
        a = self.array().astype(np.float64)
        return a / np.maximum(a.sum(axis=1, keepdims=True), 1.0)

    def coverage(self, fraction: float) -> float:
        """Median over layers of the share of picks that go to each layer's busiest ``fraction`` of experts."""
        return float(np.median(top_share(self.array(), fraction)))
