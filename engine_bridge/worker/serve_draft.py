"""Drafting for the serving engine: proposals for its greedy requests, verified in the engine's own batch.

A greedy request (temperature 0, no penalties, no grammar) that is decoding feeds, instead of its one next
token, that token and the draft's proposals, with an output row per position; the engine keeps the proposals
up to the first one that is not the target's own greedy choice, plus that choice (:mod:`.serving`), so its
output is what plain decoding gives. Sampled requests decode as before.

Two drafters: prompt lookup (:class:`NgramDrafter`, nothing loaded) and a draft model (:class:`ModelDrafter`:
a second model and context with a sequence per slot, whose cache catches up lazily with the tokens the
target's slot holds: the common prefix is kept, the rest is decoded when the slot next drafts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import llama_cpp
import numpy as np

from artifacts.drafting import Drafting, draft_params, ngram_proposals
from artifacts.engine_params import EngineParams
from engine_bridge.errors import EngineError
from engine_bridge.ops import GenerateArgs
from engine_bridge.worker.load import SeqBatch, keep_prefix, load_model_and_context
from engine_bridge.worker.parking import common_prefix

Want = tuple[int, list[int], int]  # (sequence, its tokens with the next one last, proposals wanted)


class ServeDrafter(Protocol):
    """Proposes tokens for the engine's drafting requests, all of one step at once."""

    n_draft: int

    def propose(self, wants: list[Want]) -> list[list[int]]:
        """Proposals for each ``(seq, history, k)``: at most ``k`` tokens after ``history``."""

    def close(self) -> None:
        """Free what the drafter loaded."""


def drafts(args: GenerateArgs) -> bool:
    """True when a request may be drafted: its output is the target's argmax at every step."""
    return args.sampling.greedy() and args.grammar is None


class NgramDrafter:
    """Prompt lookup over the slot's own tokens."""

    def __init__(self, d: Drafting) -> None:
        self.n, self.n_draft = d.ngram, d.n_draft

    def propose(self, wants: list[Want]) -> list[list[int]]:
        return [ngram_proposals(hist, self.n, k) for _, hist, k in wants]

    def close(self) -> None:
        return None


class ModelDrafter:
    """A draft model in its own context, one sequence per slot of the target's."""

    def __init__(self, d: Drafting, target: EngineParams, n_vocab: int) -> None:
        if d.model is None or not Path(d.model).is_file():
            raise EngineError("model_missing", f"the plan's draft model {d.model} is not a file")
        self.params = draft_params(target)
        self.model, self.ctx, self._keep = load_model_and_context(Path(d.model), self.params)
        got = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model)))
        if got != n_vocab:
            self.close()
            raise EngineError("bad_request", f"the draft's vocabulary has {got} tokens, the model's {n_vocab}: "
                                             "a draft must share the model's tokenizer")
        self.n_vocab, self.n_draft = n_vocab, d.n_draft
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.held: dict[int, list[int]] = {}  # per sequence: the tokens whose KV the draft holds
        self._batch = SeqBatch(self.params.n_batch, self.params.n_seq_max)

    def _decode(self) -> None:
        self._batch.raw.n_tokens = self._batch.n
        rc = llama_cpp.llama_decode(self.ctx, self._batch.raw)
        if rc != 0:
            raise EngineError("decode_failed", f"the draft's llama_decode returned {rc} for {self._batch.n} tokens")

    def _argmax(self, idx: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx),
                                                   shape=(self.n_vocab,))))

    def _catch_up(self, seq: int, hist: list[int]) -> int:
        """Bring ``seq``'s cache to ``hist`` (its common prefix kept); the draft's token after it."""
        held = self.held.get(seq, [])
        keep = min(common_prefix(np.asarray(held, np.int32), np.asarray(hist, np.int32)), len(hist) - 1)
        if keep < len(held) and not keep_prefix(self.ctx, seq, keep):
            keep = 0
            llama_cpp.llama_memory_seq_rm(self.mem, seq, -1, -1)
        b, n_batch = self._batch, self.params.n_batch
        last = 0
        for start in range(keep, len(hist), n_batch):
            b.n = 0
            part = hist[start:start + n_batch]
            last = b.add(seq, start, part, want_logits=start + len(part) == len(hist))
            self._decode()
        self.held[seq] = list(hist)
        return self._argmax(last)

    def propose(self, wants: list[Want]) -> list[list[int]]:
        out = [[self._catch_up(seq, hist)] if k > 0 else [] for seq, hist, k in wants]
        b = self._batch
        while True:
            going = [(i, w) for i, w in enumerate(wants) if len(out[i]) < w[2]]
            if not going:
                return out
            b.n = 0
            rows = []
            for i, (seq, _, _) in going:
                held = self.held[seq]
                rows.append((i, b.add(seq, len(held), [out[i][-1]], want_logits=True)))
                held.append(out[i][-1])
            self._decode()
            for i, row in rows:
                out[i].append(self._argmax(row))

    def close(self) -> None:
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None
        self._keep.clear()


def make_drafter(d: Drafting, target: EngineParams, n_vocab: int) -> ServeDrafter:
    """The drafter of a plan's drafting settings."""
    return ModelDrafter(d, target, n_vocab) if d.kind == "model" else NgramDrafter(d)


def with_drafts(drafter: ServeDrafter, entries: list[tuple[int, list[int], GenerateArgs, int, list[int]]],
                n_batch: int) -> dict[int, list[int]]:
    """Proposals by sequence for the decode entries ``(seq, its cached tokens, args, tokens generated, [next
    token])`` that draft: greedy ones, each no more than its reply has room for, all within the batch."""
    room = n_batch - len(entries)
    wants: list[Want] = []
    for seq, tokens, args, generated, chunk in entries:
        k = min(drafter.n_draft, args.max_tokens - generated - 1, room)
        if k > 0 and drafts(args):
            wants.append((seq, [*tokens, *chunk], k))
            room -= k
    if not wants:
        return {}
    return {seq: p for (seq, _, _), p in zip(wants, drafter.propose(wants), strict=True) if p}


def all_rows(batch: SeqBatch, first: int, last: int) -> None:
    """Ask for an output row at every batch position ``first..last``."""
    batch.logits[first:last + 1] = 1


def verify_row(ctx: Any, idx: int, n_vocab: int) -> int:
    """The target's greedy token at batch output ``idx``."""
    return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, idx), shape=(n_vocab,))))
