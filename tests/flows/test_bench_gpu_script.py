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


def test_budgets_are_per_gpu_and_the_fullest_gpu_decides() -> None:
    # With two GPUs llama.cpp splits the layers its own way; a baseline fits only if no GPU holds more
    # than the per-GPU budget (an 8 GiB budget on two cards is not 16 GiB on one).
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "scripts" / "bench_gpu.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gib = 2**30
    assert bench.within([7 * gib, 8 * gib], 8 * gib)
    assert not bench.within([5 * gib, 9 * gib], 8 * gib), "14 GiB in all, but one card is over"
    assert bench.within([40 * gib], 0), "0 = no budget"
    assert not bench.within(None, 8 * gib), "an unknown use never fits"
    assert bench.vram([7 * gib, 0]) == "7.00"
    assert bench.vram([7 * gib, 8 * gib]) == "15.00 (7.00 + 8.00)"
