"""The README's curl line, and 100 simultaneous connections: each is answered (200, or 429/503 with
Retry-After), none hangs or fails."""

from __future__ import annotations

import asyncio
import collections
import json
import shutil
import subprocess
import time

import httpx
import pytest
from support import Server


async def _burst(base: str, n: int) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        async def one(i: int) -> httpx.Response:
            body = {"messages": [{"role": "user", "content": f"Request {i}: hello"}], "max_tokens": 24,
                    "stream": i % 2 == 0}
            return await c.post(f"{base}/v1/chat/completions", json=body)

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_hundred_simultaneous_connections_are_bounded_and_answered(server: Server) -> None:
    before = server.stats()["requests"]
    t0 = time.monotonic()
    responses = asyncio.run(_burst(server.base, 100))
    took = time.monotonic() - t0
    by_status = collections.Counter(r.status_code for r in responses)
    assert set(by_status) <= {200, 429, 503}, by_status
    assert by_status[200] >= 4, "at least every sequence served one request"
    assert by_status[429] > 0, "the wait queue is bounded (queue_max 8)"
    for r in responses:
        if r.status_code != 200:
            err = r.json()["error"]
            assert err["code"] in ("queue_full", "queue_timeout") and int(r.headers["Retry-After"]) >= 1
        elif r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    after = server.stats()
    assert after["active"] == 0 and after["queue"]["length"] == 0
    assert after["requests"]["rejected_429"] - before["rejected_429"] == by_status[429]
    assert after["requests"]["rejected_503"] - before["rejected_503"] == by_status[503]
    assert took < 60
    r = httpx.post(f"{server.base}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert r.status_code == 200


def test_readme_curl_line(server: Server) -> None:
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    out = subprocess.run(["curl", "-s", f"{server.base}/v1/chat/completions", "-H", "Content-Type: application/json",
                          "-d", '{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 64}'],
                         capture_output=True, text=True, timeout=60, check=True)
    body = json.loads(out.stdout)
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] <= 64
