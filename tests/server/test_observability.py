"""/metrics scraped from a real server (Prometheus text, llama-server's names where they mean the same) and
the access log: one line per request, with tokens and timings, written once the request is over."""

from __future__ import annotations

import re
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from support import Server

HELLO = [{"role": "user", "content": "Hello"}]


def _scrape(srv: Server) -> dict[str, float]:
    r = httpx.get(f"{srv.base}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics_count_what_was_served(server: Server) -> None:
    before = _scrape(server)
    for i in range(3):
        r = httpx.post(f"{server.base}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": f"Hello number {i}"}], "max_tokens": 4,
                             "temperature": 0})
        assert r.status_code == 200
    assert httpx.post(f"{server.base}/v1/chat/completions", json={"messages": []}, timeout=30).status_code == 400
    after = _scrape(server)
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:tokens_predicted_total", "llamacpp:n_decode_total",
                 "llamacpp:prompt_seconds_total", "llamacpp:tokens_predicted_seconds_total"):
        assert after[name] > before.get(name, 0), name
    assert after["llamacpp:tokens_predicted_total"] - before.get("llamacpp:tokens_predicted_total", 0) <= 12
    assert after["flux_time_to_first_token_seconds_count"] - before.get("flux_time_to_first_token_seconds_count", 0) == 3
    assert after["flux_requests_total{outcome=completed}"] >= 3
    assert after["flux_requests_total{outcome=rejected_400}"] >= 1
    assert after["llamacpp:requests_processing"] == 0 and after["llamacpp:requests_deferred"] == 0
    assert after["flux_worker_up"] == 1 and after["llamacpp:n_tokens_max"] > 0
    assert after["llamacpp:predicted_tokens_seconds"] > 0


def _access_lines(srv: Server, rid: str, deadline_s: float = 10) -> list[str]:
    end = time.monotonic() + deadline_s
    while True:
        lines = [x for x in srv.log.read_text().splitlines() if " access " in x and f"id={rid} " in x]
        if lines or time.monotonic() > end:
            return lines
        time.sleep(0.1)


def test_one_access_line_per_request(server: Server) -> None:
    r = httpx.post(f"{server.base}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 3},
                   headers={"x-request-id": "log-1", "Authorization": "Bearer secret-not-logged"}, timeout=60)
    assert r.status_code == 200
    (line,) = _access_lines(server, "log-1")
    fields = dict(kv.split("=", 1) for kv in line.split(" access ", 1)[1].split())
    assert fields["status"] == "200" and fields["path"] == "/v1/chat/completions" and fields["method"] == "POST"
    assert int(fields["prompt_tokens"]) > 0 and int(fields["completion_tokens"]) == r.json()["usage"]["completion_tokens"]
    assert float(fields["ttft_ms"]) > 0 and float(fields["duration_ms"]) >= float(fields["ttft_ms"])
    assert fields["outcome"] == "completed" and "secret-not-logged" not in server.log.read_text()
    bad = httpx.post(f"{server.base}/v1/chat/completions", json={"messages": []}, headers={"x-request-id": "log-2"})
    assert bad.status_code == 400
    (line,) = _access_lines(server, "log-2")
    assert "status=400" in line and re.search(r"duration_ms=[\d.]+", line)


def test_a_dropped_stream_is_logged_when_its_generation_ends(server: Server) -> None:
    body = {"messages": HELLO, "max_tokens": 200, "stream": True, "temperature": 0}
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.base}/v1/chat/completions", json=body,
                                                 headers={"x-request-id": "log-3"}) as r:
        next(r.iter_lines())
    (line,) = _access_lines(server, "log-3", deadline_s=30)
    assert "client=gone" in line and "status=200" in line and "outcome=completed" in line
