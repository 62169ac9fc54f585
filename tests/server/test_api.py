"""The OpenAI API against a real server (real worker, real llama.cpp): the unmodified `openai` client, and
every kind of bad request answered with a proper OpenAI error body."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from support import ServeEnv, Server, start_server, stop_server

from artifacts.records.plan import Plan

KEY = "sk-flux-test"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def keyed(senv: ServeEnv, plan: Plan) -> Iterator[Server]:
    """A server that wants an API key."""
    srv = start_server(senv, plan.id, "--api-key", KEY)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def client(keyed: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{keyed.base}/v1", api_key=KEY, max_retries=0, timeout=60)


def post(srv: Server, path: str, body: Any = None, content: bytes | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if content is not None:
        return httpx.post(f"{srv.base}{path}", content=content, headers=headers, timeout=60)
    return httpx.post(f"{srv.base}{path}", json=body, headers=headers, timeout=60)


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def test_openai_client_lists_models(client: openai.OpenAI, plan: Plan) -> None:
    models = client.models.list().data
    assert len(models) == 1
    m = models[0].model_dump()
    assert m["id"] == plan.model_name and m["owned_by"] == "flux"
    assert m["context_length"] == m["max_model_len"] == m["meta"]["n_ctx"] == 1024
    assert m["meta"]["plan_id"] == plan.id
    pages = m["meta"]["page_budgets"]
    assert pages["kv_bytes"] == plan.candidate.kv_bytes and pages["park_bytes"] >= 0


def test_openai_client_chats_plain(client: openai.OpenAI, plan: Plan) -> None:
    r = client.chat.completions.with_raw_response.create(model=plan.model_name, messages=HELLO,  # type: ignore[arg-type]
                                                         max_tokens=8, seed=1, temperature=0)
    out = r.parse()
    assert r.headers["x-request-id"] == out.id and out.id.startswith("chatcmpl-")
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage is not None and out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens_details is not None and out.usage.prompt_tokens_details.cached_tokens is not None
    again = client.chat.completions.create(model=plan.model_name, messages=HELLO, max_tokens=8, seed=1,  # type: ignore[arg-type]
                                           temperature=0)
    assert again.choices[0].message.content == out.choices[0].message.content, "greedy is repeatable"
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0, "the same prompt reuses its cached prefix"


def test_openai_client_streams_with_usage(client: openai.OpenAI, plan: Plan) -> None:
    stream = client.chat.completions.create(model=plan.model_name, messages=HELLO, max_tokens=6, stream=True,  # type: ignore[arg-type]
                                            stream_options={"include_usage": True}, logprobs=True, top_logprobs=2)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices and usage.completion_tokens <= 6
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert lps and all(len(t.top_logprobs) == 2 for lp in lps for t in (lp.content or []))


def test_text_completion_with_stop(client: openai.OpenAI, plan: Plan) -> None:
    out = client.completions.create(model=plan.model_name, prompt="abc def", max_tokens=40, temperature=0,
                                    logprobs=2)
    text = out.choices[0].text
    assert out.usage is not None and out.usage.completion_tokens >= 1
    if len(text) > 3:  # stop on a piece of the greedy text: the reply ends right before it
        stop = text[2:4]
        cut = client.completions.create(model=plan.model_name, prompt="abc def", max_tokens=40, temperature=0,
                                        stop=[stop])
        assert cut.choices[0].text == text[: text.find(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_oversized_prompt_is_context_length_exceeded(client: openai.OpenAI, plan: Plan) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=plan.model_name, messages=[{"role": "user", "content": "x " * 1000}],
                                       max_tokens=8)
    assert exc.value.code == "context_length_exceeded"
    assert "1024" in exc.value.message


def test_prompt_that_leaves_no_reply_room_is_refused_before_generating(keyed: Server) -> None:
    before = keyed_stats(keyed)["worker"]["serve_stats"]["tokens_generated"]
    # ~1000 prompt tokens leave less than min_reply (64) when the request sets no max_tokens
    r = post(keyed, "/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 990}]})
    err = assert_error(r, 400, "context_length_exceeded")
    assert "1024" in err["message"]
    assert keyed_stats(keyed)["worker"]["serve_stats"]["tokens_generated"] == before


def keyed_stats(srv: Server) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{srv.base}/flux/stats", headers={"Authorization": f"Bearer {KEY}"},
                                    timeout=30).json()
    return out


def test_ten_times_the_context_is_refused_quickly(keyed: Server) -> None:
    r = post(keyed, "/v1/completions", {"prompt": "lorem ipsum dolor " * 3000, "max_tokens": 4})
    assert_error(r, 400, "context_length_exceeded")
    assert r.elapsed.total_seconds() < 5


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": HELLO, "max_tokens": "64"}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": -1}, "max_tokens"),
    ({"messages": HELLO, "max_tokens": 10**20}, "max_tokens"),
    ({"messages": HELLO, "temperature": 3}, "temperature"),
    ({"messages": HELLO, "stream": "yes"}, "stream"),
    ({"messages": HELLO, "n": 2}, "n"),
    ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": HELLO, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": "Hello"}, "messages"),
    ({}, "messages"),
])
def test_invalid_fields_are_400_naming_the_param(keyed: Server, body: dict[str, Any], param: str) -> None:
    assert_error(post(keyed, "/v1/chat/completions", body), 400, param=param)


@pytest.mark.parametrize("content", [b"{bad json", b"\xff\xfe{}", b"", b"[1, 2]", b'{"messages": [' * 5000])
def test_malformed_bodies_are_400(keyed: Server, content: bytes) -> None:
    assert_error(post(keyed, "/v1/chat/completions", content=content), 400)


def test_errors_carry_the_request_id(keyed: Server) -> None:
    r = httpx.post(f"{keyed.base}/v1/chat/completions", json={"messages": []},
                   headers={"Authorization": f"Bearer {KEY}", "x-request-id": "mine-42"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "mine-42"


def test_unknown_fields_are_ignored(keyed: Server) -> None:
    r = post(keyed, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "frobnicate": {"x": 1},
                                             "user": "me", "parallel_tool_calls": False})
    assert r.status_code == 200, r.text


def test_unknown_model_is_404(keyed: Server) -> None:
    assert_error(post(keyed, "/v1/chat/completions", {"model": "gpt-9", "messages": HELLO}), 404, "model_not_found")
    r = httpx.get(f"{keyed.base}/v1/models/gpt-9", headers={"Authorization": f"Bearer {KEY}"})
    assert_error(r, 404, "model_not_found")


def test_api_key_is_required_on_v1(keyed: Server) -> None:
    for r in (httpx.get(f"{keyed.base}/v1/models"),
              httpx.post(f"{keyed.base}/v1/chat/completions", json={"messages": HELLO},
                         headers={"Authorization": "Bearer wrong"}),
              httpx.get(f"{keyed.base}/flux/stats")):
        assert_error(r, 401, "invalid_api_key")
    assert httpx.get(f"{keyed.base}/health").json()["status"] == "ok"


def test_unknown_route_and_method_are_openai_errors(keyed: Server) -> None:
    assert_error(httpx.get(f"{keyed.base}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}), 404)
    assert_error(httpx.delete(f"{keyed.base}/v1/models", headers={"Authorization": f"Bearer {KEY}"}), 405)


def test_admission_override_is_validated_and_shown(keyed: Server) -> None:
    assert_error(post(keyed, "/flux/admission", {"host_reserve_percent": 100}), 400, param="host_reserve_percent")
    assert_error(post(keyed, "/flux/admission", {"host_reserve_percent": "5"}), 400)
    r = post(keyed, "/flux/admission", {"host_reserve_percent": 99})
    assert r.status_code == 200 and r.json() == {"host_reserve_percent": 99}
    try:
        assert keyed_stats(keyed)["host_reserve_percent"] == 99
        # 99% of RAM is more than is available: new work is refused until the reserve is lowered
        assert_error(post(keyed, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2}), 503,
                     "host_memory_low")
    finally:
        post(keyed, "/flux/admission", {"host_reserve_percent": 10})
    assert post(keyed, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2}).status_code == 200


def test_stats_report_memory_and_outcomes(keyed: Server, plan: Plan) -> None:
    s = keyed_stats(keyed)
    assert s["memory"]["weights"] == plan.candidate.weights_bytes
    assert s["memory"]["kv"] is not None and s["memory"]["parked_limit"] is not None
    assert s["memory"]["journal"] > 0
    assert s["requests"]["completed"] >= 1 and s["requests"]["rejected_400"] >= 1
    assert s["queue"]["length"] == 0 and s["active"] == 0
