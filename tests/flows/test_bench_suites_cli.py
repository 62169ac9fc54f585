"""`flux bench oracle|serve|ttft` through the real CLI in a subprocess, against an isolated data dir with a tiny plan."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_support import bench_settings, make_plan, session_cache
from test_bench_cli import flux

from artifacts.engine_params import EngineParams
from artifacts.store import Store
from tasks.bench.registry import ORDER, suites


def test_each_suite_is_declared_once_in_order_with_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from flows import cli

    assert list(suites()) == list(ORDER)
    parser = cli.build_parser()
    for suite in ("oracle", "serve", "ttft"):
        with pytest.raises(SystemExit) as done:
            parser.parse_args(["bench", suite, "--help"])
        assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--grid-rounds", "--only", "--park-tokens", "--n-gen", "--pairs", "--busy", "--max-tokens"):
        assert flag in out, flag


def test_ttft_runs_stores_and_shows_in_the_matrix(tmp_path_factory: pytest.TempPathFactory, tiny_dense: Path) -> None:
    st, env = bench_settings(tmp_path_factory.mktemp("bench-suites-cli"), session_cache(tmp_path_factory))
    params = EngineParams(n_ctx=512, n_batch=256, n_ubatch=256, n_threads=1, n_threads_batch=1)
    plan = make_plan(st, tiny_dense, params=params)

    bad = flux(env, "bench", "serve", plan.id[:12], "--only", "overhead,bogus")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "--only" in bad.stderr

    got = flux(env, "bench", "ttft", plan.id[:12], "--prompts", "2")
    assert got.returncode == 0, got.stderr
    assert "flux bench ttft" in got.stdout and "worker/in-process" in got.stdout and "http/worker" in got.stdout
    raw = Store(st.data_dir).query("SELECT arm, mode FROM bench_ttft_raw").to_pylist()
    assert sorted(r["arm"] for r in raw) == ["http", "http", "in-process", "in-process", "worker", "worker"]

    matrix = flux(env, "bench", "matrix")
    assert matrix.returncode == 0
    header = next(x for x in matrix.stdout.splitlines() if "plan" in x and "run" in x)
    assert [c for c in header.split() if c in ORDER] == [n for n, s in suites().items() if s.subject == "plan"]
    assert "info" in next(x for x in matrix.stdout.splitlines() if plan.id[:12] in x)


def test_synth_takes_a_preset_not_a_plan_and_stays_out_of_the_matrix(tmp_path: Path) -> None:
    st, env = bench_settings(tmp_path / "flux")
    got = flux(env, "bench", "synth", "tiny-moe", "--repeat", "2", "--dir", str(tmp_path))
    assert got.returncode == 0, got.stderr
    assert "flux bench synth: no plan" in got.stdout and "writer/plain" in got.stdout
    assert "bench_synth_raw" in got.stderr
    rows = Store(st.data_dir).query("SELECT plan_id, suite FROM bench_summary").to_pylist()
    assert rows == [{"plan_id": "", "suite": "synth"}]
    matrix = flux(env, "bench", "matrix")
    assert matrix.returncode == 0 and "synth" not in matrix.stdout

    bad = flux(env, "bench", "synth", "no-such-model")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "invalid choice" in bad.stderr
