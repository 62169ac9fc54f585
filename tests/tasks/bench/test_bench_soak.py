"""`flux bench soak` against a real `python -m server` subprocess on a slow dense twin; assertions on the store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from bench_support import bench_settings, make_plan, session_cache

from artifacts.config import Settings, load_settings
from artifacts.engine_params import EngineParams
from tasks.bench.context import BenchContext, open_bench
from tasks.bench.errors import BenchError
from tasks.bench.record import save_run
from tasks.bench.soak import BEHAVIORS, Exchange, SoakOptions, bench_soak, classify, plan_waves, serve_toml

# A dense twin ~10x slower than tiny-moe (as tests/server's): a 400-token reply lasts seconds, long enough
# to kill the worker under it on a busy 2-core machine.
# Two sequences, two waiting places: a wave of 6 overloads the server (some requests get 429).
SERVE_TOML = """
[serve]
min_reply = 64
queue_max = 2
queue_wait_s = 4.0
"""
REQUESTS = 14


def serve_settings(root: Path, cache: Path, extra_toml: str = SERVE_TOML) -> Settings:
    """bench_support's settings with [serve] overrides."""
    _, env = bench_settings(root, cache)
    config = Path(env["FLUX_CONFIG"])
    config.write_text(config.read_text() + extra_toml)
    return load_settings(env)


@pytest.fixture(scope="module")
def ctx(tmp_path_factory: pytest.TempPathFactory, slow_model: Path) -> BenchContext:
    st = serve_settings(tmp_path_factory.mktemp("bench-soak"), session_cache(tmp_path_factory))
    params = EngineParams(n_ctx=1024, n_seq_max=2, n_batch=256, n_ubatch=256, n_threads=1, n_threads_batch=1)
    plan = make_plan(st, slow_model, params=params)
    return open_bench(st, plan.id[:12])


@pytest.fixture(scope="module")
def stored(ctx: BenchContext) -> dict[str, Any]:
    """One soak with faults, saved; what the store holds afterwards."""
    run = bench_soak(ctx, SoakOptions(requests=REQUESTS, seconds=60, concurrency_factor=3, max_tokens=16,
                                      victim_tokens=400, seed=1))
    save_run(run)
    summary = ctx.store.query(f"SELECT * FROM bench_summary WHERE run_id = '{run.run_id}'").to_pylist()
    return {"run": run, "summary": {r["baseline"]: r for r in summary},
            "raw": ctx.store.get_table("bench_soak_raw", run.run_id).to_pylist()}


def test_soak_passes_with_nothing_hung_or_lost(stored: dict[str, Any]) -> None:
    main = stored["summary"]["flux-serve"]
    raw = stored["raw"]
    assert len(raw) == REQUESTS and sorted(r["index"] for r in raw) == list(range(REQUESTS))
    assert not [r for r in raw if r["outcome"] in ("hung", "lost")], [r for r in raw if r["outcome"] in ("hung", "lost")]
    metrics = json.loads(main["metrics"])
    assert main["verdict"] == "pass", main["detail"]
    assert main["n_samples"] == REQUESTS and sum(metrics["outcomes"].values()) == REQUESTS
    assert metrics["end"]["slots_freed"] and metrics["end"]["server_alive"]
    assert metrics["wave_size"] == 6 and metrics["waves"] == 3 and metrics["concurrency"] == 2


def test_overload_is_refused_explicitly_with_retry_after(stored: dict[str, Any]) -> None:
    refused = [r for r in stored["raw"] if r["status"] in (429, 503)]
    assert refused, "6 requests at once on 2 sequences + 2 waiting places: some must be refused"
    for r in refused:
        assert r["outcome"] == "errored" and r["retry_after"] and r["error_code"], r


def test_each_behavior_ends_as_it_should(stored: dict[str, Any]) -> None:
    raw = stored["raw"]
    assert {r["behavior"] for r in raw} >= {"stream", "disconnect", "victim"}
    admitted = [r for r in raw if r["status"] == 200]
    for r in admitted:
        allowed = {"stream": {"completed", "errored"}, "slow": {"completed", "errored"},
                   "plain": {"completed", "errored"}, "cancel": {"cancelled", "completed", "errored"},
                   "disconnect": {"resumed", "completed"}, "victim": {"errored", "resumed"}}[r["behavior"]]
        assert r["outcome"] in allowed, r
    for r in admitted:
        if r["behavior"] == "disconnect" and r["outcome"] == "resumed":
            assert r["events"] == 3 and r["resumed_events"] >= 1 and "each once" in r["detail"]
        if r["outcome"] == "cancelled":
            assert r["finish_reason"] == "cancelled"


def test_worker_kills_are_survived(stored: dict[str, Any]) -> None:
    rows = stored["summary"]
    idle, mid = rows["fault:kill-idle"], rows["fault:kill-mid"]
    assert idle["verdict"] == "pass", idle["detail"]
    m = json.loads(idle["metrics"])
    assert m["new_pid"] != m["pid"] and m["recover_s"] > 0
    assert mid["verdict"] == "pass", mid["detail"]
    victim = json.loads(mid["metrics"])["victim"]
    assert victim["error_code"] == "worker_died"
    assert stored["run"].verdict == "pass"


def test_a_plan_measured_elsewhere_is_one_clear_error(tmp_path_factory: pytest.TempPathFactory,
                                                      slow_model: Path) -> None:
    st = serve_settings(tmp_path_factory.mktemp("bench-soak-bad"), session_cache(tmp_path_factory))
    plan = make_plan(st, slow_model, hardware_fingerprint="another-machine")  # flux serve refuses it
    with pytest.raises(BenchError, match="hardware_fingerprint differs"):
        bench_soak(open_bench(st, plan.id[:12]), SoakOptions(requests=1))


# -- pure parts ---------------------------------------------------------------------------------------
def _ex(status: int | None = 200, events: list[tuple[int | None, str]] | None = None, done: bool = False,
        **kw: Any) -> Exchange:
    return Exchange(t0=0.0, status=status, sse=status == 200 and "body" not in kw, events=events or [], done=done,
                    **kw)


CHUNK = '{"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}'
END = '{"choices":[{"index":0,"delta":{},"finish_reason":"cancelled"}]}'
ERR = '{"error":{"message":"m","type":"server_error","param":null,"code":"worker_died"}}'


def test_classify_each_outcome() -> None:
    ok = _ex(events=[(1, CHUNK), (2, CHUNK)], done=True)
    assert classify(ok, None, None, cancel=False)[0] == "completed"
    assert classify(_ex(events=[(1, CHUNK), (2, ERR)], done=True), None, None, False)[0] == "errored"
    assert classify(_ex(status=429, body=ERR, retry_after="3"), None, None, False)[0] == "errored"
    assert classify(_ex(status=500, body="Internal Server Error"), None, None, False)[0] == "lost"
    assert classify(_ex(hung=True), None, None, False)[0] == "hung"
    assert classify(_ex(events=[(1, CHUNK), (3, CHUNK)], done=True), None, None, False)[0] == "lost"
    early = _ex(events=[(1, CHUNK), (2, CHUNK)])
    assert classify(early, None, None, False)[0] == "lost"
    tail = _ex(events=[(3, CHUNK), (4, END)], done=True)
    whole = _ex(events=early.events + tail.events, done=True)
    assert classify(early, tail, whole, cancel=False)[0] == "resumed"
    assert classify(early, tail, whole, cancel=True)[0] == "cancelled"
    assert classify(early, _ex(events=[(4, END)], done=True), None, False)[0] == "lost", "event 3 missing"
    assert classify(early, _ex(events=[(2, CHUNK), (3, END)], done=True), None, False)[0] == "lost", "2 repeated"
    other = _ex(events=[(1, CHUNK), (2, END), (3, CHUNK), (4, END)], done=True)
    assert classify(early, tail, other, False)[0] == "lost", "journal differs from what was sent"
    assert classify(early, _ex(status=404, body=ERR), None, False)[0] == "lost"
    assert classify(early, _ex(hung=True), None, False)[0] == "hung"


def test_waves_overload_and_put_the_victim_last() -> None:
    waves = plan_waves(SoakOptions(requests=20, concurrency_factor=2.5, seed=3), concurrency=4, n_ctx=512)
    assert [len(w) for w in waves] == [10, 10]
    assert waves[-1][0].behavior == "victim" and waves[-1][0].max_tokens == 256
    assert sum(r.behavior == "victim" for w in waves for r in w) == 1
    assert {r.behavior for w in waves for r in w} == set(BEHAVIORS)
    no_faults = plan_waves(SoakOptions(requests=20, concurrency_factor=2.5, seed=3, faults=False), 4, 512)
    assert all(r.behavior != "victim" for w in no_faults for r in w)


def test_serve_toml_round_trips_the_settings(tmp_path: Path) -> None:
    st = serve_settings(tmp_path / "a", tmp_path / "cache")
    config = tmp_path / "serve.toml"
    config.write_text(serve_toml(st))
    again = load_settings({"FLUX_CONFIG": str(config), "HOME": str(tmp_path / "elsewhere")})
    assert again.serve == st.serve and again.data_dir == st.data_dir and again.cache_dir == st.cache_dir
    assert again.serve.queue_max == 2


def test_flux_bench_soak_runs_from_the_cli_and_stores_its_run(ctx: BenchContext, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    from flows import cli

    if "flows.commands.bench" not in cli.COMMAND_MODULES:
        monkeypatch.setattr(cli, "COMMAND_MODULES", (*cli.COMMAND_MODULES, "flows.commands.bench"))
    args = cli.build_parser().parse_args(["bench", "soak", ctx.plan.id[:12], "--requests", "4", "--seconds", "30",
                                          "--concurrency-factor", "2", "--no-faults"])
    args.settings = ctx.settings
    assert args.handler(args) == 0
    assert "flux bench soak" in capsys.readouterr().out
    rows = ctx.store.query("SELECT * FROM bench_summary WHERE suite = 'soak' ORDER BY created_at").to_pylist()
    last = [r for r in rows if r["run_id"] == rows[-1]["run_id"]]
    assert [r["baseline"] for r in last] == ["flux-serve"] and last[0]["verdict"] == "pass"
    options = json.loads(last[0]["metrics"])["options"]
    assert (options["requests"], options["concurrency_factor"], options["faults"]) == (4, 2.0, False)
