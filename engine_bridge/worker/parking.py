"""Conversation state parking: a sequence's KV state kept in RAM, keyed by the tokens it holds.

When a prompt replaces a conversation in a sequence slot, the engine parks the old state here
(``llama_state_seq_get_data``); a later prompt that starts with those tokens restores it
(``llama_state_seq_set_data``) and prefills only the rest. Save and restore round-trip exactly.
The lot is bounded by bytes and evicts the least recently used state first.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llama_cpp
import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass
class Parked:
    """One parked sequence state: the tokens whose KV it holds and llama.cpp's serialized state."""

    tokens: np.ndarray
    data: Any  # ctypes uint8 array: kept as is, so restoring needs no copy
    conversation: str | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the serialized state."""
        return len(self.data)


def capture(ctx: Any, seq_id: int, tokens: np.ndarray, conversation: str | None, limit: int) -> Parked | None:
    """Serialize sequence ``seq_id``; None when its state is larger than ``limit`` or the copy fails."""
    size = int(llama_cpp.llama_state_seq_get_size(ctx, seq_id))
    if size <= 0 or size > limit:
        return None
    buf = (ctypes.c_uint8 * size)()
    if int(llama_cpp.llama_state_seq_get_data(ctx, buf, size, seq_id)) != size:
        return None
    return Parked(tokens=tokens.copy(), data=buf, conversation=conversation)


def restore(ctx: Any, seq_id: int, entry: Parked) -> bool:
    """Load a parked state into the (empty) sequence ``seq_id``; False when llama.cpp refuses it."""
    return int(llama_cpp.llama_state_seq_set_data(ctx, entry.data, entry.nbytes, seq_id)) > 0


class ParkingLot:
    """Parked states, least recently used first, holding at most ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = max(0, int(limit))
        self._entries: OrderedDict[int, Parked] = OrderedDict()
        self._next = 0
        self.bytes = 0
        self.hits = 0
        self.evictions = 0
        self.parked = 0

    def __len__(self) -> int:
        return len(self._entries)

    def best(self, prompt: np.ndarray) -> tuple[int, int | None]:
        """The parked state sharing the longest prefix with ``prompt``: (common length, key or None)."""
        best_n, best_key = 0, None
        for key, entry in self._entries.items():
            n = common_prefix(entry.tokens, prompt)
            if n > best_n:
                best_n, best_key = n, key
        return best_n, best_key

    def covers(self, tokens: np.ndarray) -> bool:
        """True when a parked state already holds ``tokens`` (or a longer version of them): parking them again would
        copy a whole state only to drop it."""
        return any(len(e.tokens) >= len(tokens) and common_prefix(e.tokens, tokens) == len(tokens)
                   for e in self._entries.values())

    def put(self, entry: Parked) -> bool:
        """Park ``entry``; a state that extends a parked one replaces it. False when it was not kept."""
        if entry.nbytes > self.limit:
            return False
        for key, old in list(self._entries.items()):
            n = common_prefix(old.tokens, entry.tokens)
            if n == len(entry.tokens):
                self._entries.move_to_end(key)  # already parked (or a longer version of it is)
                return False
            if n == len(old.tokens):
                self._drop(key)
        while self.bytes + entry.nbytes > self.limit and self._entries:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        self._entries[self._next] = entry
        self._next += 1
        self.bytes += entry.nbytes
        self.parked += 1
        return True

    def take(self, key: int) -> Parked:
        """Remove and return the entry under ``key`` (to restore it)."""
        self.hits += 1
        entry = self._entries[key]
        self._drop(key)
        return entry

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes

    def clear(self) -> None:
        """Forget every parked state."""
        self._entries.clear()
        self.bytes = 0

    def stats(self) -> dict[str, int]:
        """Counters for serve_stats."""
        return {"count": len(self._entries), "bytes": self.bytes, "limit": self.limit, "hits": self.hits,
                "evictions": self.evictions, "parked_total": self.parked}
