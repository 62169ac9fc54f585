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
