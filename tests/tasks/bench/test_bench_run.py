"""`flux bench run` on a tiny twin: real workers, real llama-server; assertions on what the store holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bench_support import bench_settings, make_plan, session_cache

from artifacts.engine_params import EngineParams
from engine_bridge.llama_server import LlamaServer, LlamaServerError
from engine_bridge.machine_facts import cpu_info
from tasks.bench.context import BenchContext, open_bench
from tasks.bench.engines import EngineSpec
from tasks.bench.record import save_run
from tasks.bench.run import RunOptions, bench_run, race

ROUNDS = 2


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> BenchContext:
    """A stored CPU plan for tiny-moe, opened for benchmarking."""
    st, _ = bench_settings(tmp_path_factory.mktemp("bench-run"), session_cache(tmp_path_factory))
    plan = make_plan(st, tiny_moe)
    return open_bench(st, plan.id[:12])


@pytest.fixture(scope="module")
def stored(ctx: BenchContext) -> dict[str, Any]:
    """One real run (every baseline), saved; what the store holds afterwards."""
    if ctx.llama_server is None:
        pytest.skip("llama-server is not built (scripts/build-backend.sh)")
    run = bench_run(ctx, RunOptions(rounds=ROUNDS, prompts=2, n_gen=6))
    save_run(run)
    summary = ctx.store.query(f"SELECT * FROM bench_summary WHERE run_id = '{run.run_id}' ORDER BY baseline")
    return {"run": run, "summary": summary.to_pylist(),
            "raw": ctx.store.get_table("bench_run_raw", run.run_id).to_pylist()}


def test_every_engine_ran_every_round_on_the_same_prompts(stored: dict[str, Any]) -> None:
    raw = stored["raw"]
    assert not [r for r in raw if r["error"]]
    engines = {r["engine"] for r in raw}
    assert engines == {"plan", "llama-server", "defaults"}
    for e in engines:
        mine = [r for r in raw if r["engine"] == e]
        assert sorted({r["round"] for r in mine}) == list(range(ROUNDS))
        assert len(mine) == ROUNDS * 2
        assert all(r["prefill_tps"] > 0 and r["decode_tps"] > 0 and r["start_s"] is not None for r in mine)
    # paired: the same prompt (by length) for every engine
    by_prompt = {(r["engine"], r["prompt_index"]): r["prompt_tokens"] for r in raw}
    assert {by_prompt[(e, 0)] for e in engines} == {64} and {by_prompt[(e, 1)] for e in engines} == {256}
    # randomized: each round's visits are numbered in the order they ran
    assert len({r["visit"] for r in raw}) == 3 * ROUNDS


def test_summary_rows_have_ratios_intervals_and_verdicts(stored: dict[str, Any]) -> None:
    rows = {r["baseline"]: r for r in stored["summary"]}
    assert set(rows) == {"llama-server", "defaults", "n-cpu-moe"}
    for name in ("llama-server", "defaults"):
        r = rows[name]
        assert r["suite"] == "run" and r["n_samples"] == ROUNDS * 2
        assert r["ci_low"] <= r["ratio_decode"] <= r["ci_high"]
        assert r["prefill_ci_low"] <= r["ratio_prefill"] <= r["prefill_ci_high"]
        slower = r["ci_high"] < 1 or r["prefill_ci_high"] < 1
        if json.loads(r["metrics"])["busy"]:  # a shared test machine: no claim either way
            assert r["verdict"] == "info" and r["detail"].startswith("inconclusive: machine busy")
        else:
            assert r["verdict"] == ("fail" if slower else "pass")
    ncm = rows["n-cpu-moe"]
    assert ncm["verdict"] == "info" and ncm["ratio_decode"] is None
    assert ncm["detail"] in ("n/a: no GPU", "n/a: dense model (no experts)") or ncm["detail"].startswith("n/a")
    verdicts = {r["verdict"] for r in rows.values()}
    assert stored["run"].verdict == ("fail" if "fail" in verdicts else "pass" if "pass" in verdicts else "info")


def test_llama_server_baseline_keeps_its_automatic_fit(stored: dict[str, Any]) -> None:
    row = next(r for r in stored["summary"] if r["baseline"] == "llama-server")
    engine = json.loads(row["metrics"])["engine"]
    assert engine["kind"] == "llama-server" and list(engine["args"]) == ["-c", "512", "-np", "1"]
    assert json.loads(row["metrics"])["prompt_lengths"] == [64, 256]
    # what it held is recorded: no -t, so llama.cpp's default of every physical core (the plan runs its own)
    assert engine["note"].endswith(f"its default threads ({cpu_info().physical_cores}: every physical core)"), engine


def test_a_failing_engine_is_a_row_and_is_not_visited_again(ctx: BenchContext) -> None:
    small = EngineSpec(name="too-small", kind="worker", params=EngineParams(n_ctx=32, n_batch=32, n_ubatch=32))
    table = race([small], ctx, [list(range(40, 104))], n_gen=4, rounds=3).to_pylist()
    assert len(table) == 1, "a failed engine is not visited in later rounds"
    assert table[0]["engine"] == "too-small" and table[0]["prompt_index"] == -1 and table[0]["error"]
    assert table[0]["prefill_tps"] is None


def test_llama_server_starts_answers_and_stops(ctx: BenchContext) -> None:
    if ctx.llama_server is None:
        pytest.skip("llama-server is not built")
    srv = LlamaServer(ctx.llama_server, ctx.model, ["-c", "256", "-np", "1"], log_path=ctx.server_log)
    with srv:
        pid, port = srv.pid, srv.port
        t = srv.timed_completion(list(range(40, 72)), 4)
        assert t.prompt_n == 32 and t.predicted_n == 4 and t.prompt_ms > 0 and t.cache_n == 0
        with pytest.raises(LlamaServerError) as err:
            srv.request("GET", "/no-such-endpoint")
        assert err.value.status == 404
    assert pid is not None and port is not None and not srv.alive
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    with pytest.raises(LlamaServerError, match="no such model"):
        LlamaServer(ctx.llama_server, ctx.model.with_name("missing.gguf")).start()
