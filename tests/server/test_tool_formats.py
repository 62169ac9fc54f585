"""Tool-call formats chosen from the GGUF's template: Qwen/Hermes (the twins' template), Llama 3.x (a twin
carrying Llama 3.1's template), and a template that knows no tools (Hermes calls, tools in the system turn)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support import ServeEnv, Server, start_server, stop_server, with_chat_template

from artifacts.records.plan import Plan
from server.chat import FALLBACK_TEMPLATE, ChatTemplate, TemplateCaps
from server.tools.formats import Function, Hermes, Llama3

jsonschema = pytest.importorskip("jsonschema")
ARGS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS: list[Any] = [{"type": "function", "function": {"name": "get_weather", "parameters": ARGS}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_template_caps(tiny_moe_template: str, llama3_template: str) -> None:
    assert ChatTemplate(tiny_moe_template).caps == TemplateCaps(True, True, True, True, True)
    llama = ChatTemplate(llama3_template, "<|begin_of_text|>").caps
    assert llama.tools and llama.tool_calls and llama.object_arguments and not llama.parallel_tool_calls
    assert ChatTemplate(FALLBACK_TEMPLATE).caps == TemplateCaps(True, False, False, False, False)


def test_past_calls_render_as_the_model_writes_them(tiny_moe_template: str, llama3_template: str) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
    qwen = ChatTemplate(tiny_moe_template).render(msgs, TOOLS)
    assert Hermes().call_text("get_weather", '{"city": "Oslo"}') in qwen and "<tool_response>\nrain" in qwen
    llama = ChatTemplate(llama3_template).render(msgs, TOOLS)
    assert Llama3().call_text("get_weather", '{"city": "Oslo"}') in llama
    assert "<|start_header_id|>ipython<|end_header_id|>" in llama and '"get_weather"' in llama


def test_grammars_of_each_format() -> None:
    f = [Function("get_weather", ARGS, 0)]
    hermes = Hermes().grammar(f, parallel=True, lazy=False)
    assert hermes.trigger is None and '"<tool_call>\\n{\\"name\\": \\"get_weather\\"' in hermes.gbnf
    lazy = Hermes().grammar(f, parallel=False, lazy=True)
    assert lazy.trigger is not None and lazy.trigger.words == ["<tool_call>"] and not lazy.trigger.at_start
    llama = Llama3().grammar(f, parallel=True, lazy=True)
    assert llama.trigger is not None and llama.trigger.at_start and llama.gbnf.endswith("root ::= first\n")


def _serve(senv: ServeEnv, model: Path, make_plan: Callable[..., Plan]) -> Server:
    return start_server(senv, make_plan(senv.settings, model, n_ctx=2048, n_seq_max=2).id)


@pytest.fixture(scope="module")
def llama_server(senv: ServeEnv, llama3_twin: Path, plan_maker: Callable[..., Plan]) -> Iterator[Server]:
    srv = _serve(senv, llama3_twin, plan_maker)
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def plain_server(senv: ServeEnv, tiny_moe: Path, plan_maker: Callable[..., Plan]) -> Iterator[Server]:
    """A twin whose template renders no tools (plain ChatML)."""
    srv = _serve(senv, with_chat_template(tiny_moe, tiny_moe.with_name("tiny-moe-plain.gguf"), FALLBACK_TEMPLATE),
                 plan_maker)
    yield srv
    stop_server(srv)


def _call(srv: Server, **kw: Any) -> Any:
    client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=120, **kw)


@pytest.mark.parametrize("which", ["llama_server", "plain_server"])
def test_required_calls_in_each_format(which: str, request: pytest.FixtureRequest) -> None:
    srv: Server = request.getfixturevalue(which)
    for seed in range(3):
        r = _call(srv, tool_choice="required", seed=seed)
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and calls and len(calls) >= 1
        assert calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), ARGS)
    if which == "llama_server":
        assert len(calls) == 1, "Llama 3.1's template takes one call per turn"
    streamed = _call(srv, tool_choice="required", seed=1, stream=True)
    deltas = [d for c in streamed if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].function.name == "get_weather"


@pytest.mark.parametrize("which", ["llama_server", "plain_server"])
def test_tool_loop_and_auto_in_each_format(which: str, request: pytest.FixtureRequest) -> None:
    srv: Server = request.getfixturevalue(which)
    first = _call(srv, tool_choice="required", parallel_tool_calls=False, seed=4)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r = httpx.post(f"{srv.base}/v1/chat/completions", timeout=60,
                   json={"messages": history, "tools": TOOLS, "max_tokens": 4, "tool_choice": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > first.usage.prompt_tokens + 10, "the call and its result are in"


def test_a_template_without_tools_gets_them_in_its_system_turn(plain_server: Server) -> None:
    def tokens(body: dict[str, Any]) -> int:
        r = httpx.post(f"{plain_server.base}/v1/chat/completions", json={**body, "max_tokens": 1}, timeout=60)
        return int(r.json()["usage"]["prompt_tokens"])

    assert tokens({"messages": ASK, "tools": TOOLS}) > tokens({"messages": ASK}) + 50
