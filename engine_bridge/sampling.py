"""Per-request sampling for the serving engine: request arguments, llama.cpp sampler chains, logprobs,
token text that is always valid UTF-8, and the tokenizer calls.

Runs inside the worker process only (imports llama_cpp). Sampling itself is llama.cpp's sampler chain, one
chain per request; logprobs are computed here from the raw logits (before temperature and penalties), as
OpenAI reports them.
"""

from __future__ import annotations

import codecs
import ctypes
from typing import Any

import llama_cpp
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engine_bridge.errors import EngineError, GrammarError
from engine_bridge.gbnf import GrammarSpec

MAX_TOP_LOGPROBS = 20
_SPACE_BYTES = b" \t\r\n"
MAX_TRIGGER_REDRAWS = 16  # tokens that run past a trigger word, skipped before one is taken anyway
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


class GenerateArgs(BaseModel):
    """The arguments of one ``generate`` request (the protocol's fields, validated)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rid: str = Field(min_length=1, description="request id, unique among running generations; used by cancel")
    prompt: list[int] = Field(min_length=1, description="prompt token ids")
    max_tokens: int = Field(ge=1)
    temperature: float = Field(0.8, ge=0.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 = off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, description="None = a random seed")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    conversation: str | None = Field(None, description="an opaque conversation label (reported, not required)")
    progress: bool = Field(False, description="also stream prefill progress events (type 'prefill')")
    grammar: GrammarSpec | None = Field(None, description="constrain the reply to this grammar (GBNF)")


def build_chain(args: GenerateArgs, n_vocab: int) -> Any:
    """A new llama.cpp sampler chain for ``args``; the caller frees it with ``llama_sampler_free``.

    Order as llama.cpp's defaults: penalties, top-k, top-p, min-p, temperature, then the random draw
    (or greedy when the temperature is 0). Penalties cover every token this request generates.
    """
    cp = llama_cpp.llama_sampler_chain_default_params()
    cp.no_perf = True
    chain = llama_cpp.llama_sampler_chain_init(cp)
    stages: list[Any] = []
    if args.presence_penalty or args.frequency_penalty:
        stages.append(llama_cpp.llama_sampler_init_penalties(
            n_vocab, args.max_tokens, 1.0, args.frequency_penalty, args.presence_penalty))
    if args.temperature == 0.0:
        stages.append(llama_cpp.llama_sampler_init_greedy())
    else:
        if args.top_k > 0:
            stages.append(llama_cpp.llama_sampler_init_top_k(args.top_k))
        if args.top_p < 1.0:
            stages.append(llama_cpp.llama_sampler_init_top_p(args.top_p, 1))
        if args.min_p > 0.0:
            stages.append(llama_cpp.llama_sampler_init_min_p(args.min_p, 1))
        seed = llama_cpp.LLAMA_DEFAULT_SEED if args.seed is None else args.seed & 0xFFFFFFFF
        stages += [llama_cpp.llama_sampler_init_temp(args.temperature), llama_cpp.llama_sampler_init_dist(seed)]
    for stage in stages:
        llama_cpp.llama_sampler_chain_add(chain, stage)  # the chain owns its stages
    return chain


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities (float64) of raw logits."""
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def top_ids(logprobs: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` most likely token ids, most likely first."""
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    idx = np.argpartition(-logprobs, k - 1)[:k]
    return idx[np.argsort(-logprobs[idx], kind="stable")]


class Vocab:
    """Token ↔ text through one model's llama.cpp vocabulary (pieces cached: the vocabulary is fixed)."""

    def __init__(self, vocab: Any) -> None:
        self.ptr = vocab
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self._pieces: dict[int, bytes] = {}

    def is_eog(self, token: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, <|im_end|>, ...)."""
        return bool(llama_cpp.llama_vocab_is_eog(self.ptr, token))

    def piece(self, token: int) -> bytes:
        """The bytes of one token as generated text (control tokens render as nothing)."""
        got = self._pieces.get(token)
        if got is None:
            buf = ctypes.create_string_buffer(64)
            n = llama_cpp.llama_token_to_piece(self.ptr, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = llama_cpp.llama_token_to_piece(self.ptr, token, buf, len(buf), 0, False)
            got = self._pieces[token] = buf.raw[:max(n, 0)]
        return got

    def tokenize(self, text: str, special: bool = True, add_special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens, ``add_special`` adds BOS if the model does."""
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        for _ in range(2):
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.ptr, raw, len(raw), buf, cap, add_special, special)
            if n >= 0:
                return list(buf[:n])
            cap = -n
        raise RuntimeError("llama_tokenize did not converge")

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        """Text of ``tokens`` (invalid UTF-8 replaced); ``special`` renders control tokens.

        Raises:
            EngineError: ``bad_request`` for a token id outside the vocabulary.
        """
        bad = [t for t in tokens if not 0 <= t < self.n_vocab]
        if bad:
            raise EngineError("bad_request", f"token ids out of range 0..{self.n_vocab - 1}: {bad[:5]}")
        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        cap = 8 * len(tokens) + 16
        for _ in range(2):
            buf = ctypes.create_string_buffer(cap)
            n = llama_cpp.llama_detokenize(self.ptr, arr, len(tokens), buf, cap, False, special)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            cap = -n
        raise RuntimeError("llama_detokenize did not converge")


def new_text_decoder() -> codecs.IncrementalDecoder:
    """A UTF-8 decoder that holds back an incomplete multi-byte character until its last byte arrives."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


def token_logprobs(vocab: Vocab, logprobs: np.ndarray, token: int, k: int) -> tuple[float, list[dict[str, Any]]]:
    """The chosen token's log-probability and the ``k`` best alternatives as protocol entries."""
    top = [{"token": int(t), "text": vocab.piece(int(t)).decode("utf-8", errors="replace"),
            "bytes": list(vocab.piece(int(t))), "logprob": float(logprobs[t])} for t in top_ids(logprobs, k)]
    return float(logprobs[token]), top


class GrammarSampler:
    """A request's grammar constraint, sampled the way llama.cpp's common sampler does.

    The request's chain samples from the raw logits first; only when the grammar rejects that token are
    the logits constrained by the grammar and sampled again (applying a grammar to every token of a large
    vocabulary costs milliseconds per step; checking one token costs microseconds).

    A grammar with a trigger is lazy: the reply is free until it writes one of the trigger's words (at
    its start only, with ``at_start``); the text after the word must then follow the grammar. A token
    that would complete the word and run on past it is not taken (the chain draws again without it), so
    the grammar always starts at a token boundary, right after the word, and never sees text it did not
    allow (llama.cpp's own lazy grammars abort the process on such text).
    """

    def __init__(self, vocab: Vocab, spec: GrammarSpec) -> None:
        """Compile ``spec`` for ``vocab``.

        Raises:
            GrammarError: llama.cpp refused the grammar (its reason is in the worker log).
        """
        self.vocab = vocab
        self.ptr = llama_cpp.llama_sampler_init_grammar(vocab.ptr, spec.gbnf.encode(), spec.root.encode())
        if not self.ptr:
            raise GrammarError("grammar", "llama.cpp could not parse the grammar (see the worker log)")
        self.trigger = spec.trigger
        self.awaiting = spec.trigger is not None
        self._words = [w.encode() for w in spec.trigger.words] if spec.trigger else []
        self._seen = b""  # text generated while awaiting: all of it for at_start, else a tail
        self._cand = np.zeros(vocab.n_vocab, dtype=_TOKEN_DATA)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)

    @staticmethod
    def _array(buf: np.ndarray) -> Any:
        arr: Any = llama_cpp.llama_token_data_array()  # its stub types the pointer field as an array
        arr.data = buf.ctypes.data_as(llama_cpp.llama_token_data_p)
        arr.size, arr.selected, arr.sorted = len(buf), -1, False
        return arr

    def _draw(self, chain: Any, logits: np.ndarray, constrained: bool, banned: list[int]) -> int:
        cand = self._cand
        cand["id"] = np.arange(len(cand), dtype=np.int32)
        cand["logit"], cand["p"] = logits, 0.0
        if banned:
            cand["logit"][banned] = -np.inf
        arr = self._array(cand)
        if constrained:
            llama_cpp.llama_sampler_apply(self.ptr, ctypes.byref(arr))
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
        if arr.selected < 0:
            raise EngineError("sampling_failed", "the sampler chain selected no token")
        return int(cand["id"][arr.selected])

    def allows(self, token: int) -> bool:
        """True when the (triggered or eager) grammar accepts ``token`` next."""
        self._one["id"], self._one["logit"], self._one["p"] = token, 0.0, 0.0
        arr = self._array(self._one)
        llama_cpp.llama_sampler_apply(self.ptr, ctypes.byref(arr))
        return bool(np.isfinite(self._one["logit"][0]))

    def _overrun(self, piece: bytes) -> int | None:
        """Bytes of ``piece`` past a trigger word it completes; None when it completes none."""
        text = self._seen + piece
        ends: list[int] = []
        if self.trigger is not None and self.trigger.at_start:
            body = text.lstrip(_SPACE_BYTES)
            lead = len(text) - len(body)
            ends = [lead + len(w) for w in self._words if body.startswith(w)]
        else:
            ends = [i + len(w) for w in self._words if (i := text.find(w)) >= 0]
        ends = [e for e in ends if e > len(self._seen)]
        return len(text) - min(ends) if ends else None

    def _remember(self, piece: bytes) -> None:
        """Keep what a trigger word can still start in; forget start-only words the reply can no longer begin with."""
        self._seen += piece
        if self.trigger is not None and self.trigger.at_start:
            body = self._seen.lstrip(_SPACE_BYTES)
            if body and not any(w.startswith(body) for w in self._words):
                self._words, self._seen = [], b""
        elif self._words:
            keep = max(len(w) for w in self._words) - 1  # a word can start in the last keep bytes, no earlier
            self._seen = self._seen[len(self._seen) - keep:] if keep else b""

    def _sample_awaiting(self, chain: Any, logits: np.ndarray) -> int:
        """The chain's choice, never a token that runs past a trigger word; the grammar starts after one."""
        banned: list[int] = []
        while True:
            tok = self._draw(chain, logits, False, banned)
            over = None if self.vocab.is_eog(tok) else self._overrun(self.vocab.piece(tok))
            if over is None or over == 0 or len(banned) >= MAX_TRIGGER_REDRAWS:
                break
            banned.append(tok)
        if over == 0:
            self.awaiting = False
        else:
            self._remember(self.vocab.piece(tok))
        return tok

    def sample(self, chain: Any, ctx: Any, idx: int) -> int:
        """The next token from batch output ``idx``; both the chain and the grammar accept it."""
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, idx), shape=(self.vocab.n_vocab,))
        if self.awaiting:
            tok = self._sample_awaiting(chain, logits)
        else:
            tok = self._draw(chain, logits, False, [])
            if not self.allows(tok):
                tok = self._draw(chain, logits, True, [])
            if not self.vocab.is_eog(tok):  # llama.cpp's grammar aborts on an end token it did not allow
                llama_cpp.llama_sampler_accept(self.ptr, tok)
        llama_cpp.llama_sampler_accept(chain, tok)
        return tok

    def close(self) -> None:
        """Free the llama.cpp sampler."""
        if self.ptr:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None
