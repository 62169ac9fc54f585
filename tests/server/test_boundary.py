"""The serving boundary against a real server: text that is not Unicode (a lone UTF-16 surrogate, which JSON
can escape) is a 400 naming the field wherever it hides, and the server documents what it takes in its own
OpenAPI document."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from support import Server

HELLO = [{"role": "user", "content": "Hello"}]
TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
LONE = "\ud800"  # json.dumps sends it as the escape "\ud800"


def _post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    content = json.dumps(body).encode()  # ensure_ascii: the surrogate travels as a JSON escape, the body is UTF-8
    return httpx.post(f"{server.base}{path}", content=content, headers={"Content-Type": "application/json"},
                      timeout=60)


def _tool(**function: Any) -> dict[str, Any]:
    return {**TOOL, "function": {**TOOL["function"], **function}}


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}


CHAT_CASES = [
    ({"messages": [{"role": "user", "content": f"Hello {LONE} there"}]}, "messages[0].content"),
    ({"messages": [{"role": "system", "content": f"Be brief{LONE}"}, *HELLO]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]}, "messages[0].content[0].text"),
    ({"messages": HELLO, "tools": [_tool(description=f"Weather {LONE}")]}, "tools[0].function.description"),
    ({"messages": HELLO, "tools": [_tool(parameters={"type": "object", "properties": {
        "city": {"type": "string", "description": LONE}}})]}, "tools[0].function.parameters.properties.city.description"),
    ({"messages": HELLO, "response_format": _schema_format({"enum": ["a", f"b{LONE}"]})},
     "response_format.json_schema.schema.enum[1]"),
    ({"messages": HELLO, "response_format": _schema_format({"type": "object", "properties": {LONE: {}}})},
     "response_format.json_schema.schema.properties"),
    ({"messages": HELLO, "stop": [f"x{LONE}"]}, "stop[0]"),
]


@pytest.mark.parametrize(("body", "param"), CHAT_CASES)
def test_a_lone_surrogate_in_a_chat_request_is_400_naming_the_field(server: Server, body: dict[str, Any],
                                                                    param: str) -> None:
    r = _post(server, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["code"] == "invalid_value" and "surrogate" in err["message"] and param in err["message"]


@pytest.mark.parametrize(("prompt", "param"), [(f"Once upon {LONE}", "prompt"), ([f"{LONE}"], "prompt[0]")])
def test_a_lone_surrogate_in_a_completions_prompt_is_400(server: Server, prompt: Any, param: str) -> None:
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_surrogate_pairs_and_escaped_backslashes_are_text(server: Server) -> None:
    before = server.stats()["requests"]
    for text in ("\U0001f600 emoji from a surrogate pair", "a backslash then u d800: \\ud800"):
        r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2})
        assert r.status_code == 200, r.text
    after = server.stats()
    assert after["requests"]["completed"] == before["completed"] + 2
    assert after["requests"]["errored"] == before["errored"] and "500" not in after["error_responses"]


def test_surrogates_are_counted_as_rejected_not_errored(server: Server) -> None:
    before = server.stats()
    _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}], "max_tokens": 2})
    after = server.stats()
    assert after["requests"]["rejected_400"] == before["requests"]["rejected_400"] + 1
    assert after["requests"]["errored"] == before["requests"]["errored"]
    assert after["error_responses"].get("400", 0) == before["error_responses"].get("400", 0) + 1


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "$ref"] + [r for v in node.values() for r in _refs(v)]
    return [r for v in node for r in _refs(v)] if isinstance(node, list) else []


def test_the_server_serves_its_openapi_document(server: Server) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    r = httpx.get(f"{server.base}/openapi.json", timeout=30)
    assert r.status_code == 200 and "json" in r.headers["content-type"], r.text[:300]
    doc = r.json()
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] == "Flux"
    assert httpx.get(f"{server.base}/schema/openapi.json", timeout=30).json() == doc
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/flux/stats", "/health"):
        assert path in doc["paths"], path
    assert not _refs(doc), "each request body stands alone"
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    text = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"messages", "max_tokens", "tools", "tool_choice", "response_format", "stream"} <= set(chat["properties"])
    assert chat["required"] == ["messages"] and "prompt" in text["required"]
    # the document describes what the server takes: a real request validates, a wrong one does not
    jsonschema.validate({"messages": [*HELLO], "max_tokens": 4, "tools": [TOOL], "tool_choice": "required",
                         "response_format": {"type": "json_object"}, "stop": ["\n"]}, chat)
    jsonschema.validate({"prompt": "Once upon", "max_tokens": 4, "echo": True}, text)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"messages": [{"role": "bot", "content": "hi"}]}, chat)
    validator = pytest.importorskip("openapi_spec_validator")
    validator.validate(doc)
