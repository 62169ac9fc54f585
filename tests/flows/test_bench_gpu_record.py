"""scripts/bench_gpu.py --import --record: a run's rows are appended to the docs' record once, columns united."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "scripts" / "bench_gpu.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_rows_append_once_with_every_column(tmp_path: Path) -> None:
    bench_gpu = _script()
    record = tmp_path / "record.parquet"
    pq.write_table(pa.Table.from_pylist([{"run": "r7", "plan_id": "a", "tg_vs_fit": None}]), record)
    out = tmp_path / "out"
    out.mkdir()
    bench_gpu.write_rows([{"run": "r9", "plan_id": "b", "tg_vs_fit": 0.55, "fit_gpu_gib": 9.82}],
                         out / bench_gpu.RESULTS)
    assert bench_gpu.append_record(out, record) == 1
    assert bench_gpu.append_record(out, record) == 0, "the same run and plan are not added twice"
    rows = pq.read_table(record).to_pylist()
    assert [r["plan_id"] for r in rows] == ["a", "b"]
    assert rows[1]["fit_gpu_gib"] == 9.82 and rows[0]["fit_gpu_gib"] is None, "a later row's new column is kept"


def test_a_per_expert_plan_is_compared_with_its_best_whole_tensor_finalist() -> None:
    """The record's "plan vs its best whole-tensor finalist" (#20): every per-expert family, mapped or host
    split, with its context suffix, against the fastest measured finalist whose experts stay whole tensors."""
    from types import SimpleNamespace as NS

    bench_gpu = _script()

    def summary(cid: str, decode: float | None, work: float | None) -> NS:
        return NS(candidate_id=cid, decode_tps=decode, prefill_tps=500.0, workload_s=work)

    finalists = [summary("c1", 140.0, 2.2), summary("c2", 100.0, 3.4), summary("c3", 90.0, 3.0),
                 summary("c4", None, None)]
    families = {"c1": "experts-mapped@32768", "c2": "milp-decode@32768", "c3": "milp-prefill", "c4": "all-gpu"}
    plan = NS(finalists=finalists, families=families, candidate=NS(family="experts-mapped@32768"),
              measured=NS(decode_tps=140.0, workload_s=2.2))
    got = bench_gpu.whole_tensor_facts(plan)
    assert got["whole_id"] == "c3" and got["whole_family"] == "milp-prefill", "the fastest workload, not decode"
    assert got["tg_vs_whole"] == 140.0 / 90.0 and got["workload_vs_whole"] == 3.0 / 2.2
    plan.candidate = NS(family="milp-decode@32768")
    assert bench_gpu.whole_tensor_facts(plan) == {}, "a whole-tensor plan has no such comparison"
