"""`flux bench serve` on a tiny twin: real `python -m server` processes, llama-cpp-python in its own process and a
real llama-server; assertions on the store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bench_support import make_plan, session_cache
from test_bench_soak import serve_settings

from artifacts.engine_params import EngineParams
from tasks.bench.context import BenchContext, open_bench
from tasks.bench.record import save_run
from tasks.bench.serve import RAW_SCHEMA, ServeOptions, bench_serve

OPTS = ServeOptions(rounds=2, n_gen=8, park_tokens=300)
# What scripts/bench_serve.py stored in its `bench_serve` table, one row per benchmark.
COLUMNS = {"run_id", "created_at", "benchmark", "model", "plan_id", "ratio_name", "ratio", "ci_low", "ci_high", "n",
           "target", "met", "detail", "seconds", "threads", "load_avg_start", "load_avg_end", "metrics"}


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory, tiny_dense: Path) -> BenchContext:
    st = serve_settings(tmp_path_factory.mktemp("bench-serve"), session_cache(tmp_path_factory), "\n")
    params = EngineParams(n_ctx=1024, n_seq_max=2, n_batch=256, n_ubatch=256, n_threads=1, n_threads_batch=1)
    return open_bench(st, make_plan(st, tiny_dense, params=params).id[:12])


@pytest.fixture(scope="module")
def stored(ctx: BenchContext) -> dict[str, Any]:
    run = bench_serve(ctx, OPTS)
    save_run(run)
    rows = ctx.store.query(f"SELECT * FROM bench_summary WHERE run_id = '{run.run_id}'").to_pylist()
    raw = ctx.store.query(f"SELECT * FROM bench_serve_raw WHERE run_id = '{run.run_id}'").to_pylist()
    return {"run": run, "summary": {r["baseline"]: r for r in rows}, "raw": {r["benchmark"]: r for r in raw}}


def test_every_benchmark_is_one_raw_row_with_the_old_columns(stored: dict[str, Any], ctx: BenchContext) -> None:
    raw = stored["raw"]
    assert set(raw) == set(stored["summary"]) == {"overhead", "peers", "parking", "concurrency"}
    assert set(RAW_SCHEMA.names) | {"run_id"} == COLUMNS
    for name, r in raw.items():
        assert not r["detail"].startswith("error"), (name, r["detail"])
        assert r["plan_id"] == ctx.plan.id and r["threads"] == 1 and r["seconds"] > 0
        assert r["ratio"] is not None and r["ratio"] > 0 and r["met"] is not None, (name, r)
        assert json.loads(r["load_avg_start"]) and isinstance(json.loads(r["metrics"]), dict)


def test_overhead_races_flux_serve_against_llama_cpp_python_in_process(stored: dict[str, Any]) -> None:
    r = stored["raw"]["overhead"]
    m = json.loads(r["metrics"])
    assert r["ratio_name"] == "decode flux/in-process" and r["n"] == 2 * OPTS.rounds
    assert len(m["flux"]) == len(m["in_process"]) == len(m["added_ttft_ms"]) == 2 * OPTS.rounds
    for g in m["flux"] + m["in_process"]:
        assert g["ttft_s"] > 0 and g["tokens"] == OPTS.n_gen and g["decode_tps"] > 0
    assert "added" in r["detail"] and "(target <= 5 ms)" in r["detail"]
    assert stored["summary"]["overhead"]["verdict"] in ("pass", "fail", "info")


def test_peers_race_the_servers_that_are_here(stored: dict[str, Any], ctx: BenchContext) -> None:
    m = json.loads(stored["raw"]["peers"]["metrics"])
    ran = {k.split(" x")[0] for k in m["tps"]}
    assert "flux" in ran and ran | set(m["missing"]) == {"flux", "llama-cpp-python", "llama-server"}
    if ctx.llama_server is not None:
        assert "llama-server" in ran and stored["raw"]["peers"]["ratio_name"] == "tok/s flux/llama-server x2"
        assert set(m["ratios"]) >= {"flux/llama-server x1", "flux/llama-server x2"}
    assert all(len(v) == OPTS.rounds for v in m["tps"].values())
    for peer, why in m["missing"].items():
        assert f"{peer} n/a" in stored["raw"]["peers"]["detail"] and why


def test_a_parked_conversation_comes_back_from_the_cache(stored: dict[str, Any]) -> None:
    r = stored["raw"]["parking"]
    m = json.loads(r["metrics"])
    assert len(m["parked"]) == len(m["cold"]) == OPTS.rounds
    assert all(g["cached"] and g["cached"] > 100 for g in m["parked"]), m["parked"]  # restored, not prefilled
    assert all(not g["cached"] for g in m["cold"]), m["cold"]
    assert stored["summary"]["parking"]["ratio_prefill"] == r["ratio"]


def test_concurrency_and_verdicts(stored: dict[str, Any]) -> None:
    r = stored["raw"]["concurrency"]
    assert r["ratio_name"] == "tok/s 2 streams/1" and len(json.loads(r["metrics"])["tps"]["2"]) == OPTS.rounds
    for name, s in stored["summary"].items():
        raw = stored["raw"][name]
        want = "pass" if raw["met"] else "fail"
        assert s["verdict"] == want or (s["verdict"] == "info" and "inconclusive" in s["detail"]), (name, s)
    assert stored["run"].verdict in ("pass", "fail", "info")


def test_a_plan_of_one_sequence_has_no_concurrency_to_measure(tmp_path_factory: pytest.TempPathFactory,
                                                              tiny_dense: Path) -> None:
    st = serve_settings(tmp_path_factory.mktemp("bench-serve-1"), session_cache(tmp_path_factory), "\n")
    params = EngineParams(n_ctx=512, n_seq_max=1, n_batch=256, n_ubatch=256, n_threads=1, n_threads_batch=1)
    ctx = open_bench(st, make_plan(st, tiny_dense, params=params).id[:12])
    run = bench_serve(ctx, ServeOptions(only=("concurrency",)))
    assert [(r.baseline, r.verdict) for r in run.rows] == [("concurrency", "info")]
    assert "n/a" in run.rows[0].detail and run.raw.to_pylist()[0]["met"] is None
