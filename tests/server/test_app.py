"""The app in-process (Litestar's TestClient, real worker): journal expiry and eviction, health, stats."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from litestar.testing import TestClient
from support import ServeEnv, serve_env

from artifacts.records.plan import Plan
from server.app import create_app

TOML = """
[serve]
min_reply = 64
journal_ttl_s = 1.0
journal_max_bytes = 9000
"""


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, plan_maker: object, tiny_moe: Path) -> Iterator[TestClient]:
    env: ServeEnv = serve_env(tmp_path_factory.mktemp("app"), TOML)
    plan: Plan = plan_maker(env.settings, tiny_moe, n_ctx=512, n_seq_max=2)  # type: ignore[operator]
    with TestClient(app=create_app(env.settings, plan)) as c:
        yield c


def _complete(c: TestClient, rid: str, n: int) -> None:
    r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": n, "stream": True},
               headers={"x-request-id": rid})
    assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]")


def test_completed_journal_expires_after_ttl(client: TestClient) -> None:
    _complete(client, "ttl-1", 2)
    assert client.get("/v1/requests/ttl-1/events?after=0").status_code == 200
    time.sleep(1.2)
    r = client.get("/v1/requests/ttl-1/events?after=0")
    assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"


def test_byte_budget_evicts_oldest_completed_first(client: TestClient) -> None:
    rids = [f"fill-{i}" for i in range(40)]
    for i, rid in enumerate(rids):
        _complete(client, rid, 16)
        kept = [client.get(f"/v1/requests/{r}/events").status_code == 200 for r in rids[: i + 1]]
        assert kept == sorted(kept), "evicted oldest first"
        assert kept[-1], "the newest completed request is kept"
        assert client.get("/flux/stats").json()["journal"]["bytes"] <= 9000
        if not kept[0]:
            return
    raise AssertionError("the byte budget never evicted anything")


def test_health_and_models(client: TestClient) -> None:
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["worker"]["alive"] and len(h["plan_id"]) == 64
    m = client.get("/v1/models").json()["data"][0]
    assert m["context_length"] == 512 and m["meta"]["n_seq_max"] == 2
    assert m["meta"]["min_reply"] == 64


def test_bad_last_event_id_is_400(client: TestClient) -> None:
    _complete(client, "lei", 2)
    r = client.get("/v1/requests/lei/events", headers={"Last-Event-ID": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"
    r = client.get("/v1/requests/lei/events?after=-1")
    assert r.status_code == 400 and r.json()["error"]["param"] == "after"


def _counted(c: TestClient) -> tuple[dict[str, int], dict[str, float]]:
    """(/flux/stats' error responses by status and requests by outcome, /metrics' samples of both)."""
    from prometheus_client.parser import text_string_to_metric_families

    stats = c.get("/flux/stats").json()
    samples = {f"{s.name}{sorted(s.labels.items())}": s.value
               for fam in text_string_to_metric_families(c.get("/metrics").text) for s in fam.samples
               if s.name in ("flux_error_responses_total", "flux_requests_total")}
    return {**stats["error_responses"], **{f"outcome:{k}": v for k, v in stats["requests"].items()}}, samples


def test_a_500_is_counted_in_stats_and_metrics(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    # No request a client can send is a 500 any more (that is the point); a bug is simulated where one would
    # hide: the chat template raising something no handler expects, and a report route failing.
    svc = client.app.state.flux
    before, metrics_before = _counted(client)

    def broken(*args: object, **kwargs: object) -> str:
        raise RuntimeError("a bug")

    monkeypatch.setattr(svc.chat_template, "render", broken)
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 500, r.text
    assert r.json()["error"] == {"message": "internal server error (RuntimeError); see the server log",
                                 "type": "server_error", "param": None, "code": "internal_error"}
    monkeypatch.setattr(svc, "models", broken)
    assert client.get("/v1/models").status_code == 500
    monkeypatch.undo()
    assert client.get("/v1/models").status_code == 200
    after, metrics_after = _counted(client)
    assert after.get("500", 0) == before.get("500", 0) + 2, "both 500s, whatever the route"
    assert after["outcome:errored"] == before["outcome:errored"] + 1, "the chat request failed"
    key = "flux_error_responses_total[('status', '500')]"
    assert metrics_after[key] == metrics_before.get(key, 0) + 2
    key = "flux_requests_total[('outcome', 'errored')]"
    assert metrics_after[key] == metrics_before[key] + 1
