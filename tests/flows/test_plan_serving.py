"""`flux plan --serving-p95-ms` (issue 54 item 4): real plans of the tiny MoE twin on the CPU (the real Prefect flow,
real workers batching 1, 2 and 4 streams in one context) record the serving curve, keep the count the rule picks,
serve it, and say what an unmeetable limit reached; the rule itself as a property of any curve."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from artifacts.config import load_settings
from artifacts.records.kinds import PLAN
from artifacts.records.plan import Plan
from artifacts.records.serving import ServingPoint
from artifacts.records.store import Records
from server.service import load_spec
from tasks.measurement.concurrency import ROUNDS, choose, sequence_counts

REPO = Path(__file__).resolve().parents[2]
BUDGET = 25
MEETABLE_MS = 100000.0  # any count's p95 is within this: the rule keeps the most aggregate tok/s
UNMEETABLE_MS = 0.001  # no decode step of a worker is this fast


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("servingplan")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_", "XDG_DATA", "XDG_CONFIG"))}
    env.update({"XDG_DATA_HOME": str(root / "data"), "XDG_CONFIG_HOME": str(root / "config"),
                "PREFECT_HOME": str(root / "prefect"), "PYTHONPATH": str(REPO)})
    return {"env": env, "data": root / "data" / "flux"}


def flux(env: object, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows", *args], env=env, cwd=REPO,  # type: ignore[call-overload, no-any-return]
                          capture_output=True, text=True, timeout=BUDGET + 600)


def _plan(home: dict[str, object], model: Path, p95_ms: float) -> Plan:
    out = flux(home["env"], "plan", str(model), "--budget-s", str(BUDGET), "--ctx", "256", "--concurrency", "4",
               "--serving-p95-ms", f"{p95_ms:g}")
    assert out.returncode == 0, out.stderr[-4000:]
    pid = out.stdout.strip().splitlines()[-1]
    return Records.at(Path(str(home["data"]))).get(PLAN, pid)


@pytest.fixture(scope="module")
def meetable(home: dict[str, object], tiny_moe: Path) -> Plan:
    return _plan(home, tiny_moe, MEETABLE_MS)


@pytest.fixture(scope="module")
def unmeetable(home: dict[str, object], tiny_moe: Path) -> Plan:
    return _plan(home, tiny_moe, UNMEETABLE_MS)


def test_the_plan_records_the_curve_of_1_2_and_4_sequences_timed_together(meetable: Plan) -> None:
    s = meetable.serving
    assert s is not None and s.p95_ms == MEETABLE_MS
    assert [p.sequences for p in s.curve] == [1, 2, 4]
    for p in s.curve:
        assert p.error is None, p
        assert p.aggregate_tps and p.aggregate_tps > 0 and p.p95_token_ms and p.p95_token_ms > 0, p
        assert p.p50_token_ms is not None and p.p50_token_ms <= p.p95_token_ms, p
        assert p.tokens >= p.sequences * p.rounds and 1 <= p.rounds <= ROUNDS, p  # every stream of every round ran
    assert len({p.rounds for p in s.curve}) == 1  # every count once a round
    assert s.candidate_id in {f.candidate_id for f in meetable.finalists}


def test_the_plan_keeps_the_count_with_the_most_tokens_per_second_within_the_limit_and_serves_it(
        meetable: Plan) -> None:
    s = meetable.serving
    assert s is not None and s.met
    best = max((p for p in s.curve if (p.p95_token_ms or 0) <= MEETABLE_MS), key=lambda p: p.aggregate_tps or 0)
    assert meetable.sequences == s.sequences == best.sequences
    assert any(n.startswith(f"--serving-p95-ms {MEETABLE_MS:g}: {best.sequences} sequence(s)") for n in meetable.notes)
    # flux serve loads the worker with that many sequences and admits that many at once
    assert load_spec(load_settings(), meetable).params.n_seq_max == best.sequences


def test_flux_show_prints_the_throughput_latency_curve(home: dict[str, object], meetable: Plan) -> None:
    shown = flux(home["env"], "show", meetable.id[:12])
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("serving curve of "))
    assert f"serves {meetable.sequences} sequence(s)" in lines[head]
    rows = lines[head + 1:head + 4]
    for n, row in zip((1, 2, 4), rows, strict=True):
        assert re.fullmatch(rf"\s+{n} at once: \d+\.\d tok/s, p95 \d+\.\d ms/token \(p50 \d+\.\d\)(  <- served)?", row), row
    assert sum("<- served" in r for r in rows) == 1


def test_an_unmeetable_limit_serves_the_lowest_p95_and_the_note_names_it_and_the_flag_that_meets_it(
        unmeetable: Plan) -> None:
    s = unmeetable.serving
    assert s is not None and not s.met
    low = min(s.curve, key=lambda p: p.p95_token_ms or math.inf)
    assert unmeetable.sequences == low.sequences
    note = next(n for n in unmeetable.notes if n.startswith("no sequence count met --serving-p95-ms"))
    m = re.search(r"the best p95 per-token latency reached was (\d+\.\d) ms \((\d+) sequence\(s\).*--serving-p95-ms "
                  r"(\d+) would meet it", note)
    assert m is not None, note
    assert float(m.group(1)) == pytest.approx(low.p95_token_ms, abs=0.051) and int(m.group(2)) == low.sequences
    assert int(m.group(3)) >= (low.p95_token_ms or 0)


def test_the_flag_without_a_concurrency_to_choose_from_is_one_line(home: dict[str, object], tiny_moe: Path) -> None:
    out = flux(home["env"], "plan", str(tiny_moe), "--serving-p95-ms", "50")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--serving-p95-ms 50" in out.stderr and "--concurrency" in out.stderr


def test_counts_double_up_to_the_most() -> None:
    assert sequence_counts(1) == [1] and sequence_counts(4) == [1, 2, 4] and sequence_counts(6) == [1, 2, 4, 6]


points = st.builds(ServingPoint, sequences=st.integers(1, 64),
                   aggregate_tps=st.floats(0.1, 1e4), p95_token_ms=st.floats(0.1, 1e4), p50_token_ms=st.none())


@given(st.lists(points, min_size=1, max_size=8), st.floats(0.1, 1e4))
def test_the_choice_is_the_fastest_within_the_limit_else_the_lowest_p95(curve: list[ServingPoint],
                                                                      limit: float) -> None:
    c = choose("cand", curve, limit)
    within = [p for p in curve if (p.p95_token_ms or 0) <= limit]
    if within:
        assert c.met and c.sequences in {p.sequences for p in within
                                         if p.aggregate_tps == max(q.aggregate_tps or 0 for q in within)}
    else:
        low = min(p.p95_token_ms or 0 for p in curve)
        assert not c.met and c.sequences in {p.sequences for p in curve if p.p95_token_ms == low}
        assert f"--serving-p95-ms {math.ceil(low)} would meet it" in c.note and math.ceil(low) >= low
