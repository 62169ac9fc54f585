"""The flow's clock and budget arithmetic: stage seconds, what counts inside --budget-s, and the finalists
sized so that every one measured gets MIN_ROUNDS rounds."""

from __future__ import annotations

import time

from artifacts.engine_params import EngineParams
from artifacts.records.search import Candidate, Finalists, Placement, Prediction
from tasks import clock as clock_module
from tasks import workload as wl
from tasks.clock import TAIL_S, StageClock, mark_command_start


def test_every_stage_after_the_probe_counts_inside_the_budget_once_in_wall_time() -> None:
    import threading

    said: list[str] = []
    clock = StageClock(budget_s=100.0, say=said.append)
    with clock.stage("probe"):
        time.sleep(0.05)
    after_probe = time.monotonic()

    def reference() -> None:  # beside route and enumerate, as the flow runs it
        with clock.stage("reference") as st:
            time.sleep(0.3)
            st.computed = False

    beside = threading.Thread(target=reference)
    beside.start()
    for name in ("route", "enumerate"):
        with clock.stage(name):
            time.sleep(0.12)
    beside.join()
    assert set(clock.seconds) == {"probe", "route", "enumerate", "reference"}
    spent = clock.in_budget_spent()
    # the probe is outside; the overlapping stages count once, as the wall time since the probe ended
    assert spent <= time.monotonic() - after_probe + 0.01
    assert clock.seconds["reference"] - 0.01 <= spent < sum(clock.seconds[n] for n in ("route", "enumerate", "reference"))
    assert any(line.startswith("reference: 0 s (reused)") and "s left" in line for line in said)
    assert set(clock.record()) == {*clock.seconds, "total"}


def test_a_first_plans_one_time_stages_do_not_starve_measuring() -> None:
    """Run 12 (H200, --budget-s 150): the first plan's trace and reference took 73 s of the budget and measuring
    was left 77 s, too little for two finalists twice. Those seconds now come from outside the budget (up to
    FIRST_PLAN_GRACE_S); a further plan, which reuses them, measures in what B has left."""
    clock = StageClock(budget_s=150.0)
    with clock.stage("probe"):
        pass
    with clock.stage("route"):
        time.sleep(0.05)
    with clock.stage("reference"):
        time.sleep(0.05)
    assert 0.09 < clock.one_time_s() <= clock.in_budget_spent()
    clock.computed["reference"] = clock.computed["route"] = False  # as when both were reused
    assert clock.one_time_s() == 0.0
    assert wl.measure_budget(150.0, 73.0, 73.0) == 150.0
    assert wl.measure_budget(150.0, 120.0, 120.0) == 150.0 - 120.0 + wl.FIRST_PLAN_GRACE_S
    assert wl.measure_budget(150.0, 20.0) == 130.0  # a further plan: what B has left
    assert wl.measure_budget(150.0, 140.0) == 75.0  # never less than half of B


def test_the_grace_is_what_the_first_plan_target_leaves_after_the_start_and_the_probe() -> None:
    """Run 13 (H200, --budget-s 150): a first plan spent 12 s starting and 33 s probing outside the budget, then
    took the whole 75 s grace: 264-270 s against B + 90 = 240. The grace is now what FIRST_PLAN_SLACK_S leaves
    after the seconds outside the budget, so the command ends near B + 90."""
    outside = 12.0 + 33.0 + 2.0
    assert wl.measure_budget(150.0, 100.0, 100.0, outside) == 150.0 - 100.0 + wl.FIRST_PLAN_SLACK_S - outside
    assert wl.measure_budget(150.0, 100.0, 30.0, outside) == 150.0 - 100.0 + 30.0  # one-time seconds cap it too
    assert wl.measure_budget(150.0, 120.0, 120.0, 200.0) == 75.0  # nothing left of the slack: half of B
    clock = StageClock(budget_s=150.0)
    assert clock.started_after_s == 0.0  # no `flux plan` command marked its start in this process
    with clock.stage("probe"):
        time.sleep(0.05)
    assert 0.05 + TAIL_S <= clock.outside_s() < 1.0 + TAIL_S
    mark_command_start()  # as `flux plan` does first: the process's start counts as the plan's
    try:
        assert StageClock(budget_s=150.0).started_after_s > 0.0
    finally:
        clock_module._COMMAND_START.clear()


def _fin(n: int, visit_load_bytes: int) -> Finalists:
    params = EngineParams(n_ctx=512, n_batch=64, n_ubatch=64, load_mode="load")
    cands = [Candidate(id=f"c{i}", family="f", placement=Placement(layer_device=["CPU"]), params=params,
                       weights_bytes={"CPU": visit_load_bytes}, kv_bytes={}, compute_bytes={}) for i in range(n)]
    preds = [Prediction(candidate_id=c.id, prefill_tps=1000.0, decode_tps=100.0, score_s=1.0) for c in cands]
    return Finalists(finalists=cands, predictions=preds, workload_prefill_tokens=0, workload_decode_tokens=0,
                     n_ranked=n)


def test_finalists_are_cut_to_what_two_rounds_fit() -> None:
    fin = _fin(6, 10 * 10**9)               # 10 GB loads at 1 GB/s: ~10 s a visit
    rates = (1e9, 1e9)
    one = wl.visit_seconds(fin.finalists[0], fin.predictions[0], [64], 32, rates)
    kept = wl.fitting_finalists(fin, [64], 32, budget_s=4.5 * one * 2, rates=rates)
    assert len(kept.finalists) == 4 and kept.finalists == fin.finalists[:4]
    assert wl.MIN_ROUNDS * wl.round_seconds(kept, [64], 32, rates) <= 4.5 * one * 2
    assert len(wl.fitting_finalists(fin, [64], 32, budget_s=1.0, rates=rates).finalists) == 2  # at least two


def test_the_probes_load_times_price_a_visit() -> None:
    from artifacts.records.hardware import KernelTiming
    from tasks.testing import h200_report

    hw = h200_report(1)
    timed = hw.model_copy(update={"kernels": [*hw.kernels, KernelTiming(
        device="CUDA0", n_threads=16, decode_ms_per_token=4.6, prefill_ms_per_token=0.47, prefill_batch=64,
        decode_ms_per_layer=0.1, prefill_ms_per_layer=0.01, load_ms=3319.0)]})
    gpu_rate, cpu_rate = wl.load_rates(timed, 17_300_000_000)
    assert abs(gpu_rate - 17.3e9 / 3.319) < 1e6 and cpu_rate == wl.LOAD_GBS * 1e9  # the CPU load was not timed


def test_show_names_the_spread_statistic_it_used() -> None:
    from flows.show import _spread

    assert _spread(None, 1) == " (one round: no spread)"
    assert _spread(2.5, 3) == " (spread 2.5: range of 3 rounds)"
    assert _spread(2.5, 5) == " (spread 2.5: IQR over 5 rounds)"


def test_an_unknown_plan_prefix_points_to_flux_plans(tmp_path: object) -> None:
    import pathlib

    import pytest

    from artifacts.errors import NotFound
    from artifacts.records.kinds import PLAN
    from artifacts.records.store import Records

    with pytest.raises(NotFound, match="no plan id starts with 'abc' .*; `flux plans` lists them"):
        Records.at(pathlib.Path(str(tmp_path))).find_by_prefix(PLAN, "abc")


def test_a_tight_budget_races_different_families_before_variants_of_one() -> None:
    fin = _fin(4, 10 * 10**9)
    fams = ["milp-mixed/kv-host", "milp-mixed/kv-host@32768", "milp-decode@32768", "n-cpu-moe"]
    fin = fin.model_copy(update={"finalists": [c.model_copy(update={"family": f})
                                               for c, f in zip(fin.finalists, fams, strict=True)]})
    rates = (1e9, 1e9)
    kept = wl.fitting_finalists(fin, [64], 32, budget_s=1.0, rates=rates)
    assert [c.id for c in kept.finalists] == ["c0", "c2"], "the context variant of c0 waits behind another family"
    assert [p.candidate_id for p in kept.predictions] == ["c0", "c2"]
    assert [c.id for c in wl.diverse_order(fin).finalists] == ["c0", "c2", "c3", "c1"]


def test_a_tight_budget_measures_the_deepest_prompt_that_fits_not_the_shortest() -> None:
    from artifacts.records.plan import PlanRequest

    fin = _fin(2, 10**9)                     # ~2.5 s a visit before its prompts; 1000 / 100 tok/s
    req = PlanRequest(model="m.gguf", budget_s=60)
    rates = (1e9, 1e9)
    lengths, n_gen = wl.measurement_lengths(fin, 40960, req, 60, rates)
    assert wl.MIN_ROUNDS * wl.VISIT_ERROR * wl.round_seconds(fin, lengths, n_gen, rates) <= 60
    assert max(lengths) >= 2048, f"a deep prompt is measured when the budget holds one: {lengths}"
    assert 16384 not in lengths  # 4 visits x 16 s of prefill do not fit 60 s
    tight = wl.MIN_ROUNDS * wl.round_seconds(fin, [wl.MIN_DEPTH], 32, rates) * 1.01  # not with VISIT_ERROR
    assert wl.measurement_lengths(fin, 40960, req, tight, rates)[0] == [wl.MIN_DEPTH], "MIN_DEPTH as predicted"
    assert wl.measurement_lengths(fin, 512, req, tight, rates)[0] == [256], "a short context: its deepest prompt"
    assert wl.measurement_lengths(fin, 40960, req, 1.0, rates)[0] == [64], "nothing fits: the shortest, not no plan"
    everything, _ = wl.measurement_lengths(fin, 40960, req, 10**6, rates)
    assert everything == list(wl.LENGTHS)


def test_prompt_depth_is_sized_for_the_two_best_finalists_then_the_rest_fill_what_is_left() -> None:
    from artifacts.records.plan import PlanRequest

    fin = _fin(6, 10**9)
    req = PlanRequest(model="m.gguf", budget_s=60)
    rates = (1e9, 1e9)
    lengths, n_gen = wl.measurement_lengths(fin, 40960, req, 60, rates)
    assert max(lengths) >= 2048, "six finalists do not shrink the prompts to 64 tokens: two are raced at depth"
    kept = wl.fitting_finalists(fin, lengths, n_gen, 60, rates)
    assert len(kept.finalists) >= 2
    assert wl.MIN_ROUNDS * wl.round_seconds(kept, lengths, n_gen, rates) <= 60 or len(kept.finalists) == 2


def test_the_cost_models_error_compares_the_measured_round_not_the_whole_mix() -> None:
    from artifacts.records.evidence import MeasureSummary
    from tasks.recording.record import prediction_error

    fin = _fin(2, 10**9)  # predicted 1000 prefill / 100 decode tok/s; prune's score for the mix: 1.0 s
    measured = [MeasureSummary(candidate_id="c0", prefill_tps=900.0, decode_tps=90.0, workload_s=0.4, n_trials=2),
                MeasureSummary(candidate_id="c1", prefill_tps=None, decode_tps=None, workload_s=None, n_trials=0)]
    # one 64-token prompt + 32 generated: 0.064 + 0.32 = 0.384 s predicted against 0.4 s measured
    err = prediction_error(fin, measured, [64], 32)
    assert err is not None and abs(err - (0.4 - 0.384) / 0.4) < 1e-9
    assert prediction_error(fin, measured, [], 32) is None


def test_a_drafting_candidate_is_measured_whenever_its_placement_is() -> None:
    """Run 20: prompt lookup on the best placement was fourth in the race order and the budget measured three."""
    from artifacts.drafting import Drafting
    from tasks.measurement.speculation import with_drafting

    fin = _fin(5, 10 * 10**9)
    fams = ["milp-decode", "milp-mixed", "n-cpu-moe", "milp-decode@32768", "ngl"]
    fin = fin.model_copy(update={"finalists": [c.model_copy(update={"family": f})
                                               for c, f in zip(fin.finalists, fams, strict=True)]})
    fin = with_drafting(fin, [Drafting(kind="ngram")])
    drafts = [c.id for c in fin.finalists if c.draft is not None]
    assert drafts and drafts[0] == "c0+ngram"
    order = [c.id for c in wl.diverse_order(fin).finalists]
    assert order[:2] == ["c0", "c0+ngram"], order
    assert order.index("c2") < order.index("c3"), "families still come before a family's second"
    assert sorted(order) == sorted(c.id for c in fin.finalists)
    rates = (1e9, 1e9)
    ordered = wl.diverse_order(fin)
    first3 = ordered.model_copy(update={"finalists": ordered.finalists[:3], "predictions": ordered.predictions[:3]})
    three = wl.MIN_ROUNDS * wl.round_seconds(first3, [64], 32, rates)
    kept = wl.fitting_finalists(fin, [64], 32, budget_s=three * 1.01, rates=rates)
    assert [c.id for c in kept.finalists] == ["c0", "c0+ngram", "c1"]
    assert [p.candidate_id for p in kept.predictions] == ["c0", "c0+ngram", "c1"]
    tight = wl.fitting_finalists(fin, [64], 32, budget_s=1.0, rates=rates)
    assert [c.id for c in tight.finalists] == ["c0", "c1"], "too tight for drafting: two placements still race"
