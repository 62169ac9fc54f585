"""Bench statistics: paired ratios and their intervals, and the busy-machine warning."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks.bench.host import busy_warning
from tasks.bench.stats import paired_ratio

speeds = st.lists(st.floats(min_value=0.1, max_value=1e4), min_size=2, max_size=30)


def test_a_constant_ratio_is_exact_and_significant() -> None:
    r = paired_ratio([20.0, 40.0, 80.0, 10.0], [10.0, 20.0, 40.0, 5.0])
    assert r.ratio == pytest.approx(2.0) and r.low == pytest.approx(2.0) and r.high == pytest.approx(2.0)
    assert r.outcome == "faster" and r.n == 4
    assert paired_ratio([5.0, 10.0], [10.0, 20.0]).outcome == "slower"


def test_noise_around_one_is_the_same() -> None:
    r = paired_ratio([1.0, 1.2, 0.9, 1.1, 0.8, 1.05], [1.1, 1.0, 1.0, 0.95, 1.0, 1.0])
    assert r.low is not None and r.high is not None and r.low < 1.0 < r.high
    assert r.outcome == "same" and r.p_value is not None


def test_one_disturbed_pair_does_not_decide() -> None:
    # five quiet pairs at parity; one visit of the baseline hit by a burst of load (10x slower)
    r = paired_ratio([10.0, 10.2, 9.9, 10.1, 10.0, 10.0], [10.0, 10.1, 10.0, 10.0, 10.1, 1.0])
    assert r.ratio == pytest.approx(1.0, abs=0.02) and r.outcome == "same"
    assert r.geomean is not None and r.geomean > 1.4


def test_busy_machine_warning() -> None:
    assert busy_warning([0.5, 1.9, 2.9], cpu_count=2) is None  # the engine's own two threads
    warn = busy_warning([0.5, 6.6], cpu_count=2)
    assert warn is not None and "6.6 on 2 CPUs" in warn


def test_missing_and_single_pairs() -> None:
    assert paired_ratio([], []).outcome == "n/a"
    one = paired_ratio([2.0, float("nan"), 0.0], [1.0, 1.0, 1.0])
    assert one.n == 1 and one.ratio == pytest.approx(2.0) and one.outcome == "n/a"


@settings(max_examples=20, deadline=None)
@given(speeds, st.integers(0, 10))
def test_ratio_is_antisymmetric_and_inside_its_interval(xs: list[float], seed: int) -> None:
    ys = [x * (1.3 if i % 2 else 0.8) for i, x in enumerate(xs)]
    ab, ba = paired_ratio(xs, ys, seed=seed, n_boot=300), paired_ratio(ys, xs, seed=seed, n_boot=300)
    assert ab.ratio is not None and ba.ratio is not None
    assert math.isclose(ab.ratio * ba.ratio, 1.0, rel_tol=1e-9)
    assert ab.low is not None and ab.high is not None
    assert ab.low <= ab.ratio * (1 + 1e-9) and ab.ratio <= ab.high * (1 + 1e-9)
