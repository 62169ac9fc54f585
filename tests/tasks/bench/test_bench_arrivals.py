"""`flux bench arrivals` on tiny-moe: a real `python -m server` and a real llama-server; assertions on the store."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from bench_support import make_plan, session_cache
from test_bench_soak import serve_settings

from artifacts.engine_params import EngineParams
from tasks.bench.arrivals import (
    ArrivalsOptions,
    Workload,
    bench_arrivals,
    chat_messages,
    chat_turns,
)
from tasks.bench.arrivals_stats import engine_stats
from tasks.bench.context import BenchContext, open_bench
from tasks.bench.record import save_run

RATES = (0.5, 1.0, 2.0)
REQUESTS = 5
OPTS = ArrivalsOptions(rates=RATES, requests=REQUESTS, n_gen=8, rounds=1, chat_turns=2, chat_chars=200, calibration=2)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> BenchContext:
    st = serve_settings(tmp_path_factory.mktemp("bench-arrivals"), session_cache(tmp_path_factory),
                        "\n[serve]\nmin_reply = 64\n")
    params = EngineParams(n_ctx=1024, n_seq_max=2, n_batch=256, n_ubatch=256, n_threads=1, n_threads_batch=1)
    plan = make_plan(st, tiny_moe, params=params)
    return open_bench(st, plan.id[:12])


@pytest.fixture(scope="module")
def stored(ctx: BenchContext) -> dict[str, Any]:
    if ctx.llama_server is None:
        pytest.skip("llama-server is not built (scripts/build-backend.sh)")
    run = bench_arrivals(ctx, OPTS)
    save_run(run)
    rows = ctx.store.query(f"SELECT * FROM bench_summary WHERE run_id = '{run.run_id}'").to_pylist()
    return {"run": run, "summary": {r["baseline"]: r for r in rows},
            "raw": ctx.store.get_table("bench_arrivals_raw", run.run_id).to_pylist()}


def test_both_engines_replay_the_same_arrivals(stored: dict[str, Any]) -> None:
    raw = [r for r in stored["raw"] if r["kind"] == "arrival"]
    assert {r["engine"] for r in raw} == {"flux", "llama-server"}
    failed = [{k: r[k] for k in ("engine", "kind", "rate_factor", "index", "error", "e2e_ms", "sent_s")}
              for r in stored["raw"] if r["error"]]
    assert not failed, failed
    by = {(r["engine"], r["rate_factor"], r["index"]): r for r in raw}
    assert len(by) == len(raw) == 2 * len(RATES) * REQUESTS
    for (_, factor, i), r in by.items():
        twin = by[("llama-server", factor, i)]
        assert (r["prompt_tokens"], r["scheduled_s"], r["rate_rps"]) == (twin["prompt_tokens"], twin["scheduled_s"],
                                                                         twin["rate_rps"])
        assert r["ttft_ms"] > 0 and r["e2e_ms"] >= r["ttft_ms"] and 1 <= r["completion_tokens"] <= OPTS.n_gen
        assert r["sent_s"] >= r["scheduled_s"] - 0.01, "no request leaves before its arrival time"
    for factor in RATES:  # a Poisson process from t=0
        at = [by[("flux", factor, i)]["scheduled_s"] for i in range(REQUESTS)]
        assert at[0] == 0.0 and at == sorted(at) and len(set(at)) == REQUESTS


def test_the_long_chat_grows_its_context(stored: dict[str, Any]) -> None:
    chat = [r for r in stored["raw"] if r["kind"] == "chat"]
    for engine in ("flux", "llama-server"):
        for factor in RATES:
            turns = sorted((r for r in chat if r["engine"] == engine and r["rate_factor"] == factor),
                           key=lambda r: r["index"])
            assert len(turns) == 2
            assert turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"] < 1024


def test_summary_rows_report_percentiles_ratios_and_verdicts(stored: dict[str, Any]) -> None:
    rows = stored["summary"]
    assert set(rows) == {"rate-0.5x", "rate-1x", "rate-2x", "chat"}
    for name, r in rows.items():
        m = json.loads(r["metrics"])
        f, b, ratio = m["flux"], m["llama-server"], m["flux_over_llama_server"]
        for stats in (f, b):
            for metric in ("ttft_ms", "itl_ms"):
                p = stats[metric]
                assert p["p50"] is not None and p["p50"] <= p["p95"] <= p["p99"]
        assert ratio["ttft_p50"] == pytest.approx(f["ttft_ms"]["p50"] / b["ttft_ms"]["p50"])
        if name != "chat":
            assert f["throughput_tps"] > 0 and b["throughput_tps"] > 0
            assert ratio["throughput"] == pytest.approx(f["throughput_tps"] / b["throughput_tps"])
            assert m["rates_rps"] == pytest.approx([x * m["capacity_rps"] for x in RATES])
            assert r["n_samples"] == REQUESTS
        assert r["prefill_ci_low"] <= r["ratio_prefill"] <= r["prefill_ci_high"]
        slower = r["prefill_ci_high"] < 1 and (r["ci_high"] is not None and r["ci_high"] < 1)
        assert r["verdict"] == ("fail" if slower or f["errors"] else "pass"), r["detail"]
    assert json.loads(rows["rate-1x"]["metrics"])["capacity_rps"] > 0


def test_without_llama_server_rows_are_info(ctx: BenchContext) -> None:
    alone = dataclasses.replace(ctx, llama_server=None)
    run = bench_arrivals(alone, ArrivalsOptions(rates=(1.0,), requests=2, n_gen=4, rounds=1, chat_turns=0,
                                                capacity=5.0))
    assert [r.baseline for r in run.rows] == ["rate-1x"]
    row = run.rows[0]
    assert row.verdict == "info" and "llama-server is not built" in row.detail
    assert row.metrics["flux"]["requests"] == 2 and row.metrics["llama-server"] is None
    assert {r["engine"] for r in run.raw.to_pylist()} == {"flux"}


# -- pure parts ---------------------------------------------------------------------------------------
def test_offsets_are_cumulative_gaps_over_the_rate() -> None:
    w = Workload(prompts=[[[1]] * 3], gaps=[[2.0, 4.0, 8.0]], chats=[[]], calibration=[[1]])
    assert w.offsets(0, 2.0) == [0.0, 1.0, 3.0]


def test_chat_messages_fold_tools_and_merge_roles() -> None:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"},
            {"role": "assistant", "content": None,
             "tool_calls": [{"id": "1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "1", "content": "a.py"}, {"role": "tool", "tool_call_id": "1", "content": "b"},
            {"role": "assistant", "content": "A2"}, {"role": "user", "content": "U2" * 50}]
    out = chat_messages(msgs, max_chars=20)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert out[2]["content"] == "[tool call] ls({})" and out[3]["content"] == "[tool result] a.py\n\n[tool result] b"
    assert len(out[-1]["content"]) == 20
    turns = chat_turns(out, lambda s: list(s.encode()), budget=10_000, limit=5)
    assert [len(t) for t in turns] == [2, 4, 6]
    assert [len(t) for t in chat_turns(out, lambda s: list(s.encode()), budget=240, limit=5)] == [2, 4]
    assert len(chat_turns(out, lambda s: list(s.encode()), budget=10_000, limit=1)) == 1


def test_engine_stats_count_errors_and_throughput() -> None:
    ok = {"kind": "arrival", "round": 0, "rate_factor": 1.0, "error": None, "ttft_ms": 10.0, "itl_ms": [1.0, 3.0],
          "tpot_ms": 2.0, "completion_tokens": 10, "sent_s": 0.0, "end_s": 2.0}
    bad = {**ok, "error": "HTTP 503", "ttft_ms": None, "itl_ms": []}
    s = engine_stats([ok, {**ok, "sent_s": 1.0, "end_s": 4.0}, bad], "arrival")
    assert s["requests"] == 3 and s["errors"] == 1 and s["throughput_tps"] == pytest.approx(20 / 4)
    assert s["itl_ms"]["p50"] == pytest.approx(2.0) and s["ttft_ms"]["p99"] == pytest.approx(10.0)


def test_flux_bench_arrivals_runs_from_the_cli(ctx: BenchContext, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from flows import cli

    if "flows.commands.bench" not in cli.COMMAND_MODULES:
        monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "flows.commands.bench"))
    args = cli.build_parser().parse_args(["bench", "arrivals", ctx.plan.id[:12], "--rates", "1,3", "--requests", "2",
                                          "--n-gen", "4", "--rounds", "1", "--chat-turns", "0", "--capacity", "4"])
    args.settings = ctx.settings
    assert args.handler(args) in (0, 1)
    assert "flux bench arrivals" in capsys.readouterr().out
    rows = ctx.store.query("SELECT * FROM bench_summary WHERE suite = 'arrivals' ORDER BY created_at").to_pylist()
    last = [r for r in rows if r["run_id"] == rows[-1]["run_id"]]
    assert sorted(r["baseline"] for r in last) == ["rate-1x", "rate-3x"]
    m = json.loads(last[0]["metrics"])
    assert m["capacity_rps"] == 4.0 and m["rates_rps"] == [4.0, 12.0] and m["options"]["requests"] == 2


def test_benchmark_clients_never_reuse_a_connection() -> None:
    # llama-server sometimes drops a pooled connection after a streamed chat reply, and the next request on
    # it gets "Server disconnected without sending a response" (tasks/bench/http.py): benchmark clients
    # open a connection per request, in a burst or after a pause.
    import asyncio

    import httpx

    from tasks.bench.http import client_limits

    async def run() -> int:
        accepted = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            try:
                while await reader.readuntil(b"\r\n\r\n"):
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()  # the client let the connection go

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with httpx.AsyncClient(limits=client_limits()) as client:
            for pause in (0.0, 0.0, 0.3):
                await asyncio.sleep(pause)
                assert (await client.get(f"http://127.0.0.1:{port}/")).text == "ok"
        server.close()
        return accepted

    assert asyncio.run(run()) == 3, "every request opens its own connection"
