"""The quality gate's criterion on recorded log-probabilities and on its own arithmetic.

The recording (tests/tasks/data/gate_logprobs_tiny_moe_24.npz) is ``scripts/quality_floor.py --like
tiny-moe --set n_layer=24 --set down_std=0.00765 --set attn_out_std=0.002 --prompts 3 --tokens 12
--record ...``: a conditioned 24-layer twin scored by real llama.cpp workers with the reference (CPU, f16
KV, no flash attention), correct variants (flash attention, another micro-batch, loaded weights) and
wrong ones (a fewer-experts header, a wrong rope base, two expert tensors swapped, a q4_0 KV cache).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from artifacts.records.evidence import FloorResult, QualityStats
from tasks.quality_gate import Gate, compare_all

DATA = Path(__file__).parent / "data" / "gate_logprobs_tiny_moe_24.npz"


def recorded() -> tuple[list[np.ndarray], dict[str, list[np.ndarray]]]:
    with np.load(DATA) as z:
        names = sorted({k.rsplit("/", 1)[0] for k in z.files})
        arrays = {n: [z[f"{n}/{i}"].astype(np.float64) for i in range(3)] for n in names}
    return arrays.pop("reference"), arrays


def test_correct_kernels_pass_and_real_errors_fail_on_recorded_logits() -> None:
    ref, variants = recorded()
    stats = {name: compare_all(ref, lps) for name, lps in variants.items()}
    floor = [FloorResult(name=n, stats=s) for n, s in stats.items() if n.startswith("correct:") and "again" not in n]
    gate = Gate()
    for name, s in stats.items():
        ok, why = gate.verdict(s, floor)
        if name.startswith(("correct:", "profile:")):
            assert ok, f"{name}: {why}"
    for error in ("rope base", "experts used", "swapped"):
        name = next(n for n in stats if n.startswith("wrong:") and error in n)
        ok, why = gate.verdict(stats[name], floor)
        assert not ok, f"{name} passed: {why}"
    fa = stats["correct:flash attention"].mean_kl
    q4 = next(s for n, s in stats.items() if "q4_0" in n).mean_kl
    assert q4 > 5 * fa, "a q4_0 KV cache moves the distributions far more than a kernel change"


def test_a_chaotic_floor_cannot_open_the_gate() -> None:
    # The unconditioned 48-layer twin on the H200: every GPU finalist at KL ~0.10 vs the CPU reference.
    chaotic = [FloorResult(name="gpu", stats=QualityStats(mean_kl=0.0996, p90_kl=0.3, max_kl=1.0, top1=0.77, n=320))]
    kl, top1 = Gate().limits(chaotic)
    assert kl == Gate().max_kl, "the floor widens the limit at most to max_kl"
    assert not Gate().verdict(chaotic[0].stats, chaotic)[0]


@given(kl=st.floats(0, 1, allow_nan=False), top1=st.floats(0, 1), factor=st.floats(1, 10))
def test_limits_stay_between_min_kl_and_max_kl(kl: float, top1: float, factor: float) -> None:
    gate = Gate(floor_factor=factor)
    floor = [FloorResult(name="f", stats=QualityStats(mean_kl=kl, p90_kl=kl, max_kl=kl, top1=top1, n=1))]
    lim_kl, lim_top1 = gate.limits(floor)
    assert gate.min_kl <= lim_kl <= gate.max_kl
    assert lim_top1 <= gate.min_top1
    assert gate.limits([]) == (gate.max_kl, gate.min_top1)


@pytest.mark.parametrize("kl", [0.0, 1e-6, 2e-5])
def test_a_tiny_floor_still_leaves_room_for_a_reordered_sum(kl: float) -> None:
    floor = [FloorResult(name="f", stats=QualityStats(mean_kl=kl, p90_kl=kl, max_kl=kl, top1=1.0, n=8))]
    assert Gate().limits(floor)[0] == pytest.approx(max(Gate().min_kl, 4 * kl))
