"""serve.client_write_timeout_s against a real uvicorn server: a client that stops reading is let go."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support import SERVE_TOML, Server, serve_env, start_server, stop_server

from artifacts.records.plan import Plan


@pytest.fixture(scope="module")
def stall_server(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path,
                 plan_maker: Callable[..., Plan]) -> Iterator[Server]:
    senv = serve_env(tmp_path_factory.mktemp("stall"), SERVE_TOML + "client_write_timeout_s = 1.0\n")
    plan = plan_maker(senv.settings, tiny_moe, n_ctx=8192, n_seq_max=2)
    srv = start_server(senv, plan.id)
    yield srv
    stop_server(srv)


def test_a_client_that_stops_reading_is_disconnected_and_its_generation_runs_on(stall_server: Server) -> None:
    cancelled_before = stall_server.stats()["requests"]["cancelled"]
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 8000,
                       "stream": True, "temperature": 0, "logprobs": True, "top_logprobs": 20}).encode()
    host, port = stall_server.base.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a slow reader's small window
        s.connect((host, int(port)))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: flux\r\nContent-Type: application/json\r\n"
                  b"x-request-id: stall-1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(6)  # read nothing: 8,000 events with 20 alternatives each (~10 MB) overflow the socket's 4 MB
        s.settimeout(30)
        got = b""
        while chunk := s.recv(1 << 16):
            got += chunk
    assert got.startswith(b"HTTP/1.1 200"), got[:200]
    assert b"data: [DONE]" not in got, f"the server closed the connection before the end ({len(got)} bytes)"
    assert b"data: " in got, "what fit the buffers was sent"
    assert "client_write_timeout_s" in stall_server.log.read_text()
    stats = stall_server.stats()
    assert stats["active"] == 1, "the generation runs on into the journal after its client was let go"
    # an explicit cancel stops it; the journal keeps what was generated, read by a resuming client to its end
    r = httpx.delete(f"{stall_server.base}/v1/requests/stall-1", timeout=30)
    assert r.status_code == 200 and r.json()["cancelled"] is True
    deadline = time.monotonic() + 10
    while True:
        stats = stall_server.stats()
        if stats["active"] == 0 and stats["requests"]["cancelled"] == cancelled_before + 1:
            break
        assert time.monotonic() < deadline, f"the cancel did not free the sequence: {stats}"
        time.sleep(0.1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"GET /v1/requests/stall-1/events HTTP/1.1\r\nHost: flux\r\nConnection: close\r\n\r\n")
        rest = b""
        while chunk := s.recv(1 << 16):
            rest += chunk
    assert rest.startswith(b"HTTP/1.1 200") and b'"finish_reason":"length","flux":{"finish_reason":"cancelled"}' in rest and b"data: [DONE]" in rest
