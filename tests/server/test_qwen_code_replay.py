"""A replay of what Qwen Code 0.24.4 sent to `flux serve` (captured by scripts/qwen_code_e2e.py): its real
request bodies, 10 and then 6 tools, streamed, content as text parts, max_tokens 32768.

Whole, the requests are parsed, planned (a grammar for every tool schema) and rendered with the twin's
template, tools included. Against a real server they are sent with their long texts shortened (a twin
prefills the whole ~45k-token first request in minutes on two cores; the tools' schemas, the message
structure and every other field stay as sent): the requests as sent stream a reply; with the choice forced,
each reply is a call whose arguments validate against that tool's schema.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import ServeEnv, Server, start_server, stop_server

from artifacts.records.plan import Plan
from engine_bridge.gbnf import schema_grammar
from server.chat import ChatTemplate
from server.schemas import ChatRequest, parse_body
from server.tools.formats import Hermes
from server.tools.plan import ANY_OBJECT, ReplyPlanner

jsonschema = pytest.importorskip("jsonschema")
FIXTURE = Path(__file__).parent / "data" / "qwen_code_0.24.4_requests.jsonl"
TEXT_CHARS = {"content": 300, "text": 300, "description": 60}  # what a replayed text keeps


def _captured() -> list[dict[str, Any]]:
    return [json.loads(line)["body"] for line in FIXTURE.read_text().splitlines()]


def _shorten(value: Any, key: str = "") -> Any:
    """The same JSON with long texts cut: message contents and descriptions, never a schema's structure."""
    if isinstance(value, dict):
        return {k: _shorten(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_shorten(v, key) for v in value]
    if isinstance(value, str) and len(value) > TEXT_CHARS.get(key, len(value)):
        return value[:TEXT_CHARS[key]]
    return value


def test_the_capture_is_what_the_issue_describes() -> None:
    bodies = _captured()
    assert [len(b["tools"]) for b in bodies] == [10, 6]
    for b in bodies:
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True} and b["max_tokens"] == 32768
        assert any(isinstance(m["content"], list) for m in b["messages"]), "content as text parts"


def test_every_request_parses_plans_and_renders_its_tools(tiny_moe_template: str) -> None:
    template = ChatTemplate(tiny_moe_template)
    planner = ReplyPlanner(Hermes(), template.caps)
    for body in _captured():
        req = parse_body(json.dumps(body).encode(), ChatRequest)
        for choice in (None, "required"):
            plan = planner.plan(req.model_copy(update={"tool_choice": choice}))
            assert plan.grammar is not None and plan.parse_tools
            assert (plan.grammar.trigger is None) == (choice == "required")
        messages, tools = planner.messages([m.for_template() for m in req.messages], planner.plan(req).tools)
        prompt = template.render(messages, tools)
        for t in body["tools"]:
            assert json.dumps(t["function"]["name"]) in prompt
        assert prompt.count("<|im_start|>") == len(body["messages"]) + 1


@pytest.fixture(scope="module")
def replay_server(senv: ServeEnv, tiny_moe: Path, plan_maker: Callable[..., Plan]) -> Iterator[Server]:
    srv = start_server(senv, plan_maker(senv.settings, tiny_moe, n_ctx=8192, n_seq_max=2).id)
    yield srv
    stop_server(srv)


def _post_stream(srv: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.Client(timeout=300) as c, c.stream("POST", f"{srv.base}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


@pytest.mark.parametrize("index", [0, 1])
def test_replayed_as_sent_streams_a_reply(replay_server: Server, index: int) -> None:
    body = {**_shorten(_captured()[index]), "max_tokens": 16, "model": None}
    events = _post_stream(replay_server, body)
    assert not [e for e in events if "error" in e]
    assert events[-1]["usage"]["prompt_tokens"] > 1000 and events[-1]["choices"] == []
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_forced_calls_validate_against_qwen_codes_schemas(replay_server: Server) -> None:
    """Each tool of the first request (10) forced by name: a complete call validates against its schema. A
    random-weight model closes a free string only by chance (one token in hundreds), so a call with a
    required string may run past max_tokens: it is then still the call, its arguments as far as they got."""
    body = _shorten(_captured()[0])
    schemas = {t["function"]["name"]: t["function"].get("parameters") or ANY_OBJECT for t in body["tools"]}
    complete = set()
    for name, schema in schemas.items():
        schema_grammar(schema)  # each schema is enforceable as it is
        forced = copy.deepcopy(body) | {"stream": False, "max_tokens": 200, "seed": 7, "parallel_tool_calls": False,
                                        "tool_choice": {"type": "function", "function": {"name": name}}, "model": None}
        forced.pop("stream_options")
        r = httpx.post(f"{replay_server.base}/v1/chat/completions", json=forced, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == name and choice["message"]["content"] is None, choice
        if choice["finish_reason"] == "length":
            assert call["function"]["arguments"].startswith("{"), call
            continue
        assert choice["finish_reason"] == "tool_calls"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
        complete.add(name)
    assert complete, "some forced calls complete within 200 tokens"
