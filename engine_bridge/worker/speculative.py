"""Greedy speculative decoding in the worker: a draft proposes tokens, the loaded model verifies them.

The draft is a model sharing the target's vocabulary (:class:`ModelDrafter`) or prompt lookup
(:class:`NgramDrafter`, :func:`artifacts.drafting.ngram_proposals`). Each step the model drafter decodes
up to ``n_draft`` tokens greedily after the last accepted one (prompt lookup copies what followed the context's
last tokens the last time they appeared); the target then
evaluates the last token and the proposals in one batch with an output row per position, keeps the proposals
up to the first one that is not its own greedy choice, and adds its own token there. Both KV caches are cut back
to what was kept. The output is the target's greedy continuation, token for token: a proposal is kept only where
it is the token the target would have chosen (a test on twins checks the two agree). What drafting gains is
the target's single-token steps replaced by one batched verification per step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import llama_cpp
import numpy as np

from artifacts.drafting import ngram_proposals
from engine_bridge import ops
from engine_bridge.errors import EngineError
from engine_bridge.worker.load import SmallBatchThreads
from engine_bridge.worker.native import NativeModel


def _cut(m: NativeModel, keep: int) -> None:
    """Forget ``m``'s cache cells from position ``keep`` on."""
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(m.ctx), 0, keep, -1)


def _argmax(m: NativeModel, i: int = -1) -> int:
    return int(np.argmax(m._logits(i)))


class Drafter(Protocol):
    """Proposes tokens for one greedy run of the target."""

    def start(self, prompt: Sequence[int]) -> None:
        """A new run after ``prompt``."""

    def propose(self, history: list[int], pos: int, k: int) -> list[int]:
        """Up to ``k`` tokens after ``history`` (prompt and output; its last token goes at ``pos``)."""

    def keep(self, proposals: list[int], n_ok: int, pos: int) -> None:
        """The first ``n_ok`` of ``proposals`` (after the token at ``pos``) were accepted."""


class ModelDrafter:
    """A draft model's greedy tokens; its cache follows what the target kept."""

    def __init__(self, target: NativeModel, draft: NativeModel) -> None:
        if target.n_vocab != draft.n_vocab:
            raise EngineError("bad_request", f"the draft's vocabulary has {draft.n_vocab} tokens, the model's "
                                             f"{target.n_vocab}: a draft must share the model's tokenizer")
        self.draft = draft

    def start(self, prompt: Sequence[int]) -> None:
        self.draft._clear()
        self.draft._decode(prompt, 0)

    def propose(self, history: list[int], pos: int, k: int) -> list[int]:
        proposals, d_tok = [], history[-1]
        for i in range(k):
            self.draft._decode([d_tok], pos + i)
            d_tok = _argmax(self.draft)
            proposals.append(d_tok)
        return proposals

    def keep(self, proposals: list[int], n_ok: int, pos: int) -> None:
        if proposals and n_ok == len(proposals):  # the draft never evaluated its last proposal
            self.draft._decode([proposals[-1]], pos + len(proposals))
        _cut(self.draft, pos + n_ok + 1)


class NgramDrafter:
    """Prompt lookup: nothing to load, nothing cached."""

    def __init__(self, n: int) -> None:
        self.n = n

    def start(self, prompt: Sequence[int]) -> None:
        return None

    def propose(self, history: list[int], pos: int, k: int) -> list[int]:
        return ngram_proposals(history, self.n, k)

    def keep(self, proposals: list[int], n_ok: int, pos: int) -> None:
        return None


def _first_eog(target: NativeModel, tokens: list[int]) -> int | None:
    return next((j for j, t in enumerate(tokens) if target.vocab.is_eog(t)), None)


def speculative_greedy(target: NativeModel, drafter: Drafter, prompt: Sequence[int], n_gen: int,
                       n_draft: int, stop_eog: bool = False) -> ops.SpecGreedyResult:
    """``n_gen`` greedy tokens of ``target`` after ``prompt``, drafted ``n_draft`` at a time by ``drafter``.

    Raises:
        EngineError: the run does not fit a context or a batch.
    """
    n_ctx = min(target.n_ctx, drafter.draft.n_ctx) if isinstance(drafter, ModelDrafter) else target.n_ctx
    if len(prompt) + n_gen - 1 > n_ctx or n_draft + 1 > target.n_batch:  # the last token needs no cell
        raise EngineError("context_overflow", f"{len(prompt)} + {n_gen} tokens (drafted {n_draft} at a time) do not "
                                              f"fit n_ctx {n_ctx} / n_batch {target.n_batch}")
    target._clear()
    threads = SmallBatchThreads(target.ctx, target.params.n_threads, target.params.n_threads_batch)
    t0 = time.perf_counter()
    target._decode(prompt, 0)
    drafter.start(prompt)
    tok = _argmax(target)
    t1 = time.perf_counter()
    threads.use(prompt=False)  # the verifications are small batches: the decode thread count
    try:
        return _verify_loop(target, drafter, prompt, tok, n_gen, n_draft, n_ctx, stop_eog, t0, t1)
    finally:
        threads.use(prompt=True)


def _verify_loop(target: NativeModel, drafter: Drafter, prompt: Sequence[int], tok: int, n_gen: int, n_draft: int,
                 n_ctx: int, stop_eog: bool, t0: float, t1: float) -> ops.SpecGreedyResult:
    """The drafting loop of :func:`speculative_greedy` after the prompt (``tok``: the first greedy token)."""
    history = [int(t) for t in prompt]
    out, pos = [tok], len(prompt)  # pos: where `tok` goes in both caches
    drafted = accepted = steps = 0
    while len(out) < n_gen and not (stop_eog and target.vocab.is_eog(tok)):
        # proposals stop at the context's end: the verification writes positions pos..pos+k
        proposals = drafter.propose(history + out, pos, min(n_draft, n_gen - len(out), n_ctx - 1 - pos))
        k = len(proposals)
        target._decode([tok, *proposals], pos, all_logits=True)
        choices = [_argmax(target, i) for i in range(k + 1)]
        n_ok = 0
        while n_ok < k and choices[n_ok] == proposals[n_ok]:
            n_ok += 1
        kept = [*proposals[:n_ok], choices[n_ok]]
        _cut(target, pos + n_ok + 1)  # tok and the accepted proposals stay
        drafter.keep(proposals, n_ok, pos)
        drafted, accepted, steps = drafted + k, accepted + n_ok, steps + 1
        if stop_eog and (end := _first_eog(target, kept)) is not None:
            kept = kept[:end + 1]
        out.extend(kept)
        pos += n_ok + 1
        tok = out[-1]
    tokens = out[:n_gen]
    if stop_eog and (end := _first_eog(target, tokens)) is not None:
        tokens = tokens[:end]
    return ops.SpecGreedyResult(tokens=tokens, drafted=drafted, accepted=accepted, steps=steps,
                                prompt_ms=(t1 - t0) * 1e3, gen_ms=(time.perf_counter() - t1) * 1e3)
