"""The serving engine: continuous batching of several sequences in ONE llama.cpp context.

Each of ``n_seq_max`` sequence slots holds up to ``n_ctx`` tokens of KV (``kv_unified=False``). Every
:meth:`ServeEngine.step` is one ``llama_decode`` whose batch carries, for each running request, either
its next prompt chunk (prefill; chunks share ``n_batch`` tokens fairly) or its one next token (decode).
Then each request whose logits came back samples through its own llama.cpp sampler chain and streams
the token to the :class:`Sink`. A slot keeps the KV of a finished request: a later prompt that starts
with the same tokens reuses it, and costs only its new tokens (at least its last one, whose logits give the
first token); a prompt that replaces a conversation parks the old state in RAM
(:mod:`engine_bridge.worker.parking`) so a return to it skips the prefix. A prompt that keeps the slot's last
prompt (the same prompt again, the conversation's next turn) trims the old reply without parking it: parking
copies the whole state, which would cost a long conversation hundreds of milliseconds before its first token. With a
plan's drafting settings, a greedy request's decode step feeds its token and a draft's proposals and keeps what
the model itself would have chosen (:mod:`engine_bridge.worker.serve_draft`).

Runs inside the worker process, on one thread (the worker's main loop); nothing here is thread-safe.
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from pydantic import ValidationError

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from engine_bridge import ops
from engine_bridge.errors import EngineCode, EngineError
from engine_bridge.ops import GenerateArgs
from engine_bridge.worker.checkpoints import Checkpoints, needs_checkpoints, split_last
from engine_bridge.worker.grammar import GrammarSampler
from engine_bridge.worker.load import SeqBatch, SmallBatchThreads, keep_prefix, load_model_and_context
from engine_bridge.worker.parking import ParkingLot, capture, common_prefix, restore
from engine_bridge.worker.sampling import Vocab, build_chain, log_softmax, token_logprobs
from engine_bridge.worker.sequences import (
    MIN_PARK_TOKENS,
    FinishReason,
    Sink,
    Tokens,
    _Request,
    _Slot,
)
from engine_bridge.worker.serve_draft import (
    ServeDrafter,
    all_rows,
    drafts,
    make_drafter,
    verify_row,
    with_drafts,
)
from engine_bridge.worker.serve_routing import ServeRoutingCounter

log = logging.getLogger(__name__)

class ServeEngine:
    """One model, one context, ``n_seq_max`` sequence slots, continuous batching."""

    def __init__(self, model_path: Path, params: EngineParams, park_bytes: int, sink: Sink,
                 drafting: Drafting | None = None, routing: ServeRoutingCounter | None = None) -> None:
        t0 = time.perf_counter()
        self.params, self.sink, self.routing = params, sink, routing
        self.model, self.ctx, self._keep = load_model_and_context(
            model_path, params, routing.callback if routing is not None else None)
        if routing is not None:
            routing.loaded(self.model, params)
        self._threads = SmallBatchThreads(self.ctx, params.n_threads, params.n_threads_batch)
        self.load_ms = (time.perf_counter() - t0) * 1e3
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = Vocab(llama_cpp.llama_model_get_vocab(self.model))
        self.max_token_bytes = self.vocab.longest_token_bytes()
        GrammarSampler.warm_up(self.vocab)
        self.n_ctx, self.n_seq_max, self.n_batch = params.n_ctx, params.n_seq_max, params.n_batch
        self.slots = [_Slot(seq=i) for i in range(self.n_seq_max)]
        self.lot = ParkingLot(park_bytes)
        # a hybrid/recurrent model rewinds through checkpoints of its recurrent state (a quarter of the parking budget)
        self.checkpoints = Checkpoints(self.ctx, park_bytes // 4) if needs_checkpoints(self.model) else None
        self._batch = SeqBatch(self.n_batch, self.n_seq_max)
        self._clock = itertools.count(1)
        self._by_rid: dict[str, _Slot] = {}
        self.counters = {"tokens_generated": 0, "prefix_hits": 0, "steps": 0, "max_batch_seqs": 0,
                         "prefill_tokens": 0, "cached_tokens": 0, "drafted": 0, "draft_accepted": 0}
        self.drafter: ServeDrafter | None = None
        self._proposed: dict[int, list[int]] = {}  # this step's proposals, by sequence
        if drafting is not None:
            try:
                self.drafter = make_drafter(drafting, params, self.vocab.n_vocab)
            except EngineError:
                self.close()
                raise

    def info(self) -> dict[str, Any]:
        """What ``serve_load`` reports."""
        v = self.vocab.ptr
        return {"n_ctx": self.n_ctx, "n_seq_max": self.n_seq_max, "n_vocab": self.vocab.n_vocab,
                "n_ctx_seq_cells": int(llama_cpp.llama_n_ctx_seq(self.ctx)), "load_ms": self.load_ms,
                "model_bytes": int(llama_cpp.llama_model_size(self.model)), "park_bytes": self.lot.limit,
                "bos": int(llama_cpp.llama_vocab_bos(v)), "eos": int(llama_cpp.llama_vocab_eos(v)),
                "eot": int(llama_cpp.llama_vocab_eot(v)), "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(v)),
                "max_token_bytes": self.max_token_bytes}

    # -- admission ------------------------------------------------------------------------------------
    def submit(self, key: int, raw: GenerateArgs | dict[str, Any]) -> None:
        """Admit a ``generate`` request into a free sequence; its output goes to the sink under ``key``.

        Raises:
            EngineError: ``bad_request`` (invalid fields or token ids, a running rid), ``context_overflow``
                (prompt + max_tokens > n_ctx), ``busy`` (every sequence is running a request),
                ``bad_grammar`` (llama.cpp refused the grammar).
        """
        t0 = time.perf_counter()
        args, prompt = self._validate(raw)
        free = [s for s in self.slots if s.req is None]
        if not free:
            raise EngineError("busy", f"all {self.n_seq_max} sequences are generating: retry when one finishes")
        grammar = GrammarSampler(self.vocab, args.grammar) if args.grammar is not None else None
        slot, cached = self._place(prompt, free)
        slot.req = _Request(key=key, args=args, chain=build_chain(args.sampling, self.vocab.n_vocab, args.max_tokens),
                            pending=args.prompt[cached:], cached=cached, grammar=grammar, t0=t0)
        slot.last_used, slot.conversation, slot.prompt_n = next(self._clock), args.conversation, len(prompt)
        self._by_rid[args.rid] = slot
        self.counters["prefix_hits"] += cached > 0
        self.counters["cached_tokens"] += cached

    def _validate(self, raw: GenerateArgs | dict[str, Any]) -> tuple[GenerateArgs, np.ndarray]:
        """The arguments, and the prompt as an int32 array (its ids checked against the vocabulary at once)."""
        try:
            args = raw if isinstance(raw, GenerateArgs) else GenerateArgs.model_validate(raw)
        except ValidationError as exc:
            raise EngineError("bad_request", f"invalid generate arguments: {exc}") from exc
        if args.rid in self._by_rid:
            raise EngineError("bad_request", f"request id {args.rid!r} is already generating")
        if len(args.prompt) + args.max_tokens > self.n_ctx:
            raise EngineError("context_overflow", f"{len(args.prompt)} prompt tokens + max_tokens "
                              f"{args.max_tokens} exceed the context of {self.n_ctx} tokens per sequence")
        out_of_range = EngineError("bad_request", f"token ids out of range 0..{self.vocab.n_vocab - 1}")
        try:
            ids = np.asarray(args.prompt, dtype=np.int64)  # int64: an id past int32 is refused, not wrapped
        except OverflowError:
            raise out_of_range from None
        bad = ids[(ids < 0) | (ids >= self.vocab.n_vocab)]
        if len(bad):
            raise EngineError("bad_request", f"{out_of_range.message}: {bad[:5].tolist()}")
        return args, ids.astype(np.int32)

    def _place(self, prompt: np.ndarray, free: list[_Slot]) -> tuple[_Slot, int]:
        """Pick a free slot for ``prompt``: reuse a cached prefix, else restore a parked one, else a cold slot.

        A slot whose cache only partly matches is reused when the match is worth it (MIN_PARK_TOKENS or
        more) or when little would be dropped; what is dropped is parked first (see ``_truncate``).
        """
        cap = len(prompt) - 1  # the last prompt token is always decoded: its logits give the first token
        slot_n, best = 0, None
        for s in sorted(free, key=lambda s: -s.last_used):
            n = min(common_prefix(s.tokens.array, prompt), cap)
            if n > slot_n and (n >= MIN_PARK_TOKENS or len(s.tokens) - n < MIN_PARK_TOKENS):
                slot_n, best = n, s
        park_n, park_key = self.lot.best(prompt)
        park_n = min(park_n, cap)
        # a restore copies the whole parked state in (and may park a victim): only for tokens worth it
        if park_key is not None and park_n >= slot_n + MIN_PARK_TOKENS:
            return self._restore(free, park_key, park_n)
        if best is not None:
            return best, self._truncate(best, slot_n)
        target = self._victim(free)
        return target, self._truncate(target, 0)

    def _restore(self, free: list[_Slot], key: int, n: int) -> tuple[_Slot, int]:
        """Restore the parked state ``key`` into a free slot and keep its first ``n`` tokens."""
        entry = self.lot.take(key)  # out of the lot first: parking the victim below must not evict it
        target = self._victim(free)
        self._truncate(target, 0)
        if n < len(entry.tokens):
            self.lot.put(entry)  # only part of it is reused: the whole state stays parked
        if not restore(self.ctx, target.seq, entry):
            log.warning("restoring a parked state into sequence %d failed; prefilling from scratch", target.seq)
            llama_cpp.llama_memory_seq_rm(self.mem, target.seq, -1, -1)
            return target, 0
        target.tokens = Tokens(entry.tokens)
        target.conversation = entry.conversation
        return target, self._truncate(target, n, park=False)

    def _victim(self, free: list[_Slot]) -> _Slot:
        """The free slot to overwrite: an empty one (lowest id keeps batches contiguous), else the LRU one."""
        empty = [s for s in free if not s.tokens]
        return empty[0] if empty else min(free, key=lambda s: s.last_used)

    def _truncate(self, slot: _Slot, keep: int, park: bool = True) -> int:
        """Keep the first ``keep`` cached tokens of ``slot``, parking the whole state first if it is worth it."""
        if park and self._worth_parking(slot, keep):
            entry = capture(self.ctx, slot.seq, slot.tokens.array, slot.conversation, self.lot.limit)
            if entry is not None:
                self.lot.put(entry)
        if keep < len(slot.tokens) and not keep_prefix(self.ctx, slot.seq, keep):
            # a partial removal can fail (recurrent state: rewound to a checkpoint; a window model's lost window)
            keep = self.checkpoints.rewind(slot.seq, keep) if self.checkpoints is not None else 0
            if keep == 0:
                llama_cpp.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
        elif self.checkpoints is not None:
            self.checkpoints.forget(slot.seq, keep)
        slot.tokens.truncate(keep)
        return keep

    def _worth_parking(self, slot: _Slot, keep: int) -> bool:
        """Park ``slot`` before it keeps only ``keep`` tokens: when it drops MIN_PARK_TOKENS or more, the new prompt
        leaves the slot's last prompt (not the same conversation going on: see sequences.py), and no parked state
        already holds it."""
        return (len(slot.tokens) - keep >= MIN_PARK_TOKENS and keep < slot.prompt_n - MIN_PARK_TOKENS
                and not self.lot.covers(slot.tokens.array))

    # -- stepping -------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """True while some request is running."""
        return any(s.req is not None for s in self.slots)

    def _plan(self) -> list[tuple[_Slot, _Request, list[int]]]:
        """What each running request feeds this step: decode tokens first, then prompt chunks sharing the rest."""
        running = [(s, s.req) for s in self.slots if s.req is not None]
        plan = [(s, r, r.pending[:1]) for s, r in running if r.t_first is not None][:self.n_batch]
        plan = self._draft(plan)
        budget = self.n_batch - sum(len(c) for _, _, c in plan)
        prefilling = sorted(((s, r) for s, r in running if r.t_first is None), key=lambda t: len(t[1].pending))
        for i, (s, r) in enumerate(prefilling):
            chunk = r.pending[:budget // (len(prefilling) - i)]  # shortest first: what they leave flows on
            if self.checkpoints is not None:
                chunk = split_last(chunk, len(r.pending))
            if chunk:
                plan.append((s, r, chunk))
                budget -= len(chunk)
        return sorted(plan, key=lambda t: t[0].seq)  # llama.cpp forms ubatches from increasing seq ids

    def _draft(self, plan: list[tuple[_Slot, _Request, list[int]]]) -> list[tuple[_Slot, _Request, list[int]]]:
        """The decode entries with their drafts (:func:`~engine_bridge.worker.serve_draft.with_drafts`)."""
        self._proposed = {}
        if self.drafter is None:
            return plan
        try:
            self._proposed = with_drafts(self.drafter, [(s.seq, s.tokens.tolist(), r.args, r.generated, c)
                                                        for s, r, c in plan],
                                         self.n_batch)
        except EngineError as exc:  # a draft that fails costs its speed-up, not the requests
            log.error("drafting failed, decoding without it: %s", exc)
            self.drafter.close()
            self.drafter = None
        return [(s, r, [*c, *self._proposed.get(s.seq, [])]) for s, r, c in plan]

    def step(self) -> None:
        """One llama_decode over every running request, then sampling and streaming."""
        plan = self._plan()
        if not plan:
            return
        b = self._batch
        b.n = 0
        outputs: list[tuple[_Slot, int]] = []
        verify: list[tuple[_Slot, int]] = []
        self._threads.use(prompt=any(req.t_first is None for _, req, _ in plan))  # a prompt chunk in the step
        for slot, req, chunk in plan:
            if slot.seq in self._proposed:
                last = b.add(slot.seq, len(slot.tokens), chunk, want_logits=True)
                all_rows(b, last + 1 - len(chunk), last)
                verify.append((slot, last + 1 - len(chunk)))
                continue
            complete = len(chunk) == len(req.pending)  # the whole prompt is in: logits give the next token
            last = b.add(slot.seq, len(slot.tokens), chunk, want_logits=complete)
            if complete:
                outputs.append((slot, last))
        b.raw.n_tokens = b.n
        if self.routing is not None:  # a step of decode tokens alone may be counted (serve_routing.py)
            self.routing.before(all(req.t_first is not None for _, req, _ in plan), b.n)
        rc = llama_cpp.llama_decode(self.ctx, b.raw)
        if self.routing is not None:
            self.routing.after(rc == 0)
        if rc != 0:
            self._abort([s for s, _, _ in plan], "decode_failed", f"llama_decode returned {rc} for {b.n} tokens")
            return
        self.counters["steps"] += 1
        self.counters["max_batch_seqs"] = max(self.counters["max_batch_seqs"], len(plan))
        for slot, req, chunk in plan:
            if slot.seq in self._proposed:
                continue
            slot.tokens.extend(chunk)
            del req.pending[:len(chunk)]
            if req.t_first is None:
                self.counters["prefill_tokens"] += len(chunk)
                if self.checkpoints is not None:
                    self.checkpoints.after_prefill(slot.seq, len(slot.tokens), len(chunk), len(req.pending))
                if req.args.progress and req.pending:
                    total = len(req.args.prompt)
                    self.sink.event(req.key, {"type": "prefill", "done": total - len(req.pending), "total": total})
        for slot, idx in outputs:
            self._sample(slot, idx)
        for slot, first in verify:
            self._verify(slot, first, self._proposed[slot.seq])

    def _verify(self, slot: _Slot, first: int, proposals: list[int]) -> None:
        """Keep ``proposals`` up to the first that is not the model's greedy token (rows from ``first``),
        stream the model's tokens, and forget the cache cells of the proposals it did not keep."""
        req = slot.req
        if req is None:
            return
        base, fed = len(slot.tokens), req.pending[0]
        n_ok = 0
        for i in range(len(proposals) + 1):
            tok = verify_row(self.ctx, first + i, self.vocab.n_vocab)
            live = self._emit(slot, first + i, tok)
            if not live or i == len(proposals) or tok != proposals[i]:
                break
            n_ok += 1
        llama_cpp.llama_memory_seq_rm(self.mem, slot.seq, base + n_ok + 1, -1)
        slot.tokens.extend([fed, *proposals[:n_ok]])
        self.counters["drafted"] += len(proposals)
        self.counters["draft_accepted"] += n_ok

    def _sample(self, slot: _Slot, idx: int) -> None:
        """Sample the next token of ``slot``'s request from batch output ``idx`` and stream it."""
        req = slot.req
        if req is None:
            return
        if req.t_first is None:
            req.t_first = time.perf_counter()
        if req.grammar is not None:
            tok = req.grammar.sample(req.chain, self.ctx, idx)
        elif drafts(req.args):  # greedy: the chain's choice is the logits' first maximum, found without the
            # chain's per-token copy of the whole vocabulary into candidates (what the measure stage times too)
            tok = int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, idx),
                                                      shape=(self.vocab.n_vocab,))))
        else:
            tok = int(llama_cpp.llama_sampler_sample(req.chain, self.ctx, idx))
        self._emit(slot, idx, tok)

    def _emit(self, slot: _Slot, idx: int, tok: int) -> bool:
        """Stream ``tok`` (chosen from batch output ``idx``) for ``slot``'s request; False once it finished."""
        req = slot.req
        if req is None:
            return False
        lp = None
        if req.args.logprobs:
            ptr = llama_cpp.llama_get_logits_ith(self.ctx, idx)
            lp = log_softmax(np.ctypeslib.as_array(ptr, shape=(self.vocab.n_vocab,)))
        if self.vocab.is_eog(tok):
            self._finish(slot, "stop")
            return False
        piece = self.vocab.piece(tok)
        event: ops.TokenEvent = {"type": "token", "token": tok, "text": req.decoder.decode(piece),
                                 "logprob": None, "top_logprobs": []}
        if lp is not None:
            event["logprob"], event["top_logprobs"] = token_logprobs(self.vocab, lp, tok, req.args.top_logprobs)
            event["bytes"] = list(piece)
        req.generated += 1
        self.counters["tokens_generated"] += 1
        self.sink.event(req.key, event)
        if req.generated >= req.args.max_tokens:
            self._finish(slot, "length")
            return False
        req.pending = [tok]
        return True

    def _release(self, slot: _Slot) -> _Request | None:
        """Detach the running request from ``slot`` (the slot keeps its KV) and free its sampler."""
        req = slot.req
        if req is None:
            return None
        slot.req = None
        slot.last_used = next(self._clock)
        self._by_rid.pop(req.args.rid, None)
        llama_cpp.llama_sampler_free(req.chain)
        if req.grammar is not None:
            req.grammar.close()
        return req

    def _finish(self, slot: _Slot, reason: FinishReason) -> None:
        req = self._release(slot)
        if req is None:
            return
        now = time.perf_counter()
        t_first = req.t_first if req.t_first is not None else now
        self.sink.done(req.key, {
            "finish_reason": reason, "prompt_tokens": len(req.args.prompt), "completion_tokens": req.generated,
            "cached_tokens": req.cached, "prefill_ms": (t_first - req.t0) * 1e3, "decode_ms": (now - t_first) * 1e3,
            "text_tail": req.decoder.decode(b"", final=True)})

    def _abort(self, slots: list[_Slot], code: EngineCode, message: str) -> None:
        """Fail the requests of ``slots`` and forget their KV (its content is no longer known)."""
        log.error("%s: %s", code, message)
        for slot in slots:
            req = self._release(slot)
            llama_cpp.llama_memory_seq_rm(self.mem, slot.seq, -1, -1)
            slot.tokens.truncate(0)
            if self.checkpoints is not None:
                self.checkpoints.forget(slot.seq)
            if req is not None:
                self.sink.fail(req.key, code, message)

    def fail_all(self, code: EngineCode, message: str) -> None:
        """Fail every running request (the engine hit an unexpected error)."""
        self._abort([s for s in self.slots if s.req is not None], code, message)

    # -- control --------------------------------------------------------------------------------------
    def cancel(self, rid: str) -> bool:
        """Finish request ``rid`` now with finish_reason "cancelled"; False when no such request runs.

        Its sequence is free at once. The KV it computed stays in the slot as a reusable prefix (a client
        that disconnected often retries the same prompt); the next prompt that needs the slot trims it or
        parks it like any finished conversation.
        """
        slot = self._by_rid.get(rid)
        if slot is None:
            return False
        self._finish(slot, "cancelled")
        return True

    def cancel_all(self) -> None:
        """Cancel every running request (shutdown)."""
        for slot in self.slots:
            if slot.req is not None:
                self._finish(slot, "cancelled")

    def stats(self) -> dict[str, Any]:
        """Counters and memory for ``serve_stats``."""
        kv = sum(int(llama_cpp.llama_state_seq_get_size(self.ctx, s.seq)) for s in self.slots if s.tokens)
        return {"n_ctx": self.n_ctx, "n_seq_max": self.n_seq_max, "active": sum(s.req is not None for s in self.slots),
                "queued": 0, **self.counters, "parked": self.lot.stats(), "kv_bytes": kv,
                **({**self.checkpoints.counters, "checkpoint_bytes": self.checkpoints.bytes}
                   if self.checkpoints is not None else {}),
                "slots": [{"seq": s.seq, "tokens": len(s.tokens), "busy": s.req is not None,
                           "conversation": s.conversation} for s in self.slots]}

    def close(self) -> None:
        """Free every request, the context and the model."""
        for slot in self.slots:
            self._release(slot)
        self.lot.clear()
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None
