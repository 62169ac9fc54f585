"""Streaming against a real uvicorn server: a dropped stream runs on and resume gets all of it, each later event
once; DELETE cancels a running or a queued request, whose reply ends with OpenAI's "length" and Flux's
"cancelled" (read by the real `openai` client with strict validation); a running or waiting request's id is
taken (409)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
from support import Server, sse_events

LONG = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 900, "stream": True,
        "temperature": 0}


def _read_events(srv: Server, body: dict[str, Any], rid: str, n: int) -> list[tuple[int | None, str]]:
    """Open a stream, read ``n`` events, then drop the connection."""
    lines: list[str] = []
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{srv.base}/v1/chat/completions", json=body,
                                                  headers={"x-request-id": rid}) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == rid
        for line in r.iter_lines():
            lines.append(line)
            if len(sse_events(lines)) >= n:
                break
    return sse_events(lines)


def _resume(srv: Server, rid: str, after: int | None = None, last_event_id: int | None = None,
            ) -> tuple[int, list[tuple[int | None, str]]]:
    params = {"after": after} if after is not None else {}
    headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else {}
    r = httpx.get(f"{srv.base}/v1/requests/{rid}/events", params=params, headers=headers, timeout=60)
    return r.status_code, sse_events(r.text.splitlines())


def _cancelled(choice: dict[str, Any]) -> bool:
    """A choice ended by a cancel: OpenAI's "length" on the wire, Flux's own reason beside it."""
    return choice["finish_reason"] == "length" and choice.get("flux") == {"finish_reason": "cancelled"}


def _wait_idle(srv: Server, timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        s = srv.stats()
        if s["active"] == 0 and s["worker"]["serve_stats"]["active"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"sequence not freed: {s}")
        time.sleep(0.05)


def test_a_dropped_stream_runs_on_and_resume_returns_the_whole_reply(slow_server: Server) -> None:
    body = {**LONG, "max_tokens": 300, "stream_options": {"include_usage": True}}
    seen = _read_events(slow_server, body, "drop-1", 6)
    assert [i for i, _ in seen] == [1, 2, 3, 4, 5, 6]
    time.sleep(0.5)
    assert slow_server.stats()["active"] == 1, "the generation goes on without its client"
    status, rest = _resume(slow_server, "drop-1", after=6)
    assert status == 200
    ids = [i for i, _ in rest if i is not None]
    assert ids == list(range(7, 7 + len(ids))), "every later event once, in order"
    assert rest[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in seen + rest[:-1]]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
    assert reasons[-1] in ("length", "stop"), "the reply ran to its end, not cancelled"
    usage = chunks[-1]["usage"]
    assert reasons[-1] == "stop" or usage["completion_tokens"] == 300, f"the whole reply: {usage}"
    status, everything = _resume(slow_server, "drop-1", last_event_id=0)
    assert everything[:6] == seen, "the journal holds what the client saw"
    assert everything[6:] == rest
    _wait_idle(slow_server)


def test_delete_cancels_a_running_request_at_once(slow_server: Server) -> None:
    cancelled_before = slow_server.stats()["requests"]["cancelled"]
    _read_events(slow_server, LONG, "cancel-1", 3)
    r = httpx.delete(f"{slow_server.base}/v1/requests/cancel-1", timeout=30)
    assert r.status_code == 200 and r.json() == {"id": "cancel-1", "object": "request", "status": "cancelling",
                                                  "cancelled": True}
    t0 = time.monotonic()
    stats = _wait_idle(slow_server)
    assert time.monotonic() - t0 < 3 and stats["requests"]["cancelled"] == cancelled_before + 1
    status, rest = _resume(slow_server, "cancel-1", after=3)
    assert status == 200 and _cancelled(json.loads(rest[-2][1])["choices"][0])
    again = httpx.delete(f"{slow_server.base}/v1/requests/cancel-1", timeout=30)
    assert again.status_code == 200 and again.json()["cancelled"] is False
    assert httpx.delete(f"{slow_server.base}/v1/requests/never-was", timeout=30).status_code == 404


def test_a_dropped_requests_id_is_still_in_use(slow_server: Server) -> None:
    _read_events(slow_server, LONG, "dup-drop", 3)
    clash = httpx.post(f"{slow_server.base}/v1/chat/completions", json={**LONG, "max_tokens": 2}, timeout=30,
                       headers={"x-request-id": "dup-drop"})
    assert clash.status_code == 409 and clash.json()["error"]["code"] == "request_id_in_use"
    status, events = _resume(slow_server, "dup-drop", last_event_id=0)
    assert status == 200 and json.loads(events[0][1])["id"] == "dup-drop"
    httpx.delete(f"{slow_server.base}/v1/requests/dup-drop", timeout=30)
    _wait_idle(slow_server)


def test_resume_follows_a_running_request_live(slow_server: Server) -> None:
    body = {**LONG, "max_tokens": 30}
    got: dict[str, list[tuple[int | None, str]]] = {}

    def original() -> None:
        with httpx.Client(timeout=60) as c:
            r = c.post(f"{slow_server.base}/v1/chat/completions", json=body, headers={"x-request-id": "live-1"})
            got["original"] = sse_events(r.text.splitlines())

    t = threading.Thread(target=original)
    t.start()
    deadline = time.monotonic() + 10
    status = 404
    while status == 404 and time.monotonic() < deadline:  # until the request is admitted
        status, events = _resume(slow_server, "live-1", after=0)
    t.join()
    assert status == 200
    assert events == got["original"], "a reader joining mid-way gets every event exactly once, live"
    assert events[-1] == (None, "[DONE]")


def test_unknown_request_id_is_404(slow_server: Server) -> None:
    status, _ = _resume(slow_server, "no-such-request")
    assert status == 404
    r = httpx.get(f"{slow_server.base}/v1/requests/no-such-request/events")
    assert r.json()["error"]["code"] == "request_not_found"


def _conflicts_in_metrics(srv: Server) -> float:
    text = httpx.get(f"{srv.base}/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith('flux_requests_total{outcome="rejected_409"}'))
    return float(line.split()[-1])


def test_running_request_id_cannot_be_reused(slow_server: Server) -> None:
    before, metric_before = slow_server.stats(), _conflicts_in_metrics(slow_server)
    with httpx.Client(timeout=60) as c, c.stream("POST", f"{slow_server.base}/v1/chat/completions", json=LONG,
                                                  headers={"x-request-id": "dup-1"}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()  # kept: a dropped iterator closes the response (and so cancels it)
        assert next(lines) == "id: 1"
        clash = c.post(f"{slow_server.base}/v1/chat/completions", json={**LONG, "stream": False},
                       headers={"x-request-id": "dup-1"})
        assert clash.status_code == 409 and clash.json()["error"]["code"] == "request_id_in_use"
    httpx.delete(f"{slow_server.base}/v1/requests/dup-1", timeout=30)
    after = _wait_idle(slow_server)
    assert after["requests"]["rejected_409"] == before["requests"]["rejected_409"] + 1, "counted as the 409 it was"
    assert after["requests"]["rejected_400"] == before["requests"]["rejected_400"]
    assert after["error_responses"]["409"] == before["error_responses"].get("409", 0) + 1
    assert _conflicts_in_metrics(slow_server) == metric_before + 1
    assert httpx.post(f"{slow_server.base}/v1/chat/completions", json={**LONG, "max_tokens": 2},
                      headers={"x-request-id": "bad id!"}).status_code == 400


def test_non_streamed_request_is_journaled_too(slow_server: Server) -> None:
    r = httpx.post(f"{slow_server.base}/v1/completions", json={"prompt": "abc", "max_tokens": 5},
                   headers={"x-request-id": "plain-1"}, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "plain-1"
    status, events = _resume(slow_server, "plain-1", after=0)
    assert status == 200
    text = "".join(json.loads(d)["choices"][0]["text"] for _, d in events[:-1] if json.loads(d)["choices"])
    assert text == r.json()["choices"][0]["text"]
    assert json.loads(events[-2][1])["usage"] == r.json()["usage"]


def test_a_new_request_takes_the_sequence_of_a_reply_nobody_follows(slow_server: Server) -> None:
    for i in range(4):  # every sequence runs a reply whose client left
        _read_events(slow_server, LONG, f"orphan-{i}", 2)
    assert slow_server.stats()["active"] == 4
    t0 = time.monotonic()
    r = httpx.post(f"{slow_server.base}/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and time.monotonic() - t0 < 2.5, "served at once, not after a queue wait"
    choices = []
    for i in range(4):
        status, events = _resume(slow_server, f"orphan-{i}", after=0)
        choices.append(json.loads(events[-2][1])["choices"][0])
    assert sum(_cancelled(c) for c in choices) >= 1, choices
    for i in range(4):
        httpx.delete(f"{slow_server.base}/v1/requests/orphan-{i}", timeout=30)
    _wait_idle(slow_server)


def test_a_waiting_requests_id_is_in_use_too(slow_server: Server) -> None:
    with httpx.Client(timeout=60) as c:
        streams = [c.stream("POST", f"{slow_server.base}/v1/chat/completions", json=LONG) for _ in range(4)]
        opened = [s.__enter__() for s in streams]
        got: dict[str, int] = {}

        def queued() -> None:  # waits for a sequence (all 4 busy), holding its id
            got["first"] = httpx.post(f"{slow_server.base}/v1/chat/completions", timeout=60,
                                      json={**LONG, "stream": False, "max_tokens": 2},
                                      headers={"x-request-id": "queued-1"}).status_code

        t = threading.Thread(target=queued)
        t.start()
        try:
            time.sleep(0.5)
            r = c.post(f"{slow_server.base}/v1/chat/completions", json={**LONG, "max_tokens": 2},
                       headers={"x-request-id": "queued-1"})
            assert r.status_code == 409, r.text
            assert r.elapsed.total_seconds() < 1, "refused at once, not after a queue wait"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
            for i in range(4):
                httpx.delete(f"{slow_server.base}/v1/requests/{opened[i].headers['x-request-id']}", timeout=30)
            t.join()
    assert got["first"] in (200, 503)
    _wait_idle(slow_server)


def test_all_sequences_busy_then_the_wait_times_out_with_503(slow_server: Server) -> None:
    with httpx.Client(timeout=60) as c:
        streams = [c.stream("POST", f"{slow_server.base}/v1/chat/completions", json=LONG) for _ in range(4)]
        opened = [s.__enter__() for s in streams]
        try:
            assert all(r.status_code == 200 for r in opened)
            t0 = time.monotonic()
            r = c.post(f"{slow_server.base}/v1/chat/completions", json={**LONG, "stream": False, "max_tokens": 2})
            waited = time.monotonic() - t0
            assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"
            assert int(r.headers["Retry-After"]) >= 1
            assert 2.5 < waited < 15, "it waited queue_wait_s (3 s) for a sequence"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
            for r in opened:
                httpx.delete(f"{slow_server.base}/v1/requests/{r.headers['x-request-id']}", timeout=30)
    stats = _wait_idle(slow_server)
    assert stats["requests"]["rejected_503"] >= 1


def test_delete_cancels_a_queued_request_which_never_starts(slow_server: Server) -> None:
    before = slow_server.stats()
    got: dict[str, Any] = {}
    with httpx.Client(timeout=60) as c:
        streams = [c.stream("POST", f"{slow_server.base}/v1/chat/completions", json=LONG) for _ in range(4)]
        opened = [s.__enter__() for s in streams]

        def queued(rid: str, stream: bool) -> None:  # all 4 sequences are busy: it waits in the queue
            r = httpx.post(f"{slow_server.base}/v1/chat/completions", timeout=60, headers={"x-request-id": rid},
                           json={**LONG, "stream": stream, "max_tokens": 50})
            got[rid] = (r.status_code, time.monotonic(), r.text)

        threads = [threading.Thread(target=queued, args=(rid, rid.endswith("stream")))
                   for rid in ("queued-del-plain", "queued-del-stream")]
        try:
            for t in threads:
                t.start()
            deadline = time.monotonic() + 5
            while slow_server.stats()["queue"]["length"] < 2:
                assert time.monotonic() < deadline, "the requests did not queue"
                time.sleep(0.05)
            for rid in ("queued-del-plain", "queued-del-stream"):
                r = httpx.delete(f"{slow_server.base}/v1/requests/{rid}", timeout=30)
                assert r.status_code == 200 and r.json() == {"id": rid, "object": "request", "status": "cancelling",
                                                             "cancelled": True}, r.text
            t0 = time.monotonic()
            for t in threads:
                t.join(10)
            mid = slow_server.stats()
            assert mid["active"] == 4 and mid["queue"]["length"] == 0, "the running four were left alone"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
            for r in opened:
                httpx.delete(f"{slow_server.base}/v1/requests/{r.headers['x-request-id']}", timeout=30)
    status, ended, text = got["queued-del-plain"]
    body = json.loads(text)
    assert status == 200 and ended - t0 < 1.0, "ended at once, not after the queue wait (3 s)"
    assert _cancelled(body["choices"][0]) and body["usage"]["completion_tokens"] == 0, body
    status, ended, text = got["queued-del-stream"]
    events = sse_events(text.splitlines())
    assert status == 200 and ended - t0 < 1.0 and events[-1] == (None, "[DONE]")
    assert _cancelled(json.loads(events[-2][1])["choices"][0]), events
    after = _wait_idle(slow_server)
    assert after["requests"]["cancelled"] >= before["requests"]["cancelled"] + 2
    assert after["requests"]["rejected_503"] == before["requests"]["rejected_503"], "cancelled, not timed out"
    again = httpx.delete(f"{slow_server.base}/v1/requests/queued-del-plain", timeout=30)
    assert again.status_code == 200 and again.json()["status"] == "completed", "its journal is kept, as a run's"


def test_the_openai_client_reads_a_cancelled_stream_strictly(slow_server: Server) -> None:
    client = openai.OpenAI(base_url=f"{slow_server.base}/v1", api_key="none", max_retries=0, timeout=60,
                           _strict_response_validation=True)  # every chunk validated against OpenAI's models
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me a story."}],
                                            max_tokens=900, temperature=0, stream=True,
                                            extra_headers={"x-request-id": "openai-cancel"})
    chunks = [next(stream)]
    assert httpx.delete(f"{slow_server.base}/v1/requests/openai-cancel", timeout=30).json()["cancelled"] is True
    chunks += list(stream)
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason == "length" and last.model_extra == {"flux": {"finish_reason": "cancelled"}}
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert done.choices[0].finish_reason in ("length", "stop") and not done.choices[0].model_extra
    _wait_idle(slow_server)

