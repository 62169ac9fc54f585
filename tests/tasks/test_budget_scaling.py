"""A plan's measurement scales to the model's speed and the budget: a slow model decodes shorter windows, the
routing trace and the reference shrink with the budget, and a budget that cannot work is refused right after
the probe (never after it has been spent)."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifacts.engine_params import EngineParams
from artifacts.model_info import model_info
from artifacts.records.hardware import HardwareReport, KernelTiming
from artifacts.records.plan import PlanRequest
from artifacts.records.search import Candidate, Finalists, Placement, Prediction
from tasks import workload as wl
from tasks.errors import ImpossiblePlan
from tasks.probing import trace as route
from tasks.testing import h200_report
from tasks.validation.reference import shape


def _kernels(hw: HardwareReport, cpu: tuple[float, float, float], gpu: tuple[float, float, float] | None) -> HardwareReport:
    """``hw`` with the whole model's (load ms, prefill ms/token, decode ms/token) on the CPU and a GPU."""
    def k(device: str, t: tuple[float, float, float]) -> KernelTiming:
        return KernelTiming(device=device, n_threads=16, load_ms=t[0], prefill_ms_per_token=t[1],
                            decode_ms_per_token=t[2], prefill_batch=64, decode_ms_per_layer=t[2] / 32,
                            prefill_ms_per_layer=t[1] / 32)

    return hw.model_copy(update={"kernels": [k("CPU", cpu), *([k("CUDA0", gpu)] if gpu else [])]})


# The mixtral-8x7b twin on the lent H100 (docs/benchmarks/h100-user-run): CPU load 22.9 s, prefill 70.6 ms/token,
# decode 122 ms/token; whole model on the GPU: load 6.1 s, 0.68 and 5.27 ms/token.
MIXTRAL = ((22899.0, 70.64, 122.47), (6062.0, 0.68, 5.27))


def _slow_finalists(decode_tps: float, n: int = 2) -> Finalists:
    params = EngineParams(n_ctx=32768, n_batch=256, n_ubatch=256)
    cands = [Candidate(id=f"c{i}", family=f"f{i}", placement=Placement(layer_device=["CPU"]), params=params,
                       weights_bytes={"CUDA0": 12 * 2**30, "CPU": 14 * 2**30}, kv_bytes={}, compute_bytes={})
             for i in range(n)]
    preds = [Prediction(candidate_id=c.id, prefill_tps=424.0, decode_tps=decode_tps, score_s=1.0) for c in cands]
    return Finalists(finalists=cands, predictions=preds, workload_prefill_tokens=0, workload_decode_tokens=0,
                     n_ranked=n)


def test_a_slow_model_decodes_a_shorter_window_instead_of_being_refused() -> None:
    req = PlanRequest(model="m.gguf", budget_s=240, workload="chat")
    rates = (6e9, 6e9)
    fast, slow = _slow_finalists(100.0), _slow_finalists(10.7)
    assert wl.measurement_lengths(fast, 32768, req, 138, rates)[1] == wl.CHAT_N_GEN
    lengths, n_gen = wl.measurement_lengths(slow, 32768, req, 138, rates)
    assert wl.MIN_GEN <= n_gen < wl.CHAT_N_GEN, "10.7 tok/s: 256 tokens a visit do not fit 138 s"
    assert wl.MIN_ROUNDS * wl.round_seconds(slow, lengths, n_gen, rates) <= 138
    assert wl.overrun_note(slow, lengths, n_gen, 138, rates) is None
    # far too little left: measured all the same, at the least workload, with a note (no refusal after the probe)
    lengths, n_gen = wl.measurement_lengths(slow, 32768, req, 5, rates)
    assert n_gen == wl.MIN_GEN and lengths == [min(wl.CHAT_LENGTHS)]
    note = wl.overrun_note(slow, lengths, n_gen, 5, rates)
    assert note and "measured 2 times all the same" in note and "later than --budget-s" in note


def test_a_budget_that_cannot_work_is_refused_after_the_probe_naming_one_that_does() -> None:
    hw = _kernels(h200_report(1), *MIXTRAL)
    least = wl.least_measure_seconds(hw, 32768, PlanRequest(model="m.gguf", budget_s=240, workload="chat"))
    assert 20 < least < 60, least  # four visits, each a 6 s GPU load and a few tokens
    wl.check_feasible(hw, 32768, PlanRequest(model="m.gguf", budget_s=240, workload="chat"))
    with pytest.raises(ImpossiblePlan) as e:
        wl.check_feasible(hw, 32768, PlanRequest(model="m.gguf", budget_s=20, workload="chat"))
    assert "cannot measure the 2 finalists 2 times each" in str(e.value)
    suggested = int(e.value.fix.split("--budget-s ")[1].split()[0])
    wl.check_feasible(hw, 32768, PlanRequest(model="m.gguf", budget_s=suggested, workload="chat"))


def test_the_routing_trace_shrinks_with_the_budget() -> None:
    hw = _kernels(h200_report(1), *MIXTRAL)
    assert route.trace_tokens(hw, 2400, wl.ONE_TIME_SHARE) == route.TRACE_TOKENS
    small = route.trace_tokens(hw, 240, wl.ONE_TIME_SHARE)
    assert route.MIN_TRACE_TOKENS <= small < route.TRACE_TOKENS
    assert (22.899 + small * 0.07064) <= wl.ONE_TIME_SHARE * 240
    assert route.trace_tokens(hw, 1, wl.ONE_TIME_SHARE) == route.MIN_TRACE_TOKENS
    assert route.trace_tokens(None, 1, wl.ONE_TIME_SHARE) == route.TRACE_TOKENS, "no probe: the full trace"


def test_the_reference_and_noise_floor_scale_with_the_budget(tiny_moe: Path) -> None:
    info = model_info(tiny_moe)
    # a 2-core machine with a slow model: CPU only, 40 ms/token prefill, 200 ms/token decode
    hw = _kernels(h200_report(0), (5000.0, 40.0, 200.0), None)
    full = shape(info, hw, 10_000, 32)
    assert full.scale == 1.0 and full.n_tokens == 32
    small = shape(info, hw, 120, 32)
    assert small.scale < 1.0 and small.n_tokens < 32 and small.floor_sequences < full.floor_sequences
    assert small.predicted_s < full.predicted_s
    cap, convs = wl.validation_shape(small.scale)
    assert wl.MIN_VALIDATION_CAP <= cap < wl.VALIDATION_CAP and convs >= wl.MIN_CONVERSATIONS
