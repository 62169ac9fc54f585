"""The measure stage: real workers, paired rounds, budget, and a crashing candidate as a row."""

from __future__ import annotations

from pathlib import Path

from engine_bridge.params import EngineParams
from tasks.measure import TRIAL_SCHEMA, measure
from tasks.models import Candidate, Placement


def cand(cid: str, **kw: object) -> Candidate:
    params = EngineParams(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1, **kw)  # type: ignore[arg-type]
    return Candidate(id=cid, family="test", placement=Placement(layer_device=["CPU"]), params=params,
                     weights_bytes={}, kv_bytes={}, compute_bytes={})


def test_a_crashing_candidate_is_a_row_and_the_others_are_measured(tiny_moe: Path, tmp_path: Path) -> None:
    finalists = [cand("good"), cand("crash"), cand("fa", flash_attn=True)]
    prompts = [list(range(10, 42)), list(range(50, 114))]
    summaries, table, spent, stopped = measure(
        finalists, tiny_moe, prompts, 4, budget_s=120, repeats=2, timeout_s=60, log_path=tmp_path / "w.log",
        worker_env={"crash": {"FLUX_WORKER_FAULT": "abort-on-load"}})
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


def test_the_budget_stops_further_rounds(tiny_moe: Path, tmp_path: Path) -> None:
    summaries, table, spent, stopped = measure(
        [cand("a"), cand("b")], tiny_moe, [list(range(10, 40))], 2, budget_s=0.01, repeats=5, timeout_s=60,
        log_path=tmp_path / "w.log")
    assert stopped
    assert {r["round"] for r in table.to_pylist()} == {0}, "the first round always runs; later ones respect the budget"
