"""A grammar as the worker's ``generate`` op takes it: the protocol's part of grammars
(:mod:`engine_bridge.gbnf` writes them from JSON schemas and tool formats; the server uses it, planning does not).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class Trigger(BaseModel):
    """What starts a lazy grammar: one of ``words`` in the reply (anywhere, or only first with ``at_start``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    words: list[str] = Field(min_length=1)
    at_start: bool = Field(False, description="the word counts only at the reply's start (after whitespace)")

    @field_validator("words")
    @classmethod
    def _non_empty(cls, v: list[str]) -> list[str]:
        if any(not w for w in v):
            raise ValueError("trigger words must not be empty")
        return v


class GrammarSpec(BaseModel):
    """A grammar as the worker's ``generate`` op takes it.

    Without ``trigger`` the whole reply follows ``root``. With one it is lazy (as llama.cpp's lazy
    grammars): the reply is free until it writes a trigger word, and the text after that word follows
    ``root``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    gbnf: str = Field(min_length=1, description="GBNF rules, llama.cpp's grammar syntax")
    root: str = Field("root", min_length=1, description="the rule the reply must match")
    trigger: Trigger | None = None
