"""Fuzzed request bodies against a real server: junk never gets a 5xx, always an OpenAI error body; valid
requests with any mix of sampling options always get a well-formed 200; the worker answers throughout."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import Server

FUZZ = settings(deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


def _or_junk(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly ``valid`` (one_of picks its branches evenly), sometimes any JSON at all."""
    return st.one_of(*[valid] * 4, json_values)


# -- valid requests: every option in range ---------------------------------------------------------------
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30)
valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "developer"]), "content": text})
valid_sampling = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_k": st.integers(0, 100),
    "min_p": st.floats(0, 1), "seed": st.integers(0, 2**40), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=4),
    "stream": st.booleans(), "n": st.just(1), "model": st.sampled_from(["tiny-moe", None]),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
valid_chat = st.fixed_dictionaries(
    {"messages": st.lists(valid_message, min_size=1, max_size=3).map(lambda m: [*m, {"role": "user", "content": "hi"}]),
     "max_tokens": st.integers(1, 6)},
    optional={**valid_sampling, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 20)})
valid_completion = st.fixed_dictionaries(
    {"prompt": text.filter(bool) | st.lists(st.integers(0, 500), min_size=1, max_size=5),
     "max_tokens": st.integers(1, 6)},
    optional={**valid_sampling, "logprobs": st.integers(0, 5), "echo": st.booleans()})

# -- junk: wrong types, out of range, missing, unknown fields ------------------------------------------
message = st.fixed_dictionaries({"role": _or_junk(st.sampled_from(["user", "assistant", "tool", "bot", ""]))},
                                optional={"content": _or_junk(text | st.lists(st.fixed_dictionaries(
                                    {"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=2))})
limit = st.integers(-2, 6) | st.sampled_from([2**40, 2**80, "4", 4.5, True, None])
junk_chat = st.fixed_dictionaries({"max_tokens": limit}, optional={
    "messages": _or_junk(st.lists(message, max_size=3)), **{k: _or_junk(v) for k, v in valid_sampling.items()},
    "temperature": st.floats(-1, 3), "top_logprobs": st.integers(-1, 30), "n": st.integers(0, 3),
    "max_completion_tokens": limit, "extra_field": json_values}).filter(
    lambda b: b.get("max_tokens") is not None or b.get("max_completion_tokens") is not None)
junk_completion = st.fixed_dictionaries({"max_tokens": limit.filter(lambda v: v is not None)}, optional={
    "prompt": _or_junk(text | st.lists(st.integers(-3, 600), max_size=5) | st.lists(text, max_size=2)),
    "logprobs": _or_junk(st.integers(-1, 7)), "echo": _or_junk(st.booleans()), "suffix": _or_junk(text)})

schema = st.recursive(st.fixed_dictionaries({}, optional={
    "type": _or_junk(st.sampled_from(["object", "string", "integer", "number", "boolean", "array", "null", "x"])),
    "enum": st.lists(json_scalars, max_size=3), "maxLength": st.integers(-1, 8), "minItems": st.integers(-1, 3),
    "$ref": st.sampled_from(["#", "#/$defs/a", "http://x"])}),
    lambda inner: st.fixed_dictionaries({"type": st.just("object")}, optional={
        "properties": st.dictionaries(st.text(max_size=4), inner, max_size=3), "required": st.lists(st.text(max_size=4)),
        "items": inner, "anyOf": st.lists(inner, max_size=2), "additionalProperties": st.booleans() | inner}),
    max_leaves=6)
tool = st.fixed_dictionaries({"type": _or_junk(st.just("function")), "function": _or_junk(st.fixed_dictionaries(
    {"name": _or_junk(st.sampled_from(["f", "get_weather", "bad name"]))}, optional={"parameters": _or_junk(schema)}))})
junk_tools = st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hi"}]),
                                    "max_tokens": st.integers(1, 8)}, optional={
    "tools": _or_junk(st.lists(tool, max_size=3)), "parallel_tool_calls": _or_junk(st.booleans()),
    "tool_choice": _or_junk(st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g"])})})),
    "response_format": _or_junk(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "json_schema",
                                                                                   "bogus"])},
                                                      optional={"json_schema": st.fixed_dictionaries(
                                                          {"name": st.just("x")}, optional={"schema": schema})}))})

ERROR_KEYS = {"message", "type", "param", "code"}


def _post(server: Server, path: str, body: Any) -> httpx.Response:
    with httpx.Client(timeout=60) as c:
        return c.post(f"{server.base}{path}", content=json.dumps(body))


def _check_ok(r: httpx.Response) -> None:
    assert r.status_code == 200, r.text
    if r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    else:
        body = r.json()
        assert body["usage"]["completion_tokens"] <= 6 and body["choices"][0]["finish_reason"] in ("stop", "length")


def _check_any(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code == 200:
        _check_ok(r)
    else:
        assert set(r.json()["error"]) == ERROR_KEYS


@given(body=valid_chat)
@settings(FUZZ, max_examples=15)
def test_fuzz_valid_chat(server: Server, body: dict[str, Any]) -> None:
    _check_ok(_post(server, "/v1/chat/completions", body))


@given(body=valid_completion)
@settings(FUZZ, max_examples=8)
def test_fuzz_valid_completions(server: Server, body: dict[str, Any]) -> None:
    _check_ok(_post(server, "/v1/completions", body))


@given(body=junk_chat)
@settings(FUZZ, max_examples=20)
def test_fuzz_junk_chat(server: Server, body: dict[str, Any]) -> None:
    _check_any(_post(server, "/v1/chat/completions", body))


@given(body=junk_completion)
@settings(FUZZ, max_examples=10)
def test_fuzz_junk_completions(server: Server, body: dict[str, Any]) -> None:
    _check_any(_post(server, "/v1/completions", body))


@given(body=junk_tools)
@settings(FUZZ, max_examples=25)
def test_fuzz_tools_and_formats(server: Server, body: dict[str, Any]) -> None:
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code < 500, (r.status_code, r.text)
    if r.status_code != 200:
        assert set(r.json()["error"]) == ERROR_KEYS


def test_worker_still_answers_after_fuzzing(server: Server) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3})
    assert r.status_code == 200
    s = server.stats()
    assert s["requests"]["errored"] == 0 and s["worker"]["restarts"] == 0
