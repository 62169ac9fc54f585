"""Worker faults against a real server: kill -9 while idle (restarted) and mid-request (an explicit error that
says how the worker ended; its stderr goes to the server's log, never into a client's message)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import httpx
from support import ServeEnv, Server, sse_events

HELLO = [{"role": "user", "content": "Hello"}]
LONG = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 900, "temperature": 0}


def _new_pid(srv: Server, old: int, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(f"{srv.base}/health", timeout=10).json()
        if h["worker"]["alive"] and h["worker"]["pid"] not in (None, old):
            return int(h["worker"]["pid"])
        time.sleep(0.1)
    raise AssertionError("the worker was not restarted")


def _chat_ok(srv: Server) -> dict[str, Any]:
    r = httpx.post(f"{srv.base}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_worker_killed_while_idle_is_restarted(slow_server: Server) -> None:
    pid = slow_server.worker_pid()
    os.kill(pid, signal.SIGKILL)
    new = _new_pid(slow_server, pid)
    assert new != pid
    _chat_ok(slow_server)
    s = slow_server.stats()
    assert s["worker"]["restarts"] >= 1 and s["worker"]["last_exit"] == -signal.SIGKILL


def test_worker_killed_mid_stream_ends_it_with_an_error(slow_server: Server) -> None:
    pid = slow_server.worker_pid()
    lines: list[str] = []
    killed = False
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{slow_server.base}/v1/chat/completions",
                                                  json={**LONG, "stream": True}) as r:
        for line in r.iter_lines():
            lines.append(line)
            if not killed and len(sse_events(lines)) == 3:
                os.kill(pid, signal.SIGKILL)
                killed = True
    events = sse_events(lines)
    assert events[-1] == (None, "[DONE]")
    err = json.loads(events[-2][1])["error"]
    assert err["code"] == "worker_died" and err["type"] == "server_error"
    _new_pid(slow_server, pid)
    _chat_ok(slow_server)


def test_worker_killed_mid_request_is_a_502_and_server_stays_up(slow_server: Server, senv: ServeEnv) -> None:
    pid = slow_server.worker_pid()
    note = "llama_model_loader: a load note, see https://example.invalid/note"  # the worker's last stderr line
    with (senv.settings.logs_dir / "serve-worker.log").open("a") as f:
        f.write(note + "\n")
    result: dict[str, httpx.Response] = {}

    def call() -> None:
        result["r"] = httpx.post(f"{slow_server.base}/v1/chat/completions", json=LONG, timeout=60)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 10
    while slow_server.stats()["worker"]["serve_stats"]["active"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    t.join(60)
    r = result["r"]
    assert r.status_code == 502 and r.json()["error"]["code"] == "worker_died"
    assert r.json()["error"]["message"] == ("the engine worker exited (code -9): killed by SIGKILL; the request was "
                                            "not completed: send it again (the server restarts the worker)")
    _new_pid(slow_server, pid)
    server_log = " ".join(slow_server.log.read_text().split())  # rich wraps long lines
    assert f"engine worker {pid} exited with code -9 (killed by SIGKILL): restarting it; its last words: {note}" \
        in server_log, "the stderr line is in the server's log"
    _chat_ok(slow_server)
    assert slow_server.stats()["requests"]["errored"] >= 1
