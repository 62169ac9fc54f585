"""The serving engine's bookkeeping types: where its output goes (:class:`Sink`), a running request, and a
sequence slot with the tokens its KV cache holds (:mod:`engine_bridge.worker.serving` steps them)."""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from engine_bridge import ops
from engine_bridge.errors import EngineCode
from engine_bridge.ops import GenerateArgs
from engine_bridge.worker.grammar import GrammarSampler
from engine_bridge.worker.sampling import new_text_decoder

__all__ = ["MIN_PARK_TOKENS", "FinishReason", "Sink", "_Request", "_Slot"]

FinishReason = Literal["stop", "length", "cancelled"]
# Below this many tokens recomputing beats moving state: a prompt that drops fewer cached tokens from
# a slot does not park them, and a parked state (or a partly matching slot) sharing fewer is not reused.
MIN_PARK_TOKENS = 32


class Sink(Protocol):
    """Where the engine sends what a request produces (the worker writes it to the protocol)."""

    def event(self, key: int, event: ops.TokenEvent | ops.PrefillEvent) -> None:
        """One streamed event of request ``key``."""

    def done(self, key: int, result: dict[str, Any]) -> None:
        """The final result of request ``key``."""

    def fail(self, key: int, code: EngineCode, message: str) -> None:
        """Request ``key`` failed after it was admitted."""


@dataclass
class _Request:
    key: int
    args: GenerateArgs
    chain: Any
    pending: list[int]  # tokens to feed: the rest of the prompt, then the last sampled token
    cached: int
    grammar: GrammarSampler | None = None
    decoder: codecs.IncrementalDecoder = field(default_factory=new_text_decoder)
    t0: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    generated: int = 0


@dataclass
class _Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)  # exactly the tokens whose KV this sequence holds
    last_used: int = 0
    conversation: str | None = None
    req: _Request | None = None
