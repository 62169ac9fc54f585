"""Greedy speculative decoding in the worker: a draft model proposes tokens, the loaded model verifies them.

Each step the draft decodes up to ``n_draft`` tokens greedily after the last accepted one; the target then
evaluates the last token and the proposals in one batch with an output row per position, keeps the proposals
up to the first one that is not its own greedy choice, and adds its own token there. Both KV caches are cut back
to what was kept. The output is the target's greedy continuation, token for token: a proposal is kept only where
it is the token the target would have chosen (a test on twins checks the two agree). What drafting gains is
the target's single-token steps replaced by one batched verification per step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import llama_cpp
import numpy as np

from engine_bridge import ops
from engine_bridge.errors import EngineError
from engine_bridge.worker.native import NativeModel


def _cut(m: NativeModel, keep: int) -> None:
    """Forget ``m``'s cache cells from position ``keep`` on."""
    llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(m.ctx), 0, keep, -1)


def _argmax(m: NativeModel, i: int = -1) -> int:
    return int(np.argmax(m._logits(i)))


def speculative_greedy(target: NativeModel, draft: NativeModel, prompt: Sequence[int], n_gen: int,
                       n_draft: int, stop_eog: bool = False) -> ops.SpecGreedyResult:
    """``n_gen`` greedy tokens of ``target`` after ``prompt``, drafted ``n_draft`` at a time by ``draft``.

    Raises:
        EngineError: the two models' vocabularies differ, or the run does not fit a context or a batch.
    """
    if target.n_vocab != draft.n_vocab:
        raise EngineError("bad_request", f"the draft's vocabulary has {draft.n_vocab} tokens, the model's "
                                         f"{target.n_vocab}: a draft must share the model's tokenizer")
    need = len(prompt) + n_gen + n_draft + 1
    if need > min(target.n_ctx, draft.n_ctx) or n_draft + 1 > target.n_batch:
        raise EngineError("context_overflow", f"{len(prompt)} + {n_gen} tokens (+{n_draft} drafted) do not fit "
                                              f"n_ctx {min(target.n_ctx, draft.n_ctx)} / n_batch {target.n_batch}")
    target._clear()
    draft._clear()
    t0 = time.perf_counter()
    target._decode(prompt, 0)
    draft._decode(prompt, 0)
    tok = _argmax(target)
    t1 = time.perf_counter()
    out, pos = [tok], len(prompt)  # pos: where `tok` goes in both caches
    drafted = accepted = steps = 0
    while len(out) < n_gen and not (stop_eog and target.vocab.is_eog(tok)):
        k = min(n_draft, n_gen - len(out))
        proposals, d_tok = [], tok
        for i in range(k):
            draft._decode([d_tok], pos + i)
            d_tok = _argmax(draft)
            proposals.append(d_tok)
        target._decode([tok, *proposals], pos, all_logits=True)
        choices = [_argmax(target, i) for i in range(k + 1)]
        n_ok = 0
        while n_ok < k and choices[n_ok] == proposals[n_ok]:
            n_ok += 1
        kept = [*proposals[:n_ok], choices[n_ok]]
        _cut(target, pos + n_ok + 1)  # tok and the accepted proposals stay
        if n_ok == k:  # the draft never evaluated its last proposal
            draft._decode([proposals[-1]], pos + k)
        _cut(draft, pos + n_ok + 1)
        drafted, accepted, steps = drafted + k, accepted + n_ok, steps + 1
        if stop_eog:
            end = next((j for j, t in enumerate(kept) if target.vocab.is_eog(t)), None)
            kept = kept if end is None else kept[:end + 1]
        out.extend(kept)
        pos += n_ok + 1
        tok = out[-1]
    tokens = out[:n_gen]
    if stop_eog:
        end = next((j for j, t in enumerate(tokens) if target.vocab.is_eog(t)), None)
        tokens = tokens if end is None else tokens[:end]
    return ops.SpecGreedyResult(tokens=tokens, drafted=drafted, accepted=accepted, steps=steps, prompt_ms=(t1 - t0) * 1e3,
                   gen_ms=(time.perf_counter() - t1) * 1e3)
