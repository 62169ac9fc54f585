"""/metrics scraped from a real server (Prometheus text, llama-server's names where they mean the same) and
the access log: one line per request, with tokens and timings, written once the request is over; the
router's own 404 and 405 get theirs; a path a client controls cannot break a line or forge a field; an idle
server uses no CPU."""

from __future__ import annotations

import re
import socket
import time

import httpx
import psutil
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


def _raw(srv: Server, head: bytes) -> bytes:
    """Send one raw request (``head`` ends with its blank line) and read the answer until the server closes."""
    host, port = srv.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def _lines_with(srv: Server, needle: str, n: int = 1, deadline_s: float = 10) -> list[str]:
    end = time.monotonic() + deadline_s
    while True:
        lines = [x for x in srv.log.read_text().splitlines() if " access " in x and needle in x]
        if len(lines) >= n or time.monotonic() > end:
            return lines
        time.sleep(0.1)


def test_a_line_break_in_a_path_cannot_forge_an_access_line(server: Server) -> None:
    forged = "2026-01-01 00:00:00,000 access id=forged method=GET path=/ status=200"
    path = "/v1/x%0A" + forged.replace(" ", "%20").replace("=", "%3D") + "%0D%0Ay"
    got = _raw(server, f"GET {path} HTTP/1.1\r\nHost: flux\r\nConnection: close\r\n\r\n".encode())
    assert got.startswith(b"HTTP/1.1 404"), got[:200]
    (line,) = _lines_with(server, "path=/v1/x%0A")
    fields = dict(kv.split("=", 1) for kv in line.split(" access ", 1)[1].split())
    assert fields == {"id": "-", "method": "GET", "status": "404", "duration_ms": fields["duration_ms"],
                      "path": "/v1/x%0A2026-01-01%2000:00:00,000%20access%20id%3Dforged%20method%3DGET%20path%3D/"
                              "%20status%3D200%0D%0Ay"}, "one line; the path's breaks, spaces and '=' escaped"
    assert not any(x.startswith("2026-01-01") for x in server.log.read_text().splitlines())


def test_router_404_and_405_get_access_lines(server: Server) -> None:
    before = server.stats()["error_responses"]
    assert httpx.get(f"{server.base}/no/such/route-404", timeout=30).status_code == 404
    assert httpx.delete(f"{server.base}/v1/models", timeout=30).status_code == 405
    (line,) = _lines_with(server, "path=/no/such/route-404 ")
    assert "method=GET" in line and "status=404" in line and re.search(r"duration_ms=[\d.]+", line)
    assert _lines_with(server, "method=DELETE path=/v1/models status=405")
    after = server.stats()["error_responses"]
    assert after["404"] == before.get("404", 0) + 1 and after["405"] == before.get("405", 0) + 1


def test_an_idle_server_uses_no_cpu(server: Server) -> None:
    """After a request, an idle server and its worker poll nothing (measured 0.1-0.3% of a core for the
    server, uvicorn's 10 Hz tick; 0% for the worker): bounded generously here for a loaded 2-core machine."""
    r = httpx.post(f"{server.base}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200
    time.sleep(1)  # the request's tail: its access line, the worker's threads going to sleep
    procs = [psutil.Process(server.proc.pid), psutil.Process(server.worker_pid())]

    def cpu_s() -> list[float]:
        return [sum(p.cpu_times()[:2]) for p in procs]

    c0, t0 = cpu_s(), time.monotonic()
    time.sleep(10)
    c1, took = cpu_s(), time.monotonic() - t0
    share = {name: (b - a) / took for name, a, b in zip(("server", "worker"), c0, c1, strict=True)}
    assert all(v < 0.2 for v in share.values()), f"idle CPU, share of one core: {share}"

