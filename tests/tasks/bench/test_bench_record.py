"""Bench foundations: verdicts, baseline parameters, results storage, opening a plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from bench_support import bench_settings, make_plan, session_cache

from artifacts.engine_params import EngineParams
from artifacts.errors import NotFound
from tasks.bench.context import open_bench
from tasks.bench.engines import fit_server_args, llama_cpp_python_defaults
from tasks.bench.errors import BenchError
from tasks.bench.record import SUMMARY_SCHEMA, BenchRun, SummaryRow, overall, save_run
from tasks.bench.run import prompt_lengths


def test_overall_verdict() -> None:
    assert overall(["pass", "info"]) == "pass"
    assert overall(["pass", "fail", "info"]) == "fail"
    assert overall(["info"]) == overall([]) == "info"


def test_baseline_parameters() -> None:
    plan = EngineParams(n_ctx=2048, n_seq_max=2, n_batch=256, n_ubatch=128, n_threads=3, n_threads_batch=3,
                        flash_attn=True, type_k="q8_0", type_v="q8_0", load_mode="load")
    d = llama_cpp_python_defaults(plan, cpu_count=8)
    assert (d.n_ctx, d.n_batch, d.n_ubatch, d.n_threads, d.n_threads_batch) == (2048, 512, 512, 4, 8)
    assert not d.flash_attn and d.load_mode == "mmap" and d.n_gpu_layers == 0 and d.type_v == "f16"
    args = fit_server_args(plan)
    assert args == ("-c", "4096", "-np", "2")  # -c is split among the slots: each holds the plan's n_ctx
    assert not {"-ngl", "-ot", "--n-gpu-layers", "--override-tensor"} & set(args)  # they would turn fit off


def test_prompt_lengths_leave_room_to_decode() -> None:
    assert prompt_lengths(2048, 32, 3) == [64, 256, 1024]
    assert prompt_lengths(512, 32, 4) == [64, 256, 64, 256]
    assert prompt_lengths(64, 32, 1) == [16]


def test_a_run_is_stored_as_raw_rows_and_one_summary_row_per_baseline(tmp_path: Path, tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    st_, _ = bench_settings(tmp_path, session_cache(tmp_path_factory))
    plan = make_plan(st_, tiny_moe)
    ctx = open_bench(st_, plan.id[:10])
    raw = pa.table({"engine": ["plan", "defaults"], "decode_tps": [10.0, 5.0]})
    rows = [SummaryRow(baseline="defaults", verdict="pass", ratio_decode=2.0, ci_low=1.5, ci_high=2.5,
                       metrics={"note": "x", "nested": {"a": [1, 2]}}),
            SummaryRow(baseline="n-cpu-moe", verdict="info", detail="n/a: no GPU")]
    run = BenchRun(suite="run", ctx=ctx, rows=rows, raw=raw)
    paths = save_run(run)
    assert len(paths) == 3 and all(p.is_file() for p in paths)
    assert run.verdict == "pass"
    got = ctx.store.query("SELECT * FROM bench_summary ORDER BY baseline").to_pylist()
    assert [r["baseline"] for r in got] == ["defaults", "n-cpu-moe"]
    assert {r["run_id"] for r in got} == {run.run_id} and got[0]["plan_id"] == plan.id
    assert got[0]["backend_build"] == plan.backend_build and got[0]["created_at"] is not None
    assert got[0]["ratio_decode"] == 2.0 and got[1]["ratio_decode"] is None
    assert json.loads(got[0]["metrics"])["nested"] == {"a": [1, 2]}
    assert set(ctx.store.query("SELECT * FROM bench_summary").column_names) == set(SUMMARY_SCHEMA.names)
    back = ctx.store.get_table("bench_run_raw", run.run_id).to_pylist()
    assert [r["engine"] for r in back] == ["plan", "defaults"] and back[0]["run_id"] == run.run_id
    keys = [r["id"] for r in ctx.store.list("bench_summary")]
    assert all(k.startswith(f"{plan.id[:16]}.run.") and plan.backend_build in k for k in keys)


def test_opening_a_plan_whose_model_is_gone_or_changed(tmp_path: Path, tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    st_, _ = bench_settings(tmp_path, session_cache(tmp_path_factory))
    model = tmp_path / "copy.gguf"
    shutil.copy(tiny_moe, model)
    plan = make_plan(st_, model)
    with pytest.raises(NotFound):
        open_bench(st_, "ffffffff")
    with model.open("r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x01" * 8)
    with pytest.raises(BenchError, match="changed since plan"):
        open_bench(st_, plan.id[:8])
    model.unlink()
    with pytest.raises(BenchError, match="which is gone"):
        open_bench(st_, plan.id[:8])
