"""The serving engine's bookkeeping types: where its output goes (:class:`Sink`), a running request, and a
sequence slot with the tokens its KV cache holds (:mod:`engine_bridge.worker.serving` steps them).

A slot's tokens are an int32 array (:class:`Tokens`), so that comparing a 32k-token prompt with what each slot
holds is a vectorized compare, not a conversion of every slot's Python list per request.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from engine_bridge import ops
from engine_bridge.errors import EngineCode
from engine_bridge.ops import GenerateArgs
from engine_bridge.worker.grammar import GrammarSampler
from engine_bridge.worker.sampling import new_text_decoder

__all__ = ["MIN_PARK_TOKENS", "FinishReason", "Sink", "Tokens", "_Request", "_Slot"]

FinishReason = Literal["stop", "length", "cancelled"]
# Below this many tokens recomputing beats moving state: a prompt that drops fewer cached tokens from
# a slot does not park them, a parked state (or a partly matching slot) sharing fewer is not reused, and a
# parked state is restored only when it saves this many tokens more than the best slot.
MIN_PARK_TOKENS = 32
# Parking copies the WHOLE state (a 4.7k-token conversation of a 30B MoE is ~460 MB, ~300 ms out of a GPU) on the
# new request's way to its first token, so a slot is parked only when the new prompt leaves the slot's own last
# prompt (another conversation, or another branch of it): one that keeps all of it but its last MIN_PARK_TOKENS
# tokens (where a template closes the turn) is the same conversation going on (the same prompt again, the next
# turn, a turn whose template drops the last reply's thinking) and loses only the last reply's tail, which nobody
# sends again. (llama-server saves a slot only when the new prompt keeps less than half of it, f_keep < 0.5: that
# would drop, unparked, the tail of a conversation that another one shares a long system prompt with.)


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


class Tokens:
    """A growable int32 token array: what one sequence's KV cache holds, in order."""

    def __init__(self, values: Iterable[int] | np.ndarray = ()) -> None:
        arr = np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.int32)
        self._buf = np.empty(max(64, 2 * len(arr)), dtype=np.int32)
        self._buf[:len(arr)] = arr
        self._n = len(arr)

    def __len__(self) -> int:
        return self._n

    @property
    def array(self) -> np.ndarray:
        """The tokens as an int32 array view (valid until the next change)."""
        return self._buf[:self._n]

    def tolist(self) -> list[int]:
        """The tokens as a list."""
        return self.array.tolist()

    def extend(self, values: list[int]) -> None:
        """Append ``values``."""
        n = self._n + len(values)
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf)), dtype=np.int32)
            grown[:self._n] = self.array
            self._buf = grown
        self._buf[self._n:n] = values
        self._n = n

    def truncate(self, keep: int) -> None:
        """Keep the first ``keep`` tokens."""
        self._n = max(0, min(keep, self._n))


@dataclass
class _Slot:
    seq: int
    tokens: Tokens = field(default_factory=Tokens)  # exactly the tokens whose KV this sequence holds
    prompt_n: int = 0  # tokens of the last prompt admitted here (what the same conversation going on keeps)
    last_used: int = 0
    conversation: str | None = None
    req: _Request | None = None
