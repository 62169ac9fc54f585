"""Tools and structured output against a real server with the real `openai` client.

The twin's weights are random, so its free text is gibberish; what must hold is what grammar-constrained
decoding guarantees: with ``tool_choice="required"`` or a named function every reply is a valid call for
the tool's schema, streamed or not, and ``response_format`` replies validate against their schema.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from support import Server

from artifacts.records.plan import Plan

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "local"]}}, "required": ["zone"],
         "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "The time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_calls(calls: list[Any], names: set[str]) -> None:
    assert calls, "the reply is a tool call"
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def _stream(client: openai.OpenAI, plan: Plan, **kw: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, tool calls accumulated from deltas, finish_reason) of a streamed chat."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=plan.model_name, stream=True, **kw):
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for d in ch.delta.tool_calls or []:
            acc = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            acc["id"] = d.id or acc["id"]
            acc["name"] += d.function.name or "" if d.function else ""
            acc["arguments"] += d.function.arguments or "" if d.function else ""
        reason = ch.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_full_tool_loop_required_then_result_then_reply(client: openai.OpenAI, plan: Plan) -> None:
    # one call per reply: a random-weight model would otherwise go on calling until max_tokens
    first = client.chat.completions.create(model=plan.model_name, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                           tool_choice="required", max_tokens=300, temperature=0.8, seed=3,
                                           parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls or []
    _check_calls(calls, {"get_weather", "get_time"})
    assert choice.message.content is None
    history: list[Any] = [*ASK, choice.message.model_dump(exclude_none=True)]
    history += [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temp": 21})} for c in calls]
    second = client.chat.completions.create(model=plan.model_name, messages=history, tools=TOOLS,  # type: ignore[arg-type]
                                            max_tokens=8, temperature=0)
    assert second.choices[0].message.role == "assistant"
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def test_streamed_tool_loop(client: openai.OpenAI, plan: Plan) -> None:
    content, calls, reason = _stream(client, plan, messages=ASK, tools=TOOLS, tool_choice="required",
                                     max_tokens=300, seed=5, stream_options={"include_usage": True},
                                     parallel_tool_calls=False)
    assert reason == "tool_calls" and calls and content == ""
    for c in calls:
        assert c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    history: list[Any] = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls]}]
    history += [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"} for c in calls]
    _, _, reason = _stream(client, plan, messages=history, tools=TOOLS, max_tokens=6, temperature=0)
    assert reason in ("stop", "length", "tool_calls")


def test_named_function_is_the_one_called(client: openai.OpenAI, plan: Plan) -> None:
    for seed in range(3):
        r = client.chat.completions.create(model=plan.model_name, messages=ASK, tools=TOOLS, seed=seed,  # type: ignore[arg-type]
                                           tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           max_tokens=200, parallel_tool_calls=False)
        calls = r.choices[0].message.tool_calls or []
        assert len(calls) == 1 and r.choices[0].finish_reason == "tool_calls"
        _check_calls(calls, {"get_time"})


def test_parallel_calls_each_valid(client: openai.OpenAI, plan: Plan) -> None:
    r = client.chat.completions.create(model=plan.model_name, messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                                       max_tokens=200, seed=11)
    calls = r.choices[0].message.tool_calls or []
    cut = r.choices[0].finish_reason == "length"  # the last call may be cut: arguments as far as they got
    _check_calls(calls[:-1] if cut else calls, {"get_weather", "get_time"})
    assert len({c.id for c in calls}) == len(calls) and r.choices[0].message.content is None


def test_tools_reach_the_template(server: Server) -> None:
    def prompt_tokens(body: dict[str, Any]) -> int:
        r = httpx.post(f"{server.base}/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60)
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens"])

    plain = prompt_tokens({"messages": ASK})
    with_tools = prompt_tokens({"messages": ASK, "tools": TOOLS})
    assert with_tools > plain + 100, "the tools' JSON is in the prompt"


def test_auto_lets_text_through_and_none_parses_nothing(client: openai.OpenAI, plan: Plan) -> None:
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=plan.model_name, messages=ASK, tools=TOOLS,  # type: ignore[arg-type]
                                           tool_choice=choice, max_tokens=12, temperature=0)  # type: ignore[arg-type]
        assert r.choices[0].finish_reason in ("stop", "length"), r
        assert r.choices[0].message.tool_calls is None or choice == "auto"


def test_json_schema_reply_validates(client: openai.OpenAI, plan: Plan) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20},
                                               "confidence": {"type": "integer", "minimum": 0},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "maxItems": 3}},
              "required": ["answer", "confidence", "tags"], "additionalProperties": False}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model=plan.model_name, messages=ASK, response_format=fmt,  # type: ignore[arg-type]
                                           max_tokens=200, seed=seed)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
    content, _, reason = _stream(client, plan, messages=ASK, response_format=fmt, max_tokens=200, seed=9)
    assert reason == "stop"
    jsonschema.validate(json.loads(content), schema)


def test_json_object_reply_is_an_object(client: openai.OpenAI, plan: Plan) -> None:
    r = client.chat.completions.create(model=plan.model_name, messages=ASK, max_tokens=60, seed=1,  # type: ignore[arg-type]
                                       response_format={"type": "json_object"})
    text = (r.choices[0].message.content or "").strip()
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(("field", "param"), [
    ({"response_format": {"type": "bogus"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "thing"}}}},
     "response_format.json_schema.schema.type"),
    ({"tools": "notalist"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, "tool_choice"),
    ({"parallel_tool_calls": "yes", "tools": TOOLS}, "parallel_tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "messages[0].tool_calls[0].function"),
])
def test_malformed_tools_and_formats_are_400(server: Server, field: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{server.base}/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **field}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


# -- forced calls stream as they are written, and one cut by max_tokens is still a call -------------------
HEAD = '<tool_call>\n{"name": "get_weather", "arguments": '
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


def _chunks(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.Client(timeout=120) as c:
        r = c.post(f"{server.base}/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _streamed_call(chunks: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, the tool_calls deltas in order, finish_reason) of a streamed reply."""
    content, deltas, reason = "", [], None
    for ch in chunks:
        for choice in ch["choices"]:
            content += choice["delta"].get("content") or ""
            deltas += choice["delta"].get("tool_calls") or []
            reason = choice["finish_reason"] or reason
    return content, deltas, reason


def _full_call(server: Server, body: dict[str, Any]) -> tuple[list[str], str]:
    """The token texts of a whole forced call (greedy, so a shorter reply is its prefix) and its arguments."""
    r = httpx.post(f"{server.base}/v1/chat/completions", timeout=120, json={**body, "max_tokens": 300,
                                                                              "logprobs": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    return [t["token"] for t in choice["logprobs"]["content"]], call["function"]["arguments"]


def _inside_arguments(tokens: list[str], arguments: str) -> int:
    """A max_tokens that ends the reply halfway through the call's arguments."""
    text, head_end = "", None
    for i, t in enumerate(tokens):
        text += t
        if head_end is None and len(text) >= len(HEAD):
            head_end = i + 1
    assert head_end is not None and "".join(tokens).startswith(HEAD + arguments)
    return head_end + max(1, (len(tokens) - head_end) // 2)


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_a_forced_call_cut_by_max_tokens_is_still_a_call(server: Server, choice: Any) -> None:
    body: dict[str, Any] = {"messages": ASK, "tools": TOOLS[:1], "tool_choice": choice, "temperature": 0,
                            "parallel_tool_calls": False}
    tokens, arguments = _full_call(server, body)
    cut = _inside_arguments(tokens, arguments)
    assert cut < len(tokens) - 1, "the arguments run past max_tokens"
    r = httpx.post(f"{server.base}/v1/chat/completions", json={**body, "max_tokens": cut}, timeout=120)
    assert r.status_code == 200, r.text
    choice_ = r.json()["choices"][0]
    assert choice_["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == cut
    assert choice_["message"]["content"] is None, "no markup in content"
    (call,) = choice_["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["function"]["name"] == "get_weather"
    got = call["function"]["arguments"]
    assert got and arguments.startswith(got) and got != arguments, (got, arguments)

    content, deltas, reason = _streamed_call(_chunks(server, {**body, "max_tokens": cut}))
    assert reason == "length" and content == ""
    first, *rest = deltas
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}, "the name comes first, at once"
    assert rest and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    assert "".join(d["function"]["arguments"] for d in rest) == got


def test_a_forced_call_streams_its_arguments_as_they_come(server: Server) -> None:
    body: dict[str, Any] = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
                            "parallel_tool_calls": False, "max_tokens": 300}
    chunks = _chunks(server, body)
    content, deltas, reason = _streamed_call(chunks)
    assert reason == "tool_calls" and content == ""
    assert deltas[0]["function"]["name"] in SCHEMAS and deltas[0]["function"]["arguments"] == ""
    pieces = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(pieces) > 3, "the arguments arrive in pieces, not at the end"
    jsonschema.validate(json.loads("".join(pieces)), SCHEMAS[deltas[0]["function"]["name"]])
    finish = next(i for i, ch in enumerate(chunks) if ch["choices"] and ch["choices"][0]["finish_reason"])
    assert finish == len(chunks) - 1 or "usage" in chunks[-1]
    whole = httpx.post(f"{server.base}/v1/chat/completions", json={**body, "stream": False}, timeout=120).json()
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": deltas[0]["function"]["name"], "arguments": "".join(pieces)}
