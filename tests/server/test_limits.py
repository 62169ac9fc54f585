"""What a hostile or unlucky client finds, against real servers over real sockets: numbers JSON cannot hold,
huge bodies and one-word prompts, slow, corrupted or malformed headers, slow bodies, and more connections than
the server takes. Every answer the transport gives itself has an access line and is counted."""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support import SERVE_TOML, Server, serve_env, start_server, stop_server

from artifacts.records.plan import Plan

HELLO = [{"role": "user", "content": "Hello"}]
LIMITS_TOML = SERVE_TOML + "header_timeout_s = 2.0\nbody_timeout_s = 3.0\nmax_connections = 6\n"


@pytest.fixture(scope="module")
def strict_server(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path,
                  plan_maker: Callable[..., Plan]) -> Iterator[Server]:
    senv = serve_env(tmp_path_factory.mktemp("limits"), LIMITS_TOML)
    srv = start_server(senv, plan_maker(senv.settings, tiny_moe, n_ctx=1024, n_seq_max=2).id)
    yield srv
    stop_server(srv)


def _addr(srv: Server) -> tuple[str, int]:
    host, port = srv.base.removeprefix("http://").split(":")
    return host, int(port)


def _chat_ok(srv: Server) -> float:
    t0 = time.monotonic()
    r = httpx.post(f"{srv.base}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def test_a_number_json_cannot_hold_is_400(server: Server) -> None:
    for number in ("1" * 5000, "1e999999", "-" + "9" * 4400):
        r = httpx.post(f"{server.base}/v1/chat/completions", timeout=30,
                       content=b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + number.encode()
                       + b"}")
        assert r.status_code == 400, (number[:10], r.status_code, r.text[:200])
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_huge_body_is_refused_at_once_without_holding_up_others(server: Server) -> None:
    word = "x" * (10 * 2**20)  # 10 MB, one word
    done: dict[str, float] = {}

    def big() -> None:
        t0 = time.monotonic()
        r = httpx.post(f"{server.base}/v1/completions", json={"prompt": word, "max_tokens": 1}, timeout=60)
        done["status"], done["big_s"] = r.status_code, time.monotonic() - t0

    t = threading.Thread(target=big)
    t.start()
    time.sleep(0.05)
    others = [_chat_ok(server) for _ in range(3)]
    t.join()
    assert done["status"] in (400, 413) and done["big_s"] < 2.0, done
    assert max(others) < 2.0, others


def test_a_one_word_prompt_over_the_context_is_refused_before_tokenizing_it(server: Server) -> None:
    for prompt in ("y" * 600_000, "é" * 300_000):  # under the body limit, far over 1,024 tokens
        t0 = time.monotonic()
        r = httpx.post(f"{server.base}/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        assert time.monotonic() - t0 < 1.5


def _dribble(srv: Server, data: bytes, gap_s: float, budget_s: float, fast: bytes = b"") -> tuple[float, bytes]:
    """Send ``fast`` at once, then ``data`` a byte every ``gap_s``; returns (seconds until the server closed the
    connection or the budget ran out, what it sent)."""
    with socket.create_connection(_addr(srv), timeout=budget_s) as s:
        s.sendall(fast)
        s.setblocking(False)
        t0, got = time.monotonic(), b""
        for b in data:
            try:
                s.send(bytes([b]))
            except OSError:
                break
            deadline = time.monotonic() + gap_s
            closed = False
            while time.monotonic() < deadline:
                try:
                    chunk = s.recv(65536)
                except BlockingIOError:
                    time.sleep(0.05)
                    continue
                except OSError:
                    closed = True
                    break
                if not chunk:
                    closed = True
                    break
                got += chunk
            if closed or time.monotonic() - t0 > budget_s:
                break
        return time.monotonic() - t0, got


def test_slow_headers_are_cut_off(strict_server: Server) -> None:
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: flux\r\nContent-Type: application/json\r\n"
    took, got = _dribble(strict_server, head, gap_s=0.5, budget_s=20)
    assert took < 6, f"a 2 s header timeout let a slow client hold the connection for {took:.1f} s"
    assert got == b"" or got.startswith(b"HTTP/1.1 408")
    assert _chat_ok(strict_server) < 5


def _access_line(srv: Server, rid: str, deadline_s: float = 10) -> str:
    end = time.monotonic() + deadline_s
    while True:
        lines = [x for x in srv.log.read_text().splitlines() if " access " in x and f"id={rid} " in x]
        if lines or time.monotonic() > end:
            assert len(lines) == 1, lines
            return lines[0]
        time.sleep(0.1)


def test_slow_body_is_cut_off(strict_server: Server) -> None:
    before = strict_server.stats()
    body = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}'
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: flux\r\nContent-Type: application/json\r\n"
            b"x-request-id: slow-body-1\r\nContent-Length: %d\r\n\r\n" % len(body))
    took, got = _dribble(strict_server, body, gap_s=1.0, budget_s=20, fast=head)
    assert took < 8, f"a 3 s body timeout let a slow client hold the connection for {took:.1f} s"
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    assert "status=408 " in _access_line(strict_server, "slow-body-1"), "the log says what the client got"
    assert _chat_ok(strict_server) < 5
    after = strict_server.stats()
    assert after["error_responses"].get("408", 0) == before["error_responses"].get("408", 0) + 1
    assert "500" not in after["error_responses"] and after["requests"]["errored"] == 0


def test_connections_over_the_limit_are_refused_with_an_openai_error(strict_server: Server) -> None:
    before = strict_server.stats()["error_responses"]
    lines_before = len(_transport_lines(strict_server, "error=too_many_connections"))
    held = [socket.create_connection(_addr(strict_server)) for _ in range(6)]
    try:
        time.sleep(0.3)
        r = httpx.get(f"{strict_server.base}/v1/models", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
        assert int(r.headers["Retry-After"]) >= 1
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert _chat_ok(strict_server) < 5
    assert len(_transport_lines(strict_server, "error=too_many_connections")) == lines_before + 1
    assert strict_server.stats()["error_responses"]["503"] == before.get("503", 0) + 1


def _transport_lines(srv: Server, needle: str) -> list[str]:
    """Access lines of answers the transport gave before a request reached the app."""
    return [x for x in srv.log.read_text().splitlines() if " access id=- method=- path=- " in x and needle in x]


def _answer(srv: Server, data: bytes, budget_s: float = 20) -> tuple[float, bytes]:
    """Send ``data`` at once, then nothing; (seconds until the server closed the connection, what it sent)."""
    with socket.create_connection(_addr(srv), timeout=budget_s) as s:
        t0 = time.monotonic()
        s.sendall(data)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return time.monotonic() - t0, got


def test_corrupted_whole_headers_time_out_named_for_what_came(strict_server: Server) -> None:
    """Headers sent whole whose ending empty line is corrupted ("\r\n\0\n"): the server waits for their end,
    then says what came (not "truncated" headers, nor that they "did not arrive"), logs and counts its 408."""
    before = strict_server.stats()["error_responses"]
    head = b"GET /v1/models HTTP/1.1\r\nHost: flux\r\nAccept: application/json\r\n\0\n"
    took, got = _answer(strict_server, head)
    assert 1.5 < took < 6 and got.startswith(b"HTTP/1.1 408"), (took, got[:200])
    message = httpx.Response(408, content=got.split(b"\r\n\r\n", 1)[1]).json()["error"]["message"]
    assert f"{len(head)} bytes came, then nothing for" in message and "no empty line" in message, message
    assert "truncat" not in message and "did not arrive" not in message
    took, got = _answer(strict_server, b"")  # a connection that says nothing
    assert got.startswith(b"HTTP/1.1 408") and b"no request arrived within 2 s" in got, got[:300]
    line = _transport_lines(strict_server, f"received_bytes={len(head)} ")
    assert len(line) == 1 and "status=408 " in line[0] and line[0].endswith("error=header_timeout"), line
    assert re.search(r"duration_ms=(\d+)", line[0]) and float(line[0].split("duration_ms=")[1].split()[0]) > 1500
    after = strict_server.stats()["error_responses"]
    assert after["408"] == before.get("408", 0) + 2, "counted where the body timeout's 408 is"
    metrics = httpx.get(f"{strict_server.base}/metrics", timeout=30).text
    assert 'flux_error_responses_total{status="408"}' in metrics


def test_malformed_headers_are_a_400_with_an_openai_body_logged_and_counted(strict_server: Server) -> None:
    before = strict_server.stats()["error_responses"]
    took, got = _answer(strict_server, b"GET /v1/models HTTP/1.1\r\nHost: flux\r\nBad Header\x00: 1\r\n\r\n")
    assert took < 2 and got.startswith(b"HTTP/1.1 400"), got[:200]
    error = httpx.Response(400, content=got.split(b"\r\n\r\n", 1)[1]).json()["error"]
    assert error["code"] == "malformed_request" and error["type"] == "invalid_request_error"
    assert _transport_lines(strict_server, "status=400 ")[-1].endswith("error=malformed_request")
    assert strict_server.stats()["error_responses"]["400"] == before.get("400", 0) + 1
