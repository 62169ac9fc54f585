"""Bench foundations: paired ratios and their intervals, baseline parameters, results storage, opening a plan."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from bench_support import bench_settings, make_plan, session_cache
from hypothesis import given, settings
from hypothesis import strategies as st

from artifacts.errors import NotFound
from engine_bridge.params import EngineParams
from tasks.bench.common import (
    SUMMARY_SCHEMA,
    BenchError,
    BenchRun,
    SummaryRow,
    busy_warning,
    fit_server_args,
    llama_cpp_python_defaults,
    open_bench,
    overall,
    paired_ratio,
    save_run,
)
from tasks.bench.run import prompt_lengths

speeds = st.lists(st.floats(min_value=0.1, max_value=1e4), min_size=2, max_size=30)


def test_a_constant_ratio_is_exact_and_significant() -> None:
    r = paired_ratio([20.0, 40.0, 80.0, 10.0], [10.0, 20.0, 40.0, 5.0])
    assert r.ratio == pytest.approx(2.0) and r.low == pytest.approx(2.0) and r.high == pytest.approx(2.0)
    assert r.outcome == "faster" and r.n == 4
    assert paired_ratio([5.0, 10.0], [10.0, 20.0]).outcome == "slower"


def test_noise_around_one_is_the_same() -> None:
    r = paired_ratio([1.0, 1.2, 0.9, 1.1, 0.8, 1.05], [1.1, 1.0, 1.0, 0.95, 1.0, 1.0])
    assert r.low is not None and r.high is not None and r.low < 1.0 < r.high
    assert r.outcome == "same" and r.p_value is not None


def test_one_disturbed_pair_does_not_decide() -> None:
    # five quiet pairs at parity; one visit of the baseline hit by a burst of load (10x slower)
    r = paired_ratio([10.0, 10.2, 9.9, 10.1, 10.0, 10.0], [10.0, 10.1, 10.0, 10.0, 10.1, 1.0])
    assert r.ratio == pytest.approx(1.0, abs=0.02) and r.outcome == "same"
    assert r.geomean is not None and r.geomean > 1.4


def test_busy_machine_warning() -> None:
    assert busy_warning([0.5, 1.9, 2.9], cpu_count=2) is None  # the engine's own two threads
    warn = busy_warning([0.5, 6.6], cpu_count=2)
    assert warn is not None and "6.6 on 2 CPUs" in warn


def test_missing_and_single_pairs() -> None:
    assert paired_ratio([], []).outcome == "n/a"
    one = paired_ratio([2.0, float("nan"), 0.0], [1.0, 1.0, 1.0])
    assert one.n == 1 and one.ratio == pytest.approx(2.0) and one.outcome == "n/a"


@settings(max_examples=20, deadline=None)
@given(speeds, st.integers(0, 10))
def test_ratio_is_antisymmetric_and_inside_its_interval(xs: list[float], seed: int) -> None:
    ys = [x * (1.3 if i % 2 else 0.8) for i, x in enumerate(xs)]
    ab, ba = paired_ratio(xs, ys, seed=seed, n_boot=300), paired_ratio(ys, xs, seed=seed, n_boot=300)
    assert ab.ratio is not None and ba.ratio is not None
    assert math.isclose(ab.ratio * ba.ratio, 1.0, rel_tol=1e-9)
    assert ab.low is not None and ab.high is not None
    assert ab.low <= ab.ratio * (1 + 1e-9) and ab.ratio <= ab.high * (1 + 1e-9)


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
