"""Tool-call formats: how a model family writes a call, chosen from the chat template's text.

Each format declares itself once in :data:`FORMATS` (detected in that order, as llama-server's
``common/chat.cpp`` picks a handler from the template source) and knows three things:

- its call text, as a head (which starts with the format's trigger word), the arguments JSON, and a tail,
  from which the grammars are built: ``required`` and a named function make every reply a call (or
  several, with ``parallel_tool_calls``); ``auto`` is lazy: free text until the trigger word, then a call;
- the parsers that read calls back from a reply: whole calls amid text (:mod:`server.tools.parse`), or
  the calls of a reply that a grammar makes all calls, streamed as they are written (:mod:`server.tools.forced`);
- how to describe tools to a model whose template does not render them (the Hermes prompt).

``hermes`` is Qwen2.5/Qwen3's (and NousResearch Hermes'): ``<tool_call>\\n{"name": ..., "arguments": ...}
\\n</tool_call>``, several per reply. ``llama3`` is Llama 3.1-3.3's JSON tool calls: the whole reply is
``{"name": ..., "parameters": ...}``, one per reply (its template refuses parallel calls).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from engine_bridge.gbnf import GrammarBuilder, GrammarSpec, Trigger, literal
from server.tools.forced import ForcedCallParser
from server.tools.parse import CallParser, JsonReplyParser, TaggedCallParser

MAX_PARALLEL_CALLS = 16  # a grammar allows this many calls per reply (random-weight models never stop else)
_NAME_MARK = "flux-name"  # splits a call's head around the function's name


@dataclass(frozen=True)
class Function:
    """One tool the request offers: its name and the JSON schema of its arguments."""

    name: str
    parameters: Mapping[str, Any]
    index: int  # position in the request's tools, for error messages


class ToolFormat(ABC):
    """How one model family writes tool calls."""

    name: ClassVar[str]
    trigger: ClassVar[str]  # every call's head starts with it; a lazy grammar starts after it
    at_start: ClassVar[bool] = False  # calls only at the reply's start
    separator: ClassVar[str | None] = None  # between parallel calls; None: one call per reply

    @classmethod
    @abstractmethod
    def detect(cls, source: str) -> bool:
        """True when a chat template's source writes tool calls this way."""

    @abstractmethod
    def head(self, name: str) -> str:
        """The text of a call to ``name`` before its arguments."""

    @abstractmethod
    def tail(self) -> str:
        """The text of a call after its arguments."""

    @abstractmethod
    def parser(self) -> CallParser:
        """A fresh parser for one reply."""

    def grammar(self, functions: Sequence[Function], *, parallel: bool, lazy: bool) -> GrammarSpec:
        """Replies that are calls to ``functions``: all of the reply, or (``lazy``) what follows the trigger.

        Raises:
            GrammarError: a function's parameters cannot be enforced (``where`` names the tool).
        """
        g = GrammarBuilder()
        full, after = [], []
        for f in functions:
            args = g.schema(f"args-{f.index}", f.parameters, f"tools[{f.index}].function.parameters")
            head = self.head(f.name)
            full.append(g.rule(f"call-{f.index}", f"{literal(head)} {args} {literal(self.tail())}"))
            after.append(g.rule(f"rest-{f.index}", f"{literal(head[len(self.trigger):])} {args} "
                                                   f"{literal(self.tail())}") if len(head) > len(self.trigger)
                         else g.rule(f"rest-{f.index}", f"{args} {literal(self.tail())}"))
        call = g.rule("call", " | ".join(full))
        first = g.rule("first", " | ".join(after)) if lazy else call
        more = ""
        if parallel and self.separator is not None:
            more = f" ({literal(self.separator)} {call}){{0,{MAX_PARALLEL_CALLS - 1}}}"
        trigger = Trigger(words=[self.trigger], at_start=self.at_start) if lazy else None
        return g.build(f"{first}{more}", trigger)

    def forced_parser(self, names: Sequence[str]) -> CallParser:
        """A parser of replies that a (not lazy) grammar of this format makes all calls to ``names``: it streams
        each call's name and arguments as they are written."""
        prefix, infix = self.head(_NAME_MARK).split(json.dumps(_NAME_MARK), 1)
        return ForcedCallParser(prefix, infix, self.tail(), names)

    def tools_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """A system prompt describing ``tools`` (Hermes'), for templates that do not render tools."""
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                f"with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\nFor "
                "each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")

    def call_text(self, name: str, arguments: str) -> str:
        """A past call as the model writes it (for templates that do not render tool calls)."""
        return f"{self.head(name)}{arguments}{self.tail()}"


class Hermes(ToolFormat):
    """``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Qwen3, Hermes 2/3)."""

    name = "hermes"
    trigger = "<tool_call>"
    separator = "\n"

    @classmethod
    def detect(cls, source: str) -> bool:
        """Templates that write ``<tool_call>`` around JSON (not Qwen3-Coder's XML ``<function=``)."""
        return "<tool_call>" in source and "<function=" not in source

    def head(self, name: str) -> str:
        """``<tool_call>\\n{"name": "f", "arguments": ``."""
        return f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '

    def tail(self) -> str:
        """``}\\n</tool_call>``."""
        return "}\n</tool_call>"

    def parser(self) -> CallParser:
        """Calls between ``<tool_call>`` and ``</tool_call>``, text around them as content."""
        return TaggedCallParser("<tool_call>", "</tool_call>", args_keys=("arguments", "parameters"))


class Llama3(ToolFormat):
    """The whole reply is ``{"name": "f", "parameters": {...}}`` (Llama 3.1, 3.2, 3.3)."""

    name = "llama3"
    trigger = '{"name": '
    at_start = True

    @classmethod
    def detect(cls, source: str) -> bool:
        """Llama 3.x templates: tool results in an ``ipython`` turn, calls as ``"parameters"`` JSON."""
        return "<|start_header_id|>" in source and ("ipython" in source or '"parameters"' in source)

    def head(self, name: str) -> str:
        """``{"name": "f", "parameters": ``."""
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": '

    def tail(self) -> str:
        """``}``."""
        return "}"

    def parser(self) -> CallParser:
        """A reply that is one JSON call (optionally after ``<|python_tag|>``); anything else is content."""
        return JsonReplyParser(prefixes=("<|python_tag|>",), args_keys=("parameters", "arguments"))


FORMATS: dict[str, type[ToolFormat]] = {"hermes": Hermes, "llama3": Llama3}
FALLBACK = "hermes"  # templates with no known tool syntax get Hermes calls and a Hermes tools prompt


def detect_format(source: str) -> ToolFormat:
    """The tool-call format a chat template uses (Hermes when it shows none)."""
    for cls in FORMATS.values():
        if cls.detect(source):
            return cls()
    return FORMATS[FALLBACK]()
