"""The step anatomy's headline numbers in the GPU record (#21): from a plan's candidate, from its race's speeds,
and from a saved `flux show` for rows made before the columns existed (H200 run 17's plans and logs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from artifacts.records.search import Candidate
from tasks.bench.step_facts import step_facts, step_facts_from_show, step_times

REPO = Path(__file__).resolve().parents[3]
RUN17 = REPO / "docs" / "benchmarks" / "h200" / "run17"


def _cands(name: str) -> dict[str, Candidate]:
    doc = json.loads((REPO / "tests" / "tasks" / "data" / "h200_memory" / f"memory-{name}.json").read_text())
    return {f["candidate"]["id"]: Candidate.model_validate(f["candidate"]) for f in doc["finalists"]}


def test_a_mapped_split_pays_no_host_round_trip_and_a_host_split_one_per_split_layer() -> None:
    mapped = step_facts(_cands("qwen3.6-35b-a3b-skewed-12-chat-run17")["c202"])
    assert mapped["expert_path"] == "mapped" and mapped["host_round_trips"] == 0 and mapped["split_layers"] == 40
    assert mapped["experts_copied"] > 0 and 0.5 < mapped["hot_pick_share"] <= 1.0
    run17 = _cands("qwen3-next-80b-a3b-skewed-16-chat-run17")
    host = step_facts(run17["c175"])
    assert host["expert_path"] == "host" and host["host_round_trips"] == host["split_layers"] == 48
    assert host["experts_copied"] == 7694, "flux show's figure for plan 98f61bb3cd78"
    layers = step_facts(run17["c143"])  # milp-decode: whole layers' experts on the host, no split
    assert layers["expert_path"] is None and layers["split_layers"] == 0 and layers["host_round_trips"] > 0


def test_the_step_against_the_whole_model_on_the_gpu() -> None:
    got = step_times(50.0, 200.0)
    assert got == {"step_ms": 20.0, "whole_gpu_step_ms": 5.0, "of_whole_gpu": 0.25}
    assert step_times(None, 200.0)["of_whole_gpu"] is None


@pytest.mark.parametrize(("log", "want"), [
    ("show-qwen3-next-80b-a3b-skewed-16-chat.log",
     {"expert_path": "host", "split_layers": 48, "experts_copied": 7694, "hot_pick_share": 0.78,
      "host_round_trips": 48}),
    ("show-qwen3.6-35b-a3b-skewed-12-chat.log",
     {"expert_path": "mapped", "split_layers": 40, "host_round_trips": 0}),
])
def test_a_saved_show_gives_the_split(log: str, want: dict[str, object]) -> None:
    got = step_facts_from_show((RUN17 / log).read_text())
    assert {k: got[k] for k in want} == want
    assert step_facts_from_show("not a show") == {}


def test_the_record_backfill_fills_older_rows_once(tmp_path: Path) -> None:
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.bench.gpu_files import backfill_steps
    (tmp_path / "run17").mkdir()
    shutil.copy(RUN17 / "show-qwen3-next-80b-a3b-skewed-16-chat.log", tmp_path / "run17")
    plan = "98f61bb3cd780b04379b806bbc574141845377735cbe7c9bdaf8f4206548ce99"
    record = tmp_path / "record.parquet"
    pq.write_table(pa.Table.from_pylist([{"run": "r17", "plan_id": plan, "served_decode_tps": 50.0,
                                          "all_gpu_decode_tps": 171.5}, {"run": "r17", "plan_id": None}]), record)
    assert backfill_steps(record) == 1
    row = pq.read_table(record).to_pylist()[0]
    assert row["experts_copied"] == 7694 and row["step_ms"] == 20.0 and row["of_whole_gpu"] == 50.0 / 171.5
    assert backfill_steps(record) == 0, "a row with its step figures is left as it is"
