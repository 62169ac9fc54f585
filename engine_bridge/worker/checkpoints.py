"""Recurrent-state checkpoints: how a hybrid or recurrent model reuses a cached prefix that the new prompt leaves.

A recurrent layer (qwen3next's and qwen35moe's gated delta-nets, Mamba) keeps one state per sequence, the summary
of every token so far, and cannot rewind it: llama.cpp refuses to cut such a sequence back to its first ``keep``
positions. So a turn that re-sends the conversation with the previous reply re-templated (a coding agent drops
the reply's thinking, or renders its tool calls otherwise) diverges inside the cached tokens, and without a
checkpoint the whole conversation is prefilled again (llama.cpp #25592: a 38.5k-token turn, 40.8 s).

This module keeps, per sequence, copies of the recurrent part of its state alone
(``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: the attention layers' KV is not copied; it can be cut back in place)
before the last token of every prompt and every :data:`INTERVAL` prompt tokens within a long one. A cut-back that
llama.cpp refuses restores the newest checkpoint at or before the cut (:meth:`Checkpoints.rewind`), cuts the
attention KV to it, and the request prefills only from there. The prompt-end checkpoint serves both reuses a
conversation makes: the same prompt again (which computes its last token again for the logits) and the next turn
with the last reply re-templated (the previous prompt is its prefix; the reply after it is what changed). The
serving engine feeds a prompt's last token in a step of its own to take it (:func:`split_last`).

Checkpoints are held within a byte budget (a share of the engine's parking budget); when a new one does not fit,
the oldest are dropped first and logged, never an error. A sequence's checkpoints past a cut, and all of them
when it is cleared or overwritten, are forgotten.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import llama_cpp

log = logging.getLogger(__name__)

INTERVAL = 4096  # prompt tokens between two checkpoints within one long prompt
PER_SEQUENCE = 8  # checkpoints kept per sequence (newest), as llama-server's --ctx-checkpoints default
_PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY


def needs_checkpoints(model: Any) -> bool:
    """True for a model with recurrent layers (hybrid or wholly recurrent), whose cache cannot be cut back."""
    return bool(llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model))


@dataclass
class Checkpoint:
    """The recurrent state of one sequence after its first ``n`` tokens."""

    seq: int
    n: int
    data: Any  # a ctypes uint8 array
    order: int  # creation order: the oldest is dropped first

    @property
    def nbytes(self) -> int:
        """Bytes of the copied state."""
        return len(self.data)


def split_last(chunk: list[int], pending: int) -> list[int]:
    """A prompt chunk that would feed the last of ``pending`` prompt tokens with others stops before it: the
    checkpoint before the prompt's last token is taken between the two steps."""
    return chunk[:-1] if 1 < len(chunk) == pending else chunk


class Checkpoints:
    """Every sequence's checkpoints, within ``limit`` bytes together."""

    def __init__(self, ctx: Any, limit: int) -> None:
        self.ctx, self.limit = ctx, limit
        self._by_seq: dict[int, list[Checkpoint]] = {}
        self._clock = itertools.count()
        self.bytes = 0
        self.counters = {"checkpoints_taken": 0, "checkpoints_dropped": 0, "checkpoint_restores": 0,
                         "checkpoint_tokens_reused": 0}

    def of(self, seq: int) -> list[Checkpoint]:
        """``seq``'s checkpoints, by increasing ``n``."""
        return list(self._by_seq.get(seq, ()))

    def after_prefill(self, seq: int, n: int, chunk: int, left: int) -> None:
        """Called after a prompt chunk of ``chunk`` tokens took sequence ``seq`` to ``n`` tokens, ``left`` prompt
        tokens still to feed: take a checkpoint before the prompt's last token, or when the chunk crossed a multiple
        of :data:`INTERVAL`."""
        if chunk and (left == 1 or (n // INTERVAL) > ((n - chunk) // INTERVAL)):
            self.take(seq, n)

    def take(self, seq: int, n: int) -> Checkpoint | None:
        """Copy ``seq``'s recurrent state (it holds ``n`` tokens); None when it does not fit the budget at all or
        llama.cpp's copy fails."""
        size = int(llama_cpp.llama_state_seq_get_size_ext(self.ctx, seq, _PARTIAL))
        if size <= 0 or size > self.limit:
            if size > self.limit:
                log.info("a %d-byte recurrent checkpoint of sequence %d exceeds the %d-byte budget: not kept",
                         size, seq, self.limit)
            return None
        buf = (ctypes.c_uint8 * size)()
        if int(llama_cpp.llama_state_seq_get_data_ext(self.ctx, buf, size, seq, _PARTIAL)) != size:
            log.warning("copying the recurrent state of sequence %d failed: no checkpoint at %d tokens", seq, n)
            return None
        kept = [c for c in self._by_seq.get(seq, []) if c.n != n]  # the same position again: the newer copy
        self.bytes -= sum(c.nbytes for c in self._by_seq.get(seq, []) if c.n == n)
        cp = Checkpoint(seq=seq, n=n, data=buf, order=next(self._clock))
        kept.append(cp)
        kept.sort(key=lambda c: c.n)
        self._by_seq[seq] = kept
        self.bytes += size
        self.counters["checkpoints_taken"] += 1
        while len(self._by_seq[seq]) > PER_SEQUENCE:
            self._drop(min(self._by_seq[seq], key=lambda c: c.order), "the sequence keeps its newest "
                       f"{PER_SEQUENCE}")
        while self.bytes > self.limit:
            oldest = min((c for cps in self._by_seq.values() for c in cps), key=lambda c: c.order)
            self._drop(oldest, f"the checkpoints' {self.limit}-byte budget is full")
        return cp

    def _drop(self, cp: Checkpoint, why: str) -> None:
        self._by_seq[cp.seq].remove(cp)
        self.bytes -= cp.nbytes
        self.counters["checkpoints_dropped"] += 1
        log.info("dropped the recurrent checkpoint of sequence %d at %d tokens (%d bytes): %s",
                 cp.seq, cp.n, cp.nbytes, why)

    def forget(self, seq: int, past: int = 0) -> None:
        """Forget ``seq``'s checkpoints after its first ``past`` tokens (all of them: ``past`` 0)."""
        cps = self._by_seq.get(seq, [])
        gone = [c for c in cps if c.n > past]
        self.bytes -= sum(c.nbytes for c in gone)
        self._by_seq[seq] = [c for c in cps if c.n <= past]

    def rewind(self, seq: int, keep: int) -> int:
        """Bring sequence ``seq`` back to the newest checkpoint at or before ``keep`` tokens (its recurrent state
        restored, its attention KV cut there): the tokens it now holds, 0 when no checkpoint serves (the caller
        clears the sequence)."""
        for cp in reversed(self._by_seq.get(seq, [])):
            if cp.n > keep:
                continue
            try:
                ok = int(llama_cpp.llama_state_seq_set_data_ext(self.ctx, cp.data, cp.nbytes, seq, _PARTIAL)) > 0
            except RuntimeError:  # llama.cpp threw while reading it back (it clears the state first)
                ok = False
            mem = llama_cpp.llama_get_memory(self.ctx)
            if ok and llama_cpp.llama_memory_seq_rm(mem, seq, cp.n, -1):
                self.forget(seq, cp.n)
                self.counters["checkpoint_restores"] += 1
                self.counters["checkpoint_tokens_reused"] += cp.n
                return cp.n
            log.warning("restoring the recurrent checkpoint of sequence %d at %d tokens failed; prefilling "
                        "from scratch", seq, cp.n)
            break
        self.forget(seq)
        return 0
