"""Parsers that read tool calls back from a reply's text, piece by piece as it streams.

A parser is fed the reply's text (after stop sequences) and returns what can be sent now: content text,
or a whole tool call once its closing text has arrived. Text that may still turn into a call (a partial
``<tool_call>``, or a reply that starts like a JSON call) is held back until it is decided. What does not
parse as a call is content, as written; nothing is dropped but the whitespace between calls.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

_WS = " \t\r\n"


@dataclass(frozen=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


PieceKind = Literal["content", "call", "call_open", "call_args"]


@dataclass(frozen=True)
class Piece:
    """What a parser lets out: content text, one whole tool call, or a call streamed in pieces (its name in
    ``call_open``'s ``call``, then its arguments' text in ``call_args`` pieces)."""

    kind: PieceKind
    text: str = ""
    call: ParsedCall | None = None


def _content(text: str) -> list[Piece]:
    return [Piece("content", text)] if text else []


def parse_call(body: str, args_keys: Sequence[str]) -> ParsedCall | None:
    """``{"name": ..., "arguments": {...}}`` (or the arguments as a JSON string) as a call; None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args: Any = next((value[k] for k in args_keys if k in value), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))


class CallParser(ABC):
    """Turns one reply's text into content and tool calls."""

    def __init__(self) -> None:
        self.calls = 0

    @abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """Add a piece of the reply; returns what is decided."""

    @abstractmethod
    def finish(self) -> list[Piece]:
        """The reply ended: everything still held back."""

    def _call(self, call: ParsedCall) -> list[Piece]:
        self.calls += 1
        return [Piece("call", call=call)]

    def _text(self, text: str) -> list[Piece]:
        """Content; once a call was made, whitespace alone (between or after calls) is dropped."""
        return _content(text if not self.calls or text.strip(_WS) else "")


class TaggedCallParser(CallParser):
    """Calls written between an opening and a closing tag, anywhere in the reply (Hermes)."""

    def __init__(self, open_tag: str, close_tag: str, args_keys: Sequence[str]) -> None:
        """Read calls between ``open_tag`` and ``close_tag``; arguments under the first of ``args_keys``."""
        super().__init__()
        self.open, self.close, self.args_keys = open_tag, close_tag, tuple(args_keys)
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[Piece]:
        """Content up to a tag (a possible partial tag is held), each call once its closing tag arrives."""
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._in_call:
                j = self._buf.find(self.close)
                if j < 0:
                    return out
                out += self._end_call(self._buf[:j])
                self._buf = self._buf[j + len(self.close):]
                continue
            i = self._buf.find(self.open)
            if i < 0:
                keep = _partial_suffix(self._buf, self.open)
                out += self._text(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            out += self._text(self._buf[:i])
            self._buf, self._in_call = self._buf[i + len(self.open):], True

    def _end_call(self, body: str) -> list[Piece]:
        self._in_call = False
        call = parse_call(body.strip(_WS), self.args_keys)
        return self._call(call) if call is not None else self._text(f"{self.open}{body}{self.close}")

    def finish(self) -> list[Piece]:
        """An unclosed call still counts if its JSON is complete (models often end at ``</tool_call>``)."""
        buf, self._buf = self._buf, ""
        if not self._in_call:
            return self._text(buf)
        self._in_call = False
        call = parse_call(buf.strip(_WS), self.args_keys)
        return self._call(call) if call is not None else self._text(f"{self.open}{buf}")


class JsonReplyParser(CallParser):
    """A reply that is one JSON call, possibly after a prefix tag (Llama 3.x); any other reply is content."""

    def __init__(self, prefixes: Sequence[str], args_keys: Sequence[str]) -> None:
        """A call is the whole reply, after optional whitespace and one of ``prefixes``."""
        super().__init__()
        self.prefixes, self.args_keys = tuple(prefixes), tuple(args_keys)
        self._buf = ""
        self._mode: Literal["start", "json", "content"] = "start"

    def _body(self) -> str:
        s = self._buf.lstrip(_WS)
        for p in self.prefixes:
            if s.startswith(p):
                return s[len(p):].lstrip(_WS)
        return s

    def feed(self, text: str) -> list[Piece]:
        """Content streams once the reply does not start like a call; a call is held until the end."""
        if self._mode == "content":
            return _content(text)
        self._buf += text
        if self._mode == "json":
            return []
        body = self._body()
        undecided = not body or any(p.startswith(self._buf.lstrip(_WS)) for p in self.prefixes)
        if undecided:
            return []
        if body.startswith("{"):
            self._mode = "json"
            return []
        self._mode, buf, self._buf = "content", self._buf, ""
        return _content(buf)

    def finish(self) -> list[Piece]:
        """The held reply as a call if it parses as one, else as content."""
        buf, body, self._buf = self._buf, self._body(), ""
        if self._mode == "json":
            call = parse_call(body.rstrip(_WS), self.args_keys)
            if call is not None:
                return self._call(call)
        return _content(buf)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that starts ``tag``."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
