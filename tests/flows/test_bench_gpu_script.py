"""scripts/bench_gpu.py end to end on a CPU: plan, race and store, as on the H200 (GPU-only baselines skipped).

The GPU baselines (the --n-cpu-moe sweep, most -ngl, llama-server --fit) need a GPU and are skipped by the
script itself when the probe finds none; everything else runs for real: Flux's stages plan the twin under
the script's workload, the plan races in a fresh worker, and the results reach Parquet and the store.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]


def test_bench_gpu_runs_on_a_cpu_and_stores_its_rows(tiny_moe: Path, tmp_path: Path, flux_env: dict[str, str]) -> None:
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_moe, models / "tiny-moe-Q4_0.gguf")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench_gpu.py"), "--out", str(out), "--model-dir", str(models),
         "--pairs", "tiny-moe:0", "--finalists", "2", "--rounds", "1", "--plan-budget-s", "20", "--workload", "chat"],
        env=flux_env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = pq.read_table(out / "h200_results.parquet").to_pylist()
    assert row["model"] == "tiny-moe" and row["plan_family"] == "cpu" and row["plan_tg"] > 0 and row["plan_pp"] > 0
    assert row["plan_agent_s"] > 0 and row["plan_s"] > 0
    assert row["workload"] == "chat" and row["plan_chat_s"] > 0, "the decode-heavy mix races a chat turn too"
    assert row["ncmoe"] is None and row["lcp_ngl"] is None, "no GPU: the GPU baselines are not raced"
    finalists = pq.read_table(out / "h200_finalists.parquet").to_pylist()
    assert len(finalists) == 2 and all(f["meas_decode"] and f["workload"] == "chat" for f in finalists)
    assert "stored" in proc.stdout and "bench_gpu/" in proc.stdout
    data = Path(flux_env["XDG_DATA_HOME"]) / "flux"
    tables = list(data.rglob("bench_gpu/*.parquet"))
    assert tables, f"no bench_gpu table under {data}"
    got = duckdb.sql(f"SELECT model, plan_tg FROM read_parquet('{tables[0]}')").fetchall()
    assert got == [("tiny-moe", row["plan_tg"])]


def load_script() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "scripts" / "bench_gpu.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_budgets_are_per_gpu_and_the_fullest_gpu_decides() -> None:
    # With two GPUs llama.cpp splits the layers its own way; a baseline fits only if no GPU holds more
    # than the per-GPU budget (an 8 GiB budget on two cards is not 16 GiB on one).
    bench = load_script()
    gib = 2**30
    assert bench.within([7 * gib, 8 * gib], 8 * gib)
    assert not bench.within([5 * gib, 9 * gib], 8 * gib), "14 GiB in all, but one card is over"
    assert bench.within([40 * gib], 0), "0 = no budget"
    assert not bench.within(None, 8 * gib), "an unknown use never fits"
    assert bench.vram([7 * gib, 0]) == "7.00"
    assert bench.vram([7 * gib, 8 * gib]) == "15.00 (7.00 + 8.00)"


def test_rescore_drops_the_cold_first_round(tmp_path: Path) -> None:
    # run 3's whole-model row: llama-server's first pp512 ran cold at 3,470 tok/s, then 7,729
    import json

    bench = load_script()
    raw = {"plan": {"pp": [7678.0, 7586.0], "tg": [308.0, 303.9], "agent_s": [0.29, 0.28]},
           "fit": {"pp": [3470.0, 7729.0], "tg": [275.4, 282.1], "agent_s": [0.41, 0.40]}}
    assert abs(bench.ratios(raw)["pp_vs_fit"] - 7632 / 5599.5) < 1e-9, "the median of two rounds is their mean"
    warm = bench.ratios(raw, skip=1)
    assert abs(warm["pp_vs_fit"] - 7586 / 7729) < 1e-9 and abs(warm["agent_vs_fit"] - 0.40 / 0.28) < 1e-9
    path = tmp_path / "h200_results.parquet"
    bench.write_rows([{"run": "run3", "model": "qwen3-30b-a3b", "budget_gib": 0.0, "raw": json.dumps(raw),
                       **bench.ratios(raw)}, {"run": "run1", "model": "llama3-8b", "budget_gib": 0.0, "raw": None}], path)
    bench.rescore(path)
    rows = pq.read_table(path).to_pylist()
    assert rows[0]["pp_vs_fit_warm"] == warm["pp_vs_fit"] and rows[0]["pp_vs_fit"] > 1.3 > rows[0]["pp_vs_fit_warm"]
    assert rows[1]["pp_vs_fit_warm"] is None, "a row without raw rounds has nothing to rescore"
