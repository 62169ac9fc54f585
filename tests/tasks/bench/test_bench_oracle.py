"""`flux bench oracle` on a tiny twin: a stored plan and its stored space of three candidates, every race in real
workers; assertions on the store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bench_support import bench_settings, make_plan, session_cache

from artifacts.engine_params import EngineParams
from artifacts.records.search import PlacementSpace
from tasks.bench.context import BenchContext, open_bench
from tasks.bench.errors import BenchError
from tasks.bench.oracle import RAW_SCHEMA, OracleOptions, bench_oracle, stored_space
from tasks.bench.record import save_run

OPTS = OracleOptions(rounds=2, grid_rounds=1)
# What scripts/bench_plan.py stored in its `bench_plan` table, one row per model.
COLUMNS = {"model", "plan_id", "plan_s", "grid_s", "grid_size", "oracle", "plan_candidate", "plan_prefill", "plan_decode",
           "defaults_prefill", "defaults_decode", "oracle_prefill", "oracle_decode", "vs_oracle_workload",
           "vs_oracle_prefill", "vs_oracle_decode", "vs_defaults_workload", "vs_defaults_prefill",
           "vs_defaults_decode", "at"}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory, tiny_dense: Path) -> BenchContext:
    st, _ = bench_settings(tmp_path_factory.mktemp("bench-oracle"), session_cache(tmp_path_factory))
    params = EngineParams(n_ctx=256, n_batch=128, n_ubatch=128, n_threads=1, n_threads_batch=1)
    plan = make_plan(st, tiny_dense, params=params, workload_lengths=[32, 64], workload_n_gen=4,
                     stage_seconds={"total": 12.5})
    ctx = open_bench(st, plan.id[:12])
    others = [plan.candidate.model_copy(update={"id": cid, "params": params.model_copy(update=change)})
              for cid, change in (("c001", {"n_ubatch": 64, "n_batch": 64}), ("c002", {"flash_attn": True}))]
    space = PlacementSpace(candidates=[*others[:1], plan.candidate, *others[1:]], rejected={},
                           memory_limits={"CPU": 8 << 30}, n_ctx=256, n_seq=1)
    ctx.store.put_json("space", space)
    return ctx


@pytest.fixture(scope="module")
def stored(ctx: BenchContext) -> dict[str, Any]:
    run = bench_oracle(ctx, OPTS)
    save_run(run)
    rows = ctx.store.query(f"SELECT * FROM bench_summary WHERE run_id = '{run.run_id}'").to_pylist()
    raw = ctx.store.get_table("bench_oracle_raw", run.run_id).to_pylist()
    return {"run": run, "summary": {r["baseline"]: r for r in rows}, "raw": raw}


def test_the_row_has_the_planning_benchmarks_columns(stored: dict[str, Any], ctx: BenchContext) -> None:
    assert set(RAW_SCHEMA.names) == COLUMNS
    [row] = stored["raw"]
    assert row["plan_id"] == ctx.plan.id and row["plan_candidate"] == "c000" and row["grid_size"] == 3
    assert row["plan_s"] == 12.5 and row["grid_s"] > 0 and row["oracle"] in ("c000", "c001", "c002")
    for k in COLUMNS - {"model", "plan_id", "oracle", "plan_candidate", "at", "grid_size"}:
        assert row[k] is not None and row[k] > 0, k


def test_every_candidate_of_the_space_was_timed_and_the_fastest_is_the_oracle(stored: dict[str, Any]) -> None:
    m = json.loads(stored["summary"]["oracle"]["metrics"])
    grid = m["grid"]
    assert set(grid) == {"c000", "c001", "c002"} and not any(g["error"] for g in grid.values())
    assert stored["raw"][0]["oracle"] == min(grid, key=lambda c: grid[c]["workload"])
    assert m["lengths"] == [32, 64] and m["n_gen"] == 4
    assert set(m["final"]) == {"plan", "defaults", "oracle"}


def test_summary_rows_carry_the_paired_ratios(stored: dict[str, Any]) -> None:
    oracle, defaults = stored["summary"]["oracle"], stored["summary"]["defaults"]
    raw = stored["raw"][0]
    assert oracle["verdict"] == "info" and defaults["verdict"] in ("pass", "fail", "info")
    for name, row in (("oracle", oracle), ("defaults", defaults)):
        assert row["ratio_prefill"] == pytest.approx(raw[f"vs_{name}_prefill"])
        assert row["ratio_decode"] == pytest.approx(raw[f"vs_{name}_decode"])
        assert row["n_samples"] == OPTS.rounds and f"plan/{name}: workload" in row["detail"]
    assert "planner 12 s vs exhaustive grid" in oracle["detail"] and "(3 candidates)" in oracle["detail"]


def test_a_plan_without_a_stored_space_is_a_clear_error(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                        tiny_dense: Path) -> None:
    st, _ = bench_settings(tmp_path, session_cache(tmp_path_factory))
    ctx = open_bench(st, make_plan(st, tiny_dense).id[:12])
    with pytest.raises(BenchError, match="no stored search space holds plan"):
        stored_space(ctx)
