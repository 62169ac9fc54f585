"""What a chat request's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and ``response_format`` ask of
its reply: the tools the template renders, the grammar the worker enforces, and whether to parse calls.

As llama-server: ``required`` or a named function makes the whole reply a call (enforced by grammar);
``auto`` lets the model write text until it starts a call, which the grammar then keeps valid; ``none``
shows the tools but parses no calls. ``response_format`` ``json_object`` / ``json_schema`` makes the reply
JSON valid for the schema, unless a call is required. Grammars are cached: agents send the same tools
with every request.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine_bridge.errors import GrammarError
from engine_bridge.gbnf import GrammarSpec, schema_grammar
from server.chat import TemplateCaps
from server.errors import InvalidRequest
from server.schemas import ChatRequest, JsonObjectFormat, JsonSchemaFormat, NamedToolChoice
from server.tools.formats import Function, ToolFormat

GRAMMAR_CACHE_SIZE = 64
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ReplyPlan:
    """How one chat reply is rendered, constrained and read."""

    tools: list[dict[str, Any]] | None  # OpenAI's tools, for the template
    grammar: GrammarSpec | None
    parse_tools: bool
    forced: tuple[str, ...] = ()  # the functions a grammar makes the whole reply calls to (streamed as written)


class ReplyPlanner:
    """Plans replies for one model's template and tool-call format."""

    def __init__(self, fmt: ToolFormat, caps: TemplateCaps) -> None:
        """Plan for templates with ``caps`` whose model writes calls as ``fmt``."""
        self.fmt = fmt
        self.caps = caps
        self._cache: OrderedDict[str, GrammarSpec | None] = OrderedDict()

    def plan(self, req: ChatRequest) -> ReplyPlan:
        """The reply plan of ``req``.

        Raises:
            InvalidRequest: ``tool_choice`` without tools or naming an unknown function, duplicate function
                names, or a schema that cannot be enforced (``param`` names it).
        """
        tools = req.tools or []
        names = [t.function.name for t in tools]
        choice = req.tool_choice or ("auto" if tools else "none")
        if choice not in ("none", "auto") and not tools:
            raise InvalidRequest("tool_choice 'required' or a named function needs 'tools'", param="tool_choice")
        if len(set(names)) != len(names):
            raise InvalidRequest("tools: function names must be unique", param="tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequest(f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                                 param="tool_choice")
        key = json.dumps([[t.model_dump(mode="json") for t in tools], _dump(choice), req.parallel_tool_calls,
                          _dump(req.response_format)], sort_keys=True)
        if key not in self._cache:
            self._cache[key] = self._grammar(req, choice)
            while len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        forced = (choice.function.name,) if isinstance(choice, NamedToolChoice) else ()
        return ReplyPlan(tools=[t.model_dump(mode="json", exclude_none=True) for t in tools] or None,
                         grammar=self._cache[key], parse_tools=bool(tools) and choice != "none",
                         forced=tuple(names) if choice == "required" else forced)

    def _grammar(self, req: ChatRequest, choice: Any) -> GrammarSpec | None:
        tools = req.tools or []
        functions = [Function(t.function.name, t.function.parameters or ANY_OBJECT, i) for i, t in enumerate(tools)]
        parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None else True
        parallel = parallel and self.caps.parallel_tool_calls
        try:
            if isinstance(choice, NamedToolChoice):
                chosen = [f for f in functions if f.name == choice.function.name]
                return self.fmt.grammar(chosen, parallel=parallel, lazy=False)
            if choice == "required":
                return self.fmt.grammar(functions, parallel=parallel, lazy=False)
            rf = req.response_format
            if isinstance(rf, JsonObjectFormat):
                return schema_grammar(ANY_OBJECT, "response_format")
            if isinstance(rf, JsonSchemaFormat):
                return schema_grammar(rf.json_schema.schema_ or ANY_OBJECT, "response_format.json_schema.schema")
            if choice == "auto" and functions:
                return self.fmt.grammar(functions, parallel=parallel, lazy=True)
        except GrammarError as exc:
            raise InvalidRequest(f"{exc.where}: this schema cannot be enforced: {exc.reason}",
                                 param=exc.where, code="invalid_schema") from exc
        return None

    def messages(self, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> tuple[
            list[dict[str, Any]], list[dict[str, Any]] | None]:
        """Messages and tools for the template: what it cannot render itself is written as the model's text."""
        out = list(messages)
        if not self.caps.tool_calls:
            out = [self._calls_as_text(m) for m in out]
        if tools and not self.caps.tools:
            prompt = self.fmt.tools_prompt(tools)
            if out and out[0]["role"] in ("system", "developer"):
                out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
            else:
                out.insert(0, {"role": "system", "content": prompt})
            return out, None
        return out, tools

    def _calls_as_text(self, m: dict[str, Any]) -> dict[str, Any]:
        if not m.get("tool_calls"):
            return m
        calls = [self.fmt.call_text(c["function"]["name"], _arguments_text(c["function"]["arguments"]))
                 for c in m["tool_calls"]]
        text = "\n".join(filter(None, [m.get("content") or "", *calls]))
        return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _dump(value: Any) -> Any:
    return value.model_dump(mode="json") if hasattr(value, "model_dump") else value
