"""The measure stage: real workers, paired rounds, budget, and a crashing candidate as a row."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from artifacts.engine_params import EngineParams
from artifacts.records.search import Candidate, Placement
from engine_bridge.gpumem import GpuMemoryMeter, GpuReading, over_budget
from tasks.measurement.rounds import TRIAL_SCHEMA, measure

GIB = 2**30


def cand(cid: str, **kw: object) -> Candidate:
    params = EngineParams(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1, **kw)  # type: ignore[arg-type]
    return Candidate(id=cid, family="test", placement=Placement(layer_device=["CPU"]), params=params,
                     weights_bytes={}, kv_bytes={}, compute_bytes={})


def test_a_crashing_candidate_is_a_row_and_the_others_are_measured(tiny_moe: Path, tmp_path: Path) -> None:
    lines: list[str] = []  # the module's log lines (a handler of its own: the suite's logging setup may not propagate)
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("tasks.measurement.rounds")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    finalists = [cand("good"), cand("crash"), cand("fa", flash_attn=True)]
    prompts = [list(range(10, 42)), list(range(50, 114))]
    try:
        summaries, table, spent, stopped = measure(
            finalists, tiny_moe, prompts, 4, budget_s=120, repeats=2, timeout_s=60, log_path=tmp_path / "w.log",
            worker_env={"crash": {"FLUX_WORKER_FAULT": "abort-on-load"}})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    by = {s.candidate_id: s for s in summaries}
    assert by["crash"].error and "worker_died" in by["crash"].error and by["crash"].n_trials == 0
    for ok in ("good", "fa"):
        assert by[ok].error is None and by[ok].n_trials == 4 and by[ok].decode_tps and by[ok].workload_s
    assert table.schema == TRIAL_SCHEMA
    rows = table.to_pylist()
    assert sum(1 for r in rows if r["candidate_id"] == "crash") == 1, "a failed candidate is not retried"
    rounds = {(r["candidate_id"], r["round"]) for r in rows if not r["error"]}
    assert rounds == {("good", 0), ("good", 1), ("fa", 0), ("fa", 1)}, "every live finalist runs in every round"
    assert not stopped and spent < 120
    # each visit says where its time went: a load that dominates a big model's visit shows in the plan's log
    good = [x for x in lines if x.startswith("measure: good visit ")]
    assert len(good) == 2 and all("(start " in x and ", load " in x and ", prompts " in x for x in good), lines
    assert any(x.startswith("measure: crash visit 1 took") and ", load " not in x for x in lines), lines


def test_the_budget_stops_further_rounds_but_two_finalists_are_measured_twice(tiny_moe: Path, tmp_path: Path) -> None:
    summaries, table, spent, stopped = measure(
        [cand("a"), cand("b"), cand("c")], tiny_moe, [list(range(10, 40))], 2, budget_s=0.01, repeats=5,
        timeout_s=60, log_path=tmp_path / "w.log")
    assert stopped
    timed = [r for r in table.to_pylist() if not r["error"]]
    rounds: dict[str, set[int]] = {}
    for r in timed:
        rounds.setdefault(r["candidate_id"], set()).add(r["round"])
    assert sorted(map(sorted, rounds.values())) == [[0, 1], [0, 1]], (
        f"two finalists are measured twice however small the budget (a slower plan, never one round): {rounds}")
    measured = [s for s in summaries if s.candidate_id in rounds]
    assert all(s.n_rounds == 2 and s.workload_s for s in measured)
    assert [s.n_trials for s in summaries if s.candidate_id not in rounds] == [0]


def test_a_finalist_over_its_gpu_budget_cannot_be_chosen(tiny_moe: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The GPU reading is the one part this machine cannot produce: NVML's answer for the worker's pid is
    # replaced by what an H200 reported for a 16 GiB placement; the workers and timings are real.
    def reading(self: GpuMemoryMeter, pid: int | None) -> GpuReading | None:
        return GpuReading(per_gpu=(16 * GIB, 0), method="per-process") if pid else None

    monkeypatch.setattr(GpuMemoryMeter, "read", reading)
    summaries, table, _, _ = measure([cand("big")], tiny_moe, [list(range(10, 40))], 2, budget_s=60, repeats=1,
                                     timeout_s=60, log_path=tmp_path / "w.log", gpu_budgets=[8 * GIB])
    (s,) = summaries
    assert s.workload_s is None and s.error and "over the GPU memory budget" in s.error and "16.00 GiB" in s.error
    assert s.gpu_bytes == 16 * GIB
    assert all(r["error"] and r["gpu_bytes"] == 16 * GIB for r in table.to_pylist())


def test_within_budget_keeps_its_timings(tiny_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GpuMemoryMeter, "read", lambda self, pid: GpuReading(per_gpu=(7 * GIB,), method="device-delta"))
    (s,), _, _, _ = measure([cand("fits")], tiny_moe, [list(range(10, 40))], 2, budget_s=60, repeats=1,
                            timeout_s=60, log_path=tmp_path / "w.log", gpu_budgets=[8 * GIB])
    assert s.error is None and s.workload_s and s.gpu_bytes == 7 * GIB and s.gpu_method == "device-delta"


def test_over_budget_rules() -> None:
    assert over_budget(None, [8 * GIB]) is None, "no NVML reading: nothing to enforce"
    assert over_budget([9 * GIB], None) is None, "no budget set"
    assert over_budget([8 * GIB, 0], [8 * GIB]) is None, "exactly the budget fits"
    assert "on one GPU" in (over_budget([8 * GIB + 1, 0], [8 * GIB, 8 * GIB]) or "")
    assert "in all" in (over_budget([6 * GIB, 6 * GIB], [8 * GIB, 2 * GIB]) or "")


def test_the_meter_without_a_gpu_reads_unknown() -> None:
    meter = GpuMemoryMeter()
    if meter.available:
        pytest.skip("this machine has NVML: the no-GPU answer cannot be seen here")
    assert meter.read(os.getpid()) is None


def test_a_second_round_that_does_not_fit_cuts_the_slowest_first(tiny_moe: Path, tmp_path: Path) -> None:
    """After round one, the finalists whose second visits do not all fit what is left are cut, slowest first:
    the kept ones get their spread; a cut one is shown, never ranked (measured once)."""
    from tasks.measurement.rounds import _cut_for_second_round

    rows = [{"candidate_id": c, "round": 0, "prompt_ms": ms, "gen_ms": 1.0} for c, ms in
            (("fast", 10.0), ("mid", 20.0), ("slow", 30.0))]
    visits = {"fast": 4.0, "mid": 4.0, "slow": 4.0}
    assert _cut_for_second_round(rows, visits, set(), 100.0) == []
    assert _cut_for_second_round(rows, visits, set(), 9.0) == ["slow"]
    assert _cut_for_second_round(rows, visits, set(), 1.0) == ["slow"], "the two fastest are always kept"
    assert _cut_for_second_round(rows, visits, {"fast"}, 4.0) == []


def test_a_finalist_measured_once_is_never_ranked(tiny_moe: Path, tmp_path: Path) -> None:
    from tasks.measurement.rounds import summarize

    rows = [{"candidate_id": "a", "round": 0, "prompt_index": 0, "prompt_tokens": 10, "prompt_ms": 5.0,
             "gen_tokens": 2, "gen_ms": 2.0, "peak_rss_bytes": 1, "error": None},
            {"candidate_id": "a", "round": 1, "prompt_index": -1,
             "error": "measured once: the budget left no second round (no spread)"}]
    s = summarize("a", rows)
    assert s.workload_s is None and s.decode_tps and s.error and s.error.startswith("measured once")


def test_slow_first_visits_drop_the_last_ranked_unvisited_finalists() -> None:
    """Visits twice as long as predicted (the H200's): the last-ranked finalists not yet visited are dropped
    until the rest fit two rounds; two always stay, and nothing is dropped while predictions hold."""
    from tasks.measurement.rounds import _drop_unvisited

    fin = [cand(f"c{i}") for i in range(6)]
    pred = {c.id: 10.0 for c in fin}
    assert _drop_unvisited(fin, {"c0": 10.0}, pred, set(), 120.0) == []
    dropped = _drop_unvisited(fin, {"c0": 20.0}, pred, set(), 120.0)
    assert [cid for cid, _ in dropped] == ["c5", "c4", "c3"] and "2.0x" in dropped[0][1]
    assert [cid for cid, _ in _drop_unvisited(fin, {"c0": 50.0}, pred, set(), 1.0)] == ["c5", "c4", "c3", "c2"]


def test_a_slow_first_visit_drops_drafting_before_the_second_placement() -> None:
    """H200 run 22: the measure stage kept c208, its prompt lookup c208+ngram and c209; c208's first visit took
    1.1x its prediction and c209, last, was dropped, so the plan's race had one placement. The drafting
    candidate goes first now, and two placements race."""
    from artifacts.drafting import Drafting
    from tasks.measurement.rounds import _drop_unvisited

    fin = [cand("c208"), cand("c208").model_copy(update={"id": "c208+ngram", "draft": Drafting(kind="ngram")}),
           cand("c209")]
    pred = {"c208": 36.0, "c208+ngram": 36.0, "c209": 40.0}
    dropped = _drop_unvisited(fin, {"c208": 40.0}, pred, set(), 196.0)
    assert [cid for cid, _ in dropped] == ["c208+ngram"]
    assert _drop_unvisited(fin, {"c208": 40.0}, pred, set(), 300.0) == [], "room for all three: all stay"
    more = [*fin, cand("c210")]
    pred["c210"] = 40.0
    dropped = _drop_unvisited(more, {"c208": 40.0}, pred, set(), 196.0)
    assert [cid for cid, _ in dropped] == ["c210", "c208+ngram"], "a third placement goes first"

    # a placement dropped or failed takes its unvisited drafting with it: nothing to race it against
    from tasks.measurement.rounds import _its_drafting

    lookup = Drafting(kind="ngram")
    fin = [cand("c1"), cand("c2"), cand("c3"), cand("c3").model_copy(update={"id": "c3+ngram", "draft": lookup})]
    pred = {c.id: 40.0 for c in fin}
    dropped = _drop_unvisited(fin, {"c1": 44.0}, pred, set(), 200.0)
    assert [cid for cid, _ in dropped] == ["c3+ngram", "c3"]
    gone = _its_drafting(fin[2], fin[1:], set(), "failed")
    assert gone == [("c3+ngram", "not measured: its placement c3 failed")]
    assert _its_drafting(fin[3], fin, set(), "failed") == [] and _its_drafting(fin[2], fin, {"c3+ngram"}, "x") == []


def test_a_finalist_over_budget_hands_its_visit_to_one_left_out(tiny_moe: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """H200 run 15: both mapped splits of the qwen35moe twin read 12.08 GiB of a 12 GiB budget and the four
    finalists left out for the measuring budget were never tried, so no plan was made. Now the first over
    budget takes its look-alike (as much predicted at the same micro-batch) with it and left-out finalists
    that could fit are measured in their two visits' place. NVML's answer is replaced (no GPU here) by the figure the H200
    read, chosen per worker from its environment; the workers and timings are real."""
    def reading(self: GpuMemoryMeter, pid: int | None) -> GpuReading | None:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if pid else []
        gib = 12.08 if b"FLUX_TEST_GPU=big" in env else 11.5
        return GpuReading(per_gpu=(int(gib * GIB),), method="per-process") if pid else None

    monkeypatch.setattr(GpuMemoryMeter, "read", reading)
    big = {"FLUX_TEST_GPU": "big"}
    predicted = {"big1": 12 * GIB, "big2": 12 * GIB, "big3": 12 * GIB, "small": 11 * GIB, "small2": 11 * GIB,
                 "small3": 11 * GIB}
    summaries, table, _, _ = measure(
        [cand("big1"), cand("big2")], tiny_moe, [list(range(10, 40))], 2, budget_s=120, repeats=2, timeout_s=60,
        log_path=tmp_path / "w.log", gpu_budgets=[12 * GIB], predicted_gpu=predicted, seed=3,
        worker_env={"big1": big, "big2": big, "big3": big},
        reserves=[cand("big3"), cand("small"), cand("small2"), cand("small3")])
    by = {s.candidate_id: s for s in summaries}
    first = next(r["candidate_id"] for r in table.to_pylist() if r["gpu_bytes"])
    other = "big2" if first == "big1" else "big1"
    assert "over the GPU memory budget: measured 12.08 GiB" in (by[first].error or "")
    assert by[other].n_trials == 0 and by[other].error and by[other].error.startswith(
        f"not measured: predicted 12.00 GiB at micro-batch 64, no less than {first}, over the GPU memory budget")
    assert "big3" not in by, "a reserve like the one over budget is never visited"
    for cid in ("small", "small2"):  # one visit freed by the finalist over budget, one by its look-alike
        assert by[cid].error is None and by[cid].n_rounds == 2 and by[cid].gpu_bytes == int(11.5 * GIB)
    assert "small3" not in by, "no visit was freed for a third reserve"
    assert {r["candidate_id"] for r in table.to_pylist()} == {"big1", "big2", "small", "small2"}


def test_a_finalist_already_measured_keeps_its_rows_when_a_look_alike_is_over(
        tiny_moe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only unvisited look-alikes go with a finalist over budget: one measured within it before stays measured."""
    import random

    def reading(self: GpuMemoryMeter, pid: int | None) -> GpuReading | None:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if pid else []
        gib = 12.08 if b"FLUX_TEST_GPU=big" in env else 11.5
        return GpuReading(per_gpu=(int(gib * GIB),), method="per-process") if pid else None

    monkeypatch.setattr(GpuMemoryMeter, "read", reading)
    finalists = [cand("ok"), cand("big")]

    def first(seed: int) -> str:
        order = list(finalists)
        random.Random(seed).shuffle(order)
        return order[0].id

    seed = next(s for s in range(20) if first(s) == "ok")
    summaries, _, _, _ = measure(
        finalists, tiny_moe, [list(range(10, 40))], 2, budget_s=120, repeats=2, timeout_s=60,
        log_path=tmp_path / "w.log", gpu_budgets=[12 * GIB], predicted_gpu={"ok": 12 * GIB, "big": 12 * GIB},
        seed=seed, worker_env={"big": {"FLUX_TEST_GPU": "big"}})
    by = {s.candidate_id: s for s in summaries}
    assert by["ok"].error is None and by["ok"].n_rounds == 2, by["ok"]
    assert (by["big"].error or "").startswith("over the GPU memory budget")
