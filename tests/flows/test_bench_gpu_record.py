"""The GPU record's rows and files (`flux bench record`, tasks/bench/gpu_rows.py and gpu_files.py): a run's rows are
appended to the docs' record once, columns united; scripts/bench_gpu.py is the suite under its old name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.bench import gpu_files, gpu_rows

REPO = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "scripts" / "bench_gpu.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["bench_gpu"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_the_old_script_is_flux_bench_record() -> None:
    record_argv = _script().record_argv
    assert record_argv(["--out", "o", "--pairs", "a:8,b:0", "--rounds", "2"]) == [
        "bench", "record", "a:8,b:0", "--out", "o", "--rounds", "2"]
    assert record_argv(["--pairs=a:8#4k/64k", "--out", "o"]) == ["bench", "record", "a:8#4k/64k", "--out", "o"]
    assert record_argv(["--import", "--out", "o", "--record", "r.parquet"]) == [
        "bench", "record", "--import", "--out", "o", "--record", "r.parquet"]


def test_rows_append_once_with_every_column(tmp_path: Path) -> None:
    record = tmp_path / "record.parquet"
    pq.write_table(pa.Table.from_pylist([{"run": "r7", "plan_id": "a", "tg_vs_fit": None}]), record)
    out = tmp_path / "out"
    out.mkdir()
    gpu_files.write_rows([{"run": "r9", "plan_id": "b", "tg_vs_fit": 0.55, "fit_gpu_gib": 9.82}],
                         out / gpu_files.RESULTS)
    assert gpu_files.append_record(out, record) == 1
    assert gpu_files.append_record(out, record) == 0, "the same run and plan are not added twice"
    rows = pq.read_table(record).to_pylist()
    assert [r["plan_id"] for r in rows] == ["a", "b"]
    assert rows[1]["fit_gpu_gib"] == 9.82 and rows[0]["fit_gpu_gib"] is None, "a later row's new column is kept"


def test_a_per_expert_plan_is_compared_with_its_best_whole_tensor_finalist() -> None:
    """The record's "plan vs its best whole-tensor finalist" (#20): every per-expert family, mapped or host
    split, with its context suffix, against the fastest measured finalist whose experts stay whole tensors."""
    from types import SimpleNamespace as NS


    def summary(cid: str, decode: float | None, work: float | None) -> NS:
        return NS(candidate_id=cid, decode_tps=decode, prefill_tps=500.0, workload_s=work)

    finalists = [summary("c1", 140.0, 2.2), summary("c2", 100.0, 3.4), summary("c3", 90.0, 3.0),
                 summary("c4", None, None)]
    families = {"c1": "experts-mapped@32768", "c2": "milp-decode@32768", "c3": "milp-prefill", "c4": "all-gpu"}
    plan = NS(finalists=finalists, families=families, candidate=NS(family="experts-mapped@32768"),
              measured=NS(decode_tps=140.0, workload_s=2.2))
    got = gpu_rows.whole_tensor_facts(plan)  # type: ignore[arg-type]
    assert got["whole_id"] == "c3" and got["whole_family"] == "milp-prefill", "the fastest workload, not decode"
    assert got["tg_vs_whole"] == 140.0 / 90.0 and got["workload_vs_whole"] == 3.0 / 2.2
    plan.candidate = NS(family="milp-decode@32768")
    assert gpu_rows.whole_tensor_facts(plan) == {}, "a whole-tensor plan has no such comparison"  # type: ignore[arg-type]


def test_a_depth_race_gives_one_row_per_depth(tmp_path: Path) -> None:
    """--depths (issue 53): the depth race's rows (one per contender and depth, tasks/bench/served_depths.py) become
    one record row per depth, in depth order: the plan's readings beside its bytes bound, --fit's readings and the
    ratios, a depth --fit's context did not hold and one the plan's did not; appended to the record's
    depths.parquet once."""
    import json


    def row(name: str, verdict: str = "info", ratio: float | None = None, **m: object) -> dict[str, object]:
        return {"baseline": name, "verdict": verdict, "ratio_decode": ratio, "ratio_prefill": ratio and ratio * 2,
                "metrics": json.dumps({"ctx": 262144, "gen_tokens": 64, "race": "solo visits", **m})}

    rows = [row("plan@32768", depth=32768, contender="plan", decode_tps=60.0, prefill_tps=900.0, bound_decode_tps=120.0,
                of_bound=0.5, plan_gpu_bytes=12 * 2**30),
            row("fit@32768", ratio=1.2, depth=32768, contender="fit", decode_tps=50.0, baseline_gpu_bytes=12 * 2**30),
            row("plan@4096", depth=4096, contender="plan", decode_tps=80.0, bound_decode_tps=130.0),
            row("fit@4096", ratio=1.25, depth=4096, contender="fit", decode_tps=64.0),
            row("plan@262144", depth=262144, contender="plan", decode_tps=20.0, bound_decode_tps=40.0),
            row("fit@262144", depth=262144, contender="fit", not_held="d262144 not held: ..."),
            row("plan@524288", depth=524288, skipped=True),
            row("n-cpu-moe", detail="n/a: dense model")]
    got = gpu_rows.depth_rows("r30", "m-skewed-12", "p1", rows)
    assert [r["depth_tokens"] for r in got] == [4096, 32768, 262144, 524288]
    assert got[0]["tg_vs_fit"] == 1.25 and got[0]["plan_decode_tps"] == 80.0 and got[0]["plan_bound_decode_tps"] == 130.0
    assert got[1]["plan_of_bound"] == 0.5 and got[1]["fit_gpu_gib"] == 12 and got[1]["ctx"] == 262144
    assert got[1]["fit_valid"] is True and got[1]["pp_vs_fit"] == 2.4
    assert got[2]["fit_not_held"] and got[2]["fit_valid"] is False and got[2]["tg_vs_fit"] is None
    assert got[3]["skipped"] is True and got[3].get("plan_decode_tps") is None
    assert gpu_rows.depth_rows("r30", "t", "p1", [{"baseline": "n-cpu-moe", "verdict": "info", "metrics": "{}"}]) == []
    out = tmp_path / "out"
    out.mkdir()
    gpu_files.write_rows([{"run": "r30", "plan_id": "p1"}], out / gpu_files.RESULTS)
    gpu_files.write_rows(got, out / gpu_files.DEPTHS)
    record = tmp_path / "record.parquet"
    gpu_files.append_record(out, record)
    gpu_files.append_record(out, record)
    assert [r["depth_tokens"] for r in pq.read_table(tmp_path / "depths.parquet").to_pylist()] == [
        4096, 32768, 262144, 524288]
