"""`flux bench ttft` on a tiny twin: llama-cpp-python in its own process, a real worker and a real `python -m server`;
assertions on the store."""

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
from tasks.bench.ttft import TtftOptions, bench_ttft

PROMPTS = 3


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory, tiny_dense: Path) -> BenchContext:
    st = serve_settings(tmp_path_factory.mktemp("bench-ttft"), session_cache(tmp_path_factory), "\n")
    params = EngineParams(n_ctx=512, n_seq_max=2, n_batch=256, n_ubatch=256, n_threads=1, n_threads_batch=1)
    return open_bench(st, make_plan(st, tiny_dense, params=params).id[:12])


def _stored(ctx: BenchContext, opts: TtftOptions) -> dict[str, Any]:
    run = bench_ttft(ctx, opts)
    save_run(run)
    rows = ctx.store.query(f"SELECT * FROM bench_summary WHERE run_id = '{run.run_id}'").to_pylist()
    raw = ctx.store.query(f"SELECT * FROM bench_ttft_raw WHERE run_id = '{run.run_id}'").to_pylist()
    return {"run": run, "summary": {r["baseline"]: r for r in rows}, "raw": raw}


def test_three_arms_time_the_same_prompts(ctx: BenchContext) -> None:
    got = _stored(ctx, TtftOptions(prompts=PROMPTS))
    raw, summary = got["raw"], got["summary"]
    assert set(summary) == {"worker/in-process", "http/worker"} and got["run"].verdict == "info"
    for arm in ("in-process", "worker", "http"):
        mine = [r for r in raw if r["arm"] == arm]
        assert [r["prompt_index"] for r in mine] == list(range(PROMPTS)), arm  # the warm-up is not a row
        assert all(r["mode"] == "arms" and 0 < r["ttft_ms"] < 60_000 for r in mine), mine
    assert all(r["tokenize_ms"] > 0 for r in raw if r["arm"] == "worker")
    m = json.loads(summary["http/worker"]["metrics"])
    assert summary["http/worker"]["ratio_prefill"] == pytest.approx(m["http_ms"] / m["worker_ms"])
    assert summary["worker/in-process"]["ratio_prefill"] == pytest.approx(m["worker_ms"] / m["in_process_ms"])
    assert "added" in summary["http/worker"]["detail"] and "tokenize round trip" in summary["worker/in-process"]["detail"]


def test_pairs_and_busy_replace_the_arms(ctx: BenchContext) -> None:
    got = _stored(ctx, TtftOptions(prompts=PROMPTS, pairs=2, busy=2))
    raw, summary = got["raw"], got["summary"]
    assert set(summary) == {"http-worker-paired", "busy"}
    pairs = [r for r in raw if r["mode"] == "pairs"]
    assert sorted((r["arm"], r["round"], r["prompt_index"]) for r in pairs) == sorted(
        (arm, rnd, i) for arm in ("worker", "http") for rnd in range(2) for i in range(PROMPTS))
    paired = summary["http-worker-paired"]
    assert paired["n_samples"] == 2 * PROMPTS and len(json.loads(paired["metrics"])["added_ms"]) == 2 * PROMPTS
    assert "added by HTTP (paired): median" in paired["detail"] and paired["ratio_prefill"] > 0
    busy = [r for r in raw if r["mode"] == "busy"]
    assert sorted(r["arm"] for r in busy) == ["busy", "busy", "idle", "idle"]
    assert summary["busy"]["n_samples"] == 2 and "while another reply decodes" in summary["busy"]["detail"]
