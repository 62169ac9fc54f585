"""The routing watch of a real server: the picks its worker counts, the live share beside the plan's, the one
warning, the served trace (/flux/routing and the file saved on shutdown).

The plans are hand-built (tests/server/conftest.py): one keeps per-expert copies of tiny-moe's experts (the
patched backend's split with the CPU as the hot device, as tests/engine_bridge/test_expert_split.py runs it) and
claims its planning trace put 95% of the picks there, so served traffic falls far below it; the other has no
per-expert copies.
"""

from __future__ import annotations

import io
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
from support import SERVE_TOML, ServeEnv, Server, serve_env, start_server, stop_server

from artifacts.engine_params import EngineParams, ExpertSplit
from artifacts.records.plan import Plan
from engine_bridge.ops import ServeRouting
from engine_bridge.serve_trace import served_trace_path, trace_array, trace_meta
from server.routing_watch import NOT_APPLICABLE, hot_share

HOT = {0: [1], 1: [2], 2: [3], 3: [4]}  # one expert of 8 per layer: about an eighth of the picks
WATCH_TOML = SERVE_TOML + """
[serve.routing]
sample_every = 1
window_tokens = 16
warn_points = 15
check_s = 0.2
"""


@pytest.fixture(scope="module")
def wenv(tmp_path_factory: pytest.TempPathFactory) -> ServeEnv:
    return serve_env(tmp_path_factory.mktemp("routing-watch"), WATCH_TOML + 'count = "split"\n')


@pytest.fixture(scope="module")
def split_plan(wenv: ServeEnv, tiny_moe: Path, plan_maker: Callable[..., Plan]) -> Plan:
    """A plan of tiny-moe whose per-expert copies (HOT) took 95% of its planning trace's picks."""
    base = plan_maker(wenv.settings, tiny_moe, n_seq_max=2)
    params = EngineParams(n_ctx=512, n_seq_max=2, n_batch=16, n_ubatch=16, n_threads=1, n_threads_batch=1,
                          expert_split=ExpertSplit.on("CPU", HOT))
    cand = base.candidate.model_copy(update={"params": params, "hot_share": [0.95] * 4})
    return plan_maker(wenv.settings, tiny_moe, n_ctx=512, n_seq_max=2, candidate=cand.model_dump())


@pytest.fixture(scope="module")
def split_server(wenv: ServeEnv, split_plan: Plan) -> Iterator[Server]:
    srv = start_server(wenv, split_plan.id)
    yield srv
    stop_server(srv)


def _complete(srv: Server, prompt: str, n: int) -> int:
    """Tokens the reply's decode steps fed (its first token came from the prompt's step; a reply cut by max_tokens
    never feeds its last, one that stopped fed its last to get the end-of-generation token)."""
    r = httpx.post(f"{srv.base}/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                       "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return int(body["usage"]["completion_tokens"]) - (body["choices"][0]["finish_reason"] == "length")


def test_served_picks_below_the_plans_share_warn_once(wenv: ServeEnv, split_plan: Plan, split_server: Server) -> None:
    for i in range(3):
        _complete(split_server, f"served traffic number {i} goes elsewhere", 24)
    r = split_server.stats()["routing"]
    assert r["plan_share"] == pytest.approx(0.95)
    assert r["sampled_tokens"] >= 3 * 20, "every decode step is counted (sample_every 1)"
    assert 0 < r["live_share"] < 0.5 and 0 < r["window_share"] < 0.5
    assert r["window_tokens"] >= 16 and r["warned"] is True
    _complete(split_server, "more of the same", 24)
    split_server.stats()
    log = split_server.log.read_text()
    assert log.count("--routing-from") == 1, "one warning, however long the share stays low"
    words = "".join(log.split())  # the log's console wraps long lines
    assert f"`fluxplan{split_plan.model_path}--routing-from{split_plan.id[:12]}`" in words
    assert "pointsbelowthe95%" in words

    got = httpx.get(f"{split_server.base}/flux/routing", timeout=30)
    assert got.status_code == 200 and got.headers["content-type"].startswith("application/vnd.apache.parquet")
    table = pq.read_table(io.BytesIO(got.content))
    meta, counts = trace_meta(table), trace_array(table)
    assert meta["source"] == "serve" and meta["plan_id"] == split_plan.id and meta["model_hash"] == split_plan.model_hash
    tokens = int(meta["n_tokens"])
    assert tokens >= r["sampled_tokens"] and (counts.sum(axis=1) == tokens * int(meta["n_expert_used"])).all()
    mask = np.zeros(counts.shape, dtype=bool)
    for layer, experts in HOT.items():
        mask[layer, experts] = True
    assert hot_share(counts, mask) == pytest.approx(split_server.stats()["routing"]["live_share"])

    metrics = httpx.get(f"{split_server.base}/metrics", timeout=30).text
    assert 'flux_routing_hot_share{source="plan"} 0.95' in metrics
    assert 'flux_routing_hot_share{source="live"}' in metrics and "flux_routing_sampled_tokens_total" in metrics


def test_the_trace_is_saved_on_shutdown_and_resumed(wenv: ServeEnv, split_plan: Plan) -> None:
    path = served_trace_path(wenv.settings.data_dir, split_plan.id)
    srv = start_server(wenv, split_plan.id)
    try:
        before = srv.stats()["routing"]["sampled_tokens"]
        _complete(srv, "one more request", 12)
        after = srv.stats()["routing"]["sampled_tokens"]
    finally:
        stop_server(srv)
    assert after >= before + 11, "a new run goes on from the saved trace"
    meta = trace_meta(pq.read_table(path))
    assert int(meta["n_tokens"]) == after, "the server's last look was saved when it stopped"


def test_a_plan_without_per_expert_copies_has_no_share(wenv: ServeEnv, tiny_moe: Path, server: Server,
                                                        plan_maker: Callable[..., Plan]) -> None:
    """With count = "split" a plan without copies counts nothing: the callback would cost its every step; with
    count = "moe" it counts (a trace for --routing-from) and still has no share to watch."""
    _complete(server, "no copies to watch", 8)
    r = server.stats()["routing"]
    assert r["plan_share"] == r["live_share"] == r["window_share"] == NOT_APPLICABLE
    assert r["sampled_tokens"] == 0 and r["sample_every"] == 0 and r["warned"] is False
    assert httpx.get(f"{server.base}/flux/routing", timeout=30).status_code == 404
    moe = serve_env(wenv.root / "moe", WATCH_TOML + 'count = "moe"\n')
    srv = start_server(moe, plan_maker(moe.settings, tiny_moe).id)
    try:
        fed = _complete(srv, "no copies to watch", 8)
        r = srv.stats()["routing"]
        metrics = httpx.get(f"{srv.base}/metrics", timeout=30).text
    finally:
        stop_server(srv)
    assert r["plan_share"] == r["live_share"] == NOT_APPLICABLE and r["sampled_tokens"] == fed > 0 and not r["warned"]
    assert 'flux_routing_hot_share{source="plan"}' not in metrics and f"flux_routing_sampled_tokens_total {fed}.0" in metrics


def test_the_share_is_the_mean_of_the_layers_hot_shares() -> None:
    counts = np.array([[6, 2, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=np.int64)
    hot = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 1]], dtype=bool)
    # layer 0: 6/8, layer 1: 2/4, layer 2 routed nothing (counted as 0 of 0)
    assert hot_share(counts, hot) == pytest.approx((0.75 + 0.5 + 0.0) / 3)
    assert hot_share(np.zeros((2, 4), dtype=np.int64), hot[:2]) is None
    assert ServeRouting(architecture="qwen3moe", n_layer=0, n_expert=0, n_expert_used=0, every=0).picks == 0


def test_counts_survive_a_worker_restart(wenv: ServeEnv, split_server: Server) -> None:
    """A restarted worker counts from zero; what the server had read of the old one stays in the trace (picks
    since the server's last look at a worker that died are lost with it)."""
    _complete(split_server, "before the restart", 10)
    before = split_server.stats()["routing"]["sampled_tokens"]
    pid = split_server.worker_pid()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while split_server.stats()["worker"]["restarts"] < 1 or split_server.worker_pid() == pid:
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.2)
    fed = _complete(split_server, "after the restart", 10)
    r = split_server.stats()["routing"]
    assert r["sampled_tokens"] == before + fed and fed > 0
    assert r["window_tokens"] == fed, "the window is the new worker's"
