"""`flux bench record` end to end on a CPU: `flux plan`, `flux show`, `flux bench run --via serve`, the record.

The suite only drives the user's commands; on a CPU the race still runs for real (flux serve of the plan
against llama-server --fit over HTTP) and its row carries the plan id, the context and the ratios.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[2]


def test_bench_gpu_drives_the_user_path_and_records_the_plan_it_raced(tiny_moe: Path, tmp_path: Path,
                                                                     flux_env: dict[str, str]) -> None:
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_moe, models / "tiny-moe-Q4_0.gguf")
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "flows", "bench", "record", "tiny-moe:0@1024", "--out", str(out), "--model-dir",
         str(models), "--plan-budget-s", "30", "--rounds", "1", "--baselines", "fit", "--depths", "256,2048",
         "--depth-rounds", "1"],
        env=flux_env, capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (row,) = pq.read_table(out / "h200_results.parquet").to_pylist()
    assert row["model"] == "tiny-moe" and row["routing"] == "uniform" and row["ctx"] == 1024 and row["plan_s"] > 0
    shown = (out / "show-tiny-moe-uniform-0@1024.log").read_text()
    assert row["plan_id"][:12] in shown and "ranked by the workload's time" in shown
    assert row["tg_vs_fit"] and row["pp_vs_fit"] and row["agent_vs_fit"], "the race against --fit ran"
    assert row["served_decode_tps"] and row["http_vs_plan_decode"], "decode through HTTP vs the plan's own"
    assert "-fitc 1024" in row["fit_note"], "--fit holds the plan's context"
    assert row["race_ram_read_gbs"] > 0 and row["probe_ram_read_gbs"] > 0, "the host was read around the race"
    bench_log = (out / "bench-tiny-moe-uniform-0@1024.log").read_text()
    assert "flux serve" in bench_log and "stored run" in bench_log
    # --depths: the plan raced against --fit once more at each depth (flux bench run --via serve --depths); 2,048
    # tokens do not fit the plan's 1,024-token context: skipped, and the row says so
    depths = pq.read_table(out / "h200_depths.parquet").to_pylist()
    assert [r["depth_tokens"] for r in depths] == [256, 2048]
    held, past = depths
    assert held["plan_id"] == row["plan_id"] and held["plan_decode_tps"] and held["fit_decode_tps"]
    assert held["plan_bound_decode_tps"], "the plan's decode beside the bytes bound of its probe"
    assert past["skipped"] is True and not past.get("plan_decode_tps")
    assert "depth 2,048: skipped" in (out / "depths-tiny-moe-uniform-0@1024.log").read_text()
    data = Path(flux_env["XDG_DATA_HOME"]) / "flux"
    tables = list(data.rglob("bench_gpu/*.parquet"))
    assert tables, f"no bench_gpu table under {data}"
    rel = duckdb.sql(f"SELECT plan_id, ctx FROM read_parquet('{tables[0]}')")
    assert rel is not None
    got = rel.fetchall()
    assert got == [(row["plan_id"], 1024)]
    # stored and printed as every suite's run: one info row per pair, the pair's row in its metrics
    assert "flux bench record" in proc.stdout and "tiny-moe-uniform-0@1024" in proc.stdout
    summary = list(data.rglob("bench_summary/*.parquet"))
    mine = [r for t in summary for r in pq.read_table(t).to_pylist() if r["suite"] == "record"]
    assert [(r["baseline"], r["verdict"], r["plan_id"]) for r in mine] == [("tiny-moe-uniform-0@1024", "info", "")]
    assert mine[0]["ratio_decode"] == row["tg_vs_fit"] and row["plan_id"] in mine[0]["metrics"]
