"""The measuring engine: one model, one sequence, loaded through :func:`engine_bridge.worker.load.load_model_and_context`.

Runs inside the worker process. It is configured from :class:`~artifacts.engine_params.EngineParams` by the
same translation the serving engine uses, so a placement is measured exactly as it is served. Prefill and
decode are timed by the wall clock with the device synchronized; llama.cpp's own perf counters are kept
beside them. ``chat`` is llama-cpp-python's own chat completion (its template formatter and sampler), a
peer's behaviour that the conformance suite compares with llama-server's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from artifacts.engine_params import EngineParams
from engine_bridge.errors import EngineError
from engine_bridge.ops import Timing
from engine_bridge.worker.load import SeqBatch, load_model_and_context
from engine_bridge.worker.sampling import Vocab


class NativeModel:
    """One loaded model + context, configured from EngineParams."""

    def __init__(self, model_path: Path, params: EngineParams) -> None:
        self.params = params.model_copy(update={"n_seq_max": 1})
        self.path = model_path
        self.model, self.ctx, self._keep = load_model_and_context(model_path, self.params, perf=True)
        self.vocab = Vocab(llama_cpp.llama_model_get_vocab(self.model))
        self.n_vocab = self.vocab.n_vocab
        # what the plan asked for: llama.cpp pads its context up (to 256 cells), a sequence must not use that
        self.n_ctx = min(self.params.n_ctx, int(llama_cpp.llama_n_ctx(self.ctx)))
        self.n_batch = self.params.n_batch
        self._batch = SeqBatch(self.n_batch, 1)
        self._peer: Any = None
        self.drafts: dict[str, NativeModel] = {}  # draft models loaded for speculative runs, by path

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Tokens of ``text`` (no BOS added)."""
        return self.vocab.tokenize(text, special=special, add_special=False)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``."""
        return self.vocab.detokenize([int(t) for t in tokens])

    def _clear(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def _decode(self, tokens: Sequence[int], pos0: int, all_logits: bool = False) -> None:
        """Evaluate ``tokens`` from position ``pos0`` in batches of n_batch; logits of the last token (of every
        token with ``all_logits``, which must then fit one batch)."""
        b = self._batch
        for start in range(0, len(tokens), self.n_batch):
            part = [int(t) for t in tokens[start:start + self.n_batch]]
            b.n = 0
            b.add(0, pos0 + start, part, want_logits=True)
            if all_logits:
                b.logits[:b.n] = 1
            b.raw.n_tokens = b.n
            rc = llama_cpp.llama_decode(self.ctx, b.raw)
            if rc != 0:
                raise EngineError("decode_failed", f"llama_decode returned {rc} for {b.n} tokens")

    def _logits(self, i: int = -1) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))

    def timed_run(self, prompt: Sequence[int], n_gen: int) -> Timing:
        """Prefill ``prompt`` then decode ``n_gen`` greedy tokens, timed by the wall clock.

        Prefill is the prompt's evaluation up to the first token's logits (the device synchronized);
        decode is the ``n_gen`` single-token steps after it, logits read and argmax taken each time (what a
        server pays per token). llama.cpp's own perf counters are kept beside them for diagnosis: on a GPU
        they attribute asynchronous work to whichever call synchronizes, so they are not the timing.
        """
        if len(prompt) + n_gen > self.n_ctx:
            raise EngineError("context_overflow", f"{len(prompt)} + {n_gen} tokens exceed n_ctx {self.n_ctx}")
        self._clear()
        llama_cpp.llama_perf_context_reset(self.ctx)
        t0 = time.perf_counter()
        self._decode(prompt, 0)
        llama_cpp.llama_synchronize(self.ctx)
        tok = int(np.argmax(self._logits()))
        t1 = time.perf_counter()
        for i in range(n_gen):
            self._decode([tok], len(prompt) + i)
            tok = int(np.argmax(self._logits()))
        t2 = time.perf_counter()
        perf = llama_cpp.llama_perf_context(self.ctx)
        return Timing(prompt_tokens=len(prompt), prompt_ms=(t1 - t0) * 1e3, gen_tokens=n_gen,
                      gen_ms=(t2 - t1) * 1e3, counter_prompt_tokens=perf.n_p_eval,
                      counter_prompt_ms=perf.t_p_eval_ms, counter_gen_tokens=perf.n_eval,
                      counter_gen_ms=perf.t_eval_ms)

    def greedy(self, prompt: Sequence[int], n_gen: int, stop_eog: bool = True) -> list[int]:
        """Greedy continuation of ``prompt`` (stops at end-of-generation tokens when asked)."""
        if len(prompt) + n_gen > self.n_ctx:
            raise EngineError("context_overflow", f"{len(prompt)} + {n_gen} tokens exceed n_ctx {self.n_ctx}")
        self._clear()
        self._decode(prompt, 0)
        out: list[int] = []
        for _ in range(n_gen):
            tok = int(np.argmax(self._logits()))
            if stop_eog and self.vocab.is_eog(tok):
                break
            out.append(tok)
            self._decode([tok], len(prompt) + len(out) - 1)
        return out

    def logprobs(self, prompt: Sequence[int], continuation: Sequence[int]) -> np.ndarray:
        """Log-softmax over the vocabulary before each continuation token: shape [len(cont), n_vocab].

        The prompt but its last token is evaluated first; the last prompt token and the continuation then go
        in batches of up to n_batch tokens with an output row per position (one llama_decode per batch instead
        of one per token).
        """
        cont = [int(t) for t in continuation]
        if not cont:
            return np.zeros((0, self.n_vocab))
        if len(prompt) + len(cont) > self.n_ctx:
            raise EngineError("context_overflow", f"{len(prompt)} + {len(cont)} tokens exceed n_ctx {self.n_ctx}")
        self._clear()
        head, last = list(prompt[:-1]), int(prompt[-1])
        if head:
            self._decode(head, 0)
        batch = [last, *cont[:-1]]
        rows: list[np.ndarray] = []
        for start in range(0, len(batch), self.n_batch):
            part = batch[start:start + self.n_batch]
            self._decode(part, len(head) + start, all_logits=True)
            rows += [self._logits(i).astype(np.float64) for i in range(len(part))]
        logits = np.stack(rows)
        logits -= logits.max(axis=1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))

    def chat(self, messages: list[dict[str, Any]], max_tokens: int, temperature: float = 0.0) -> dict[str, Any]:
        """llama-cpp-python's own chat completion (the peer the conformance suite checks), from a second,
        CPU-only load of the same file made on first use."""
        if self._peer is None:
            from llama_cpp import Llama

            self._peer = Llama(model_path=str(self.path), n_ctx=self.n_ctx, n_batch=self.n_batch,
                               n_threads=self.params.n_threads, n_threads_batch=self.params.n_threads_batch,
                               n_gpu_layers=0, seed=self.params.seed, verbose=False)
        return dict(self._peer.create_chat_completion(messages=messages, max_tokens=max_tokens,
                                                      temperature=temperature))

    def close(self) -> None:
        """Free the context and the model."""
        if self._peer is not None:
            self._peer.close()
            self._peer = None
        for d in self.drafts.values():
            d.close()
        self.drafts.clear()
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)
        self._keep.clear()


class VocabModel:
    """A model's vocabulary alone (llama.cpp's vocab-only load: no weights read, no context): what tokenizing
    needs, in milliseconds where loading a 30B model's weights takes seconds."""

    def __init__(self, model_path: Path) -> None:
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mp)
        if not self.model:
            raise EngineError("load_failed", f"llama.cpp could not read the vocabulary of {model_path}")
        self.vocab = Vocab(llama_cpp.llama_model_get_vocab(self.model))
        self.n_vocab = self.vocab.n_vocab
        self.n_ctx = 0

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Tokens of ``text`` (no BOS added)."""
        return self.vocab.tokenize(text, special=special, add_special=False)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``."""
        return self.vocab.detokenize([int(t) for t in tokens])

    def close(self) -> None:
        """Free the vocabulary."""
        llama_cpp.llama_model_free(self.model)

    def __getattr__(self, name: str) -> Any:
        """Every op that needs weights: a typed refusal, not a missing attribute."""
        raise EngineError("not_loaded", f"{name}: the worker holds a vocabulary only; send 'load' without vocab_only")
