"""The parser of replies a grammar makes all calls (``tool_choice`` ``required`` or a named function).

Such a reply is nothing but calls, each written exactly as the format's grammar spells it: a prefix, the
function's name as a JSON string, an infix, the arguments (a JSON value), a tail, and whitespace between
calls. So a call streams as it is written: its name as soon as the text so far fits one function only
(at once for a named function), then its arguments piece by piece, the format's markup never. A reply cut
by ``max_tokens`` (or a stop sequence) inside a call still ends with that call, its arguments as far as
they got. Text that does not follow the grammar (which grammar-constrained decoding rules out) is content
from where it departs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from server.tools.parse import CallParser, ParsedCall, Piece

_WS = " \t\r\n"
State = Literal["between", "name", "infix", "args", "tail", "free"]


@dataclass
class JsonEnd:
    """Finds where one JSON value ends in text fed piece by piece (strings and escapes respected)."""

    depth: int = 0
    started: bool = False
    scalar: bool = False
    in_string: bool = False
    escaped: bool = False

    def feed(self, text: str) -> int | None:
        """How many characters of ``text`` belong to the value, when it ends within ``text``; else None."""
        for i, c in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif not self.started:
                if c in _WS:
                    continue
                self.started = True
                self.depth = int(c in "{[")
                self.in_string = c == '"'
                self.scalar = c not in '{["'
            elif self.scalar:
                if c in _WS or c in ",}]":
                    return i
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class ForcedCallParser(CallParser):
    """Streams the calls of a reply that a grammar makes all calls (see the module docstring)."""

    def __init__(self, prefix: str, infix: str, tail: str, names: Sequence[str]) -> None:
        """Calls written ``prefix + json(name) + infix + arguments + tail``, to one of ``names``."""
        super().__init__()
        self.prefix, self.infix, self.tail = prefix, infix, tail
        self._quoted = {json.dumps(n, ensure_ascii=False): n for n in names}
        self._buf = ""
        self._state: State = "between"
        self._open = False  # this call's name was sent
        self._args = JsonEnd()

    def feed(self, text: str) -> list[Piece]:
        """The pieces of the calls decided by ``text``: a call's name, pieces of its arguments."""
        self._buf += text
        out: list[Piece] = []
        while self._buf and self._step(out):
            pass
        return out

    def finish(self) -> list[Piece]:
        """The reply ended: a call cut before its name was whole is sent if the name is known by then;
        unfinished markup is dropped."""
        out: list[Piece] = []
        started = self._state == "name" or (self._state == "between" and self._buf.strip(_WS) != "")
        if started and not self._open:
            only = self._candidates() if self._state == "name" else list(self._quoted)
            if len(only) == 1:
                out += self._opened(self._quoted[only[0]])
        elif self._state == "free":
            out += self._text(self._buf)
        self._buf = ""
        return out

    # -- the states ------------------------------------------------------------------------------------
    def _step(self, out: list[Piece]) -> bool:
        """Advance through the buffer once; False when it must wait for more text."""
        if self._state == "free":
            out += self._text(self._buf)
            self._buf = ""
            return False
        if self._state == "between":
            self._buf = self._buf.lstrip(_WS)
            if not self._literal(self.prefix, "name"):
                return False
            if self._state == "name" and len(self._quoted) == 1:  # a named function: known from the start
                out += self._opened(next(iter(self._quoted.values())))
            return True
        if self._state == "name":
            return self._name(out)
        if self._state == "infix":
            return self._literal(self.infix, "args")
        if self._state == "args":
            end = self._args.feed(self._buf)
            n = len(self._buf) if end is None else end
            if n:
                out.append(Piece("call_args", self._buf[:n]))
            self._buf = self._buf[n:]
            if end is None:
                return False
            self._state = "tail"
            return True
        self._buf = self._buf.lstrip(_WS)  # "tail"
        return self._literal(self.tail, "between")

    def _literal(self, text: str, then: State) -> bool:
        if self._buf.startswith(text):
            self._buf, self._state = self._buf[len(text):], then
            if then == "between":
                self._open, self._args = False, JsonEnd()
            return True
        if not text.startswith(self._buf):
            self._state = "free"
            return True
        return False

    def _candidates(self) -> list[str]:
        """The quoted names the buffer can still become (or already is, followed by more)."""
        return [q for q in self._quoted if q.startswith(self._buf) or self._buf.startswith(q)]

    def _name(self, out: list[Piece]) -> bool:
        only = self._candidates()
        if not only:
            self._state = "free"
            return True
        if len(only) > 1:
            return False
        if not self._open:
            out += self._opened(self._quoted[only[0]])
        if not self._buf.startswith(only[0]):
            return False
        self._buf, self._state = self._buf[len(only[0]):], "infix"
        return True

    def _opened(self, name: str) -> list[Piece]:
        self._open = True
        self.calls += 1
        return [Piece("call_open", call=ParsedCall(name, ""))]
