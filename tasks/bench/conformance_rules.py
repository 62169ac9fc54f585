"""Conformance findings and the known, harmless differences that explain some of them.

A :class:`Finding` is one comparison of Flux's engine with llama-server (or llama-cpp-python). A
disagreement that a rule in :data:`EXPLAINED` matches is reported with that rule's reason instead of as
a bug (``flux bench conformance``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict


class Finding(BaseModel):
    """One comparison: ok, or a disagreement (explained by a rule, or not)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    check: str
    case: str
    ok: bool
    ours: str = ""
    theirs: str = ""
    explained: str | None = None


@dataclass(frozen=True)
class Explained:
    """A known, harmless difference: which findings it covers and why it is not a bug."""

    name: str
    reason: str
    matches: Callable[[Finding], bool]


def _utf8_dropped(f: Finding) -> bool:
    return f.check == "chat" and f.case.endswith("content") and f.ours == f.theirs.replace("\ufffd", "")


def _utf8_overrun_text(f: Finding) -> bool:
    return (f.check == "chat" and f.case.endswith("content") and f.ours != f.theirs.replace("\ufffd", "")
            and f.ours.startswith(f.theirs.replace("\ufffd", "")))


def _utf8_overrun_usage(f: Finding) -> bool:
    """Same prompt count; llama-cpp-python's completion count at most 3 over llama-server's (a UTF-8 tail)."""
    ours, theirs = _pair(f.ours), _pair(f.theirs)
    if f.check != "usage" or not f.case.startswith("chat ") or ours is None or theirs is None:
        return False
    return ours[0] == theirs[0] and theirs[1] < ours[1] <= theirs[1] + 3


def _pair(text: str) -> tuple[int, int] | None:
    """'(a, b)' as a usage finding shows it."""
    m = re.fullmatch(r"\((\d+), (\d+)\)", text)
    return (int(m[1]), int(m[2])) if m else None


LCP_UTF8 = ("llama-cpp-python's create_completion skips its max_tokens check while the text ends inside a "
            "multi-byte UTF-8 character (its 'multibyte_fix'), so it may decode up to 3 tokens past max_tokens; "
            "llama-server stops at max_tokens. Only the worker's `chat` op (flux generate --chat) goes through it; "
            "the serving engine stops at max_tokens (see the greedy/usage checks).")
EXPLAINED: tuple[Explained, ...] = (
    Explained("invalid-utf8-in-chat", "llama-cpp-python's chat completion drops bytes that are not valid UTF-8 "
              "(a random-weight twin emits lone byte tokens); llama-server writes U+FFFD for them. The serving "
              "engine writes U+FFFD like llama-server (see the greedy text check).", _utf8_dropped),
    Explained("llama-cpp-python-utf8-overrun", LCP_UTF8, _utf8_overrun_text),
    Explained("llama-cpp-python-utf8-overrun-usage", LCP_UTF8, _utf8_overrun_usage),
)


def explain(f: Finding) -> Finding:
    """The finding, with the rule that explains it when one does."""
    if f.ok:
        return f
    rule = next((r for r in EXPLAINED if r.matches(f)), None)
    return f.model_copy(update={"explained": f"{rule.name}: {rule.reason}"}) if rule else f
