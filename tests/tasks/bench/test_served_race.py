"""The served race's pure parts on synthetic tables: the visit order alternates, a visit's turns pair by round,
a baseline whose solo and race readings disagree is an invalid row (no ratio reported, the run fails), and a
stopped contender's leftover process is found and ended before the next contender starts."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import psutil
import pyarrow as pa
import pytest

from tasks.bench.engines import TrialTiming
from tasks.bench.record import BenchRun, overall
from tasks.bench.run import RunOptions
from tasks.bench.served import summary_row
from tasks.bench.served_contenders import Contender, Probe, Turn
from tasks.bench.served_race import (
    AGREE,
    TRIAL_SCHEMA,
    medians,
    solo_check,
    stopped_alone,
    visit_order,
    visit_readings,
)

TURN = Turn(name="t", prompt=32, gen=64)
OPTS = RunOptions(via="serve", rounds=4, n_boot=200)


@pytest.mark.parametrize(("n", "rounds", "seed"), [(3, 4, 0), (4, 6, 7), (2, 3, 1), (1, 2, 0)])
def test_each_round_visits_every_contender_once_in_alternating_order(n: int, rounds: int, seed: int) -> None:
    orders = visit_order(n, rounds, seed)
    assert len(orders) == rounds
    assert all(sorted(o) == list(range(n)) for o in orders)
    assert all(orders[r + 1] == orders[r][::-1] for r in range(rounds - 1))  # ABC, CBA, ABC, ...
    if rounds % 2 == 0:  # over an even number of rounds every contender's mean position is the middle
        for i in range(n):
            assert sum(o.index(i) for o in orders) / rounds == pytest.approx((n - 1) / 2)
    assert visit_order(n, rounds, seed) == orders


def _table(visits: dict[str, list[list[float]]]) -> pa.Table:
    """Rows of a race: ``visits[engine][round]`` holds that visit's decode readings (prefill 10x, turn 1 s)."""
    rows: list[dict[str, Any]] = []
    v = 0
    for rnd in range(max(len(x) for x in visits.values())):
        for engine, by_round in visits.items():
            for k, dec in enumerate(by_round[rnd] if rnd < len(by_round) else []):
                rows.append({"engine": engine, "round": rnd, "visit": v, "turn": 0, "prompt_index": 1 + k,
                             "prefill_tps": dec * 10, "decode_tps": dec, "turn_s": 100 / dec})
            v += 1
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in TRIAL_SCHEMA} for r in rows], schema=TRIAL_SCHEMA)


def _probe(decode_tps: float) -> Probe:
    return Probe(args=["-t", "2"], gpu_bytes=None, timing=TrialTiming(
        prompt_tokens=32, prompt_ms=10.0, gen_tokens=63, gen_ms=63 / decode_tps * 1e3, source="test"))


def _baseline(name: str = "n-cpu-moe") -> Contender:
    return Contender(name, "llama-server (synthetic)", lambda: ("", None, lambda: None))


def test_a_visit_reads_the_median_of_its_turns_and_the_race_the_median_of_its_visits() -> None:
    table = _table({"plan": [[100, 110], [90, 96], [120, 124]]})
    assert visit_readings(table, "plan", 0, "decode_tps") == {0: 105, 1: 93, 2: 122}
    assert medians(table, "plan", 0)["decode_tps"] == 105


def test_a_baseline_that_agrees_with_its_sweep_probe_is_a_result() -> None:
    table = _table({"plan": [[200, 202]] * 4, "n-cpu-moe": [[100, 101], [99, 100], [102, 100], [100, 100]]})
    check = solo_check("n-cpu-moe", _probe(102.0), table)
    assert check["invalid"] is None and check["solo_vs_race"] < AGREE
    row = summary_row(_baseline(), table, [TURN], OPTS, {}, _probe(102.0))
    assert row.verdict == "pass" and row.ratio_decode == pytest.approx(2.0, rel=0.03)
    assert row.metrics["solo_decode_tps"] == pytest.approx(102.0) and row.metrics["race_decode_tps"] == 100.25


def test_the_h100_race_is_invalid_not_a_win() -> None:
    """The H100 run of 2026-12-07: the sweep read 53.4 tok/s alone, the race 31.6 with every contender
    resident; the race printed 3.70x and kept its reading. Now the row is invalid: no ratio, the run fails."""
    table = _table({"plan": [[109.5, 109.5], [109.4, 109.6]], "n-cpu-moe": [[31.4, 31.8], [31.5, 31.7]]})
    row = summary_row(_baseline(), table, [TURN], OPTS.model_copy(update={"rounds": 2}), {"plan_flag": None},
                      _probe(53.4))
    assert row.verdict == "invalid" and row.detail.startswith("invalid: ")
    assert "53.4" in row.detail and "31.6" in row.detail and "stands" not in row.detail
    assert row.ratio_decode is None and row.ratio_prefill is None and row.ci_low is None
    m = row.metrics
    assert m["baseline_valid"] is False
    assert m["solo_vs_race"] == pytest.approx(abs(53.4 - 31.6) / 31.6, rel=1e-3)
    assert m["unreported"]["decode"]["ratio"] == pytest.approx(109.5 / 31.6, rel=0.01)  # kept for diagnosis only
    assert m["per_turn"]["t"]["turn_speedup"] is None and m["unreported"]["turn_speedup"]["t"] is not None
    assert overall([row.verdict, "pass"]) == "invalid"  # `flux bench run` exits 1 (flows/commands/bench.py)


def test_invalid_outranks_a_budget_flag_and_a_flag_alone_stays_info() -> None:
    table = _table({"plan": [[200, 200]] * 2, "fit": [[100, 100], [80, 80]]})
    flagged = _baseline("fit")
    flagged.flag = "held 5.00 GiB, 50% of the 10.00 GiB budget"
    assert summary_row(flagged, table, [TURN], OPTS, {}).verdict == "invalid"
    steady = _table({"plan": [[200, 200]] * 2, "fit": [[100, 100], [100, 101]]})
    row = summary_row(flagged, steady, [TURN], OPTS, {})
    assert row.verdict == "info" and row.detail.startswith("not a result") and row.ratio_decode is None


def test_fit_has_no_sweep_so_its_first_visit_is_its_solo_reading() -> None:
    drifted = solo_check("fit", None, _table({"fit": [[100, 100], [80, 82], [81, 80]]}))
    assert drifted["solo_decode_tps"] == 100 and drifted["invalid"] is not None
    assert "first visit" in drifted["solo_source"] and drifted["sweep_vs_race"] is None
    steady = solo_check("fit", None, _table({"fit": [[100, 100], [99, 101], [101, 100]]}))
    assert steady["invalid"] is None and steady["solo_vs_race"] < AGREE
    once = solo_check("fit", None, _table({"fit": [[100, 100]]}))
    assert once["invalid"] is None and once["solo_vs_race"] is None and "no later visit" in once["solo_source"]


def test_no_paired_visit_of_an_invalid_baseline_still_fails() -> None:
    table = _table({"plan": [[]], "n-cpu-moe": [[30, 30]]})
    row = summary_row(_baseline(), table, [TURN], OPTS, {}, _probe(50.0))
    assert row.verdict == "invalid" and row.detail.startswith("invalid: ")
    assert BenchRun(suite="run", ctx=None, rows=[row], raw=table).verdict == "invalid"  # type: ignore[arg-type]


BURN = "import time\nwhile True: time.time()"
LEAKY_PARENT = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {BURN!r}], start_new_session=True)
time.sleep(3600)
"""


def test_a_process_that_outlives_its_contenders_stop_is_ended_before_the_next_starts() -> None:
    """A contender whose child left its process group survives the group's SIGKILL and would burn a core
    beside the next contender: the race sees it alive after the stop, kills it, and says so."""
    parent = subprocess.Popen([sys.executable, "-c", LEAKY_PARENT], start_new_session=True)
    procs: list[psutil.Process] = []
    try:
        while len(procs) < 2:
            procs = [psutil.Process(parent.pid), *psutil.Process(parent.pid).children(recursive=True)]
            time.sleep(0.05)
        parent.kill()  # the contender's stop: only its own process (group) goes
        parent.wait()
        said: list[str] = []
        assert stopped_alone("leaky", procs, said.append, timeout_s=1.0) == [procs[1].pid]
        assert said and "outlived its stop" in said[0]
        assert not procs[1].is_running() or procs[1].status() == psutil.STATUS_ZOMBIE
    finally:
        for p in procs[1:]:
            if p.is_running():
                p.kill()
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    clean = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    tree = [psutil.Process(clean.pid)]
    clean.terminate()
    clean.wait()
    assert stopped_alone("clean", tree, said.append, timeout_s=1.0) == [] and len(said) == 1
