"""Per-request sampling for the serving engine: llama.cpp sampler chains, logprobs,
token text that is always valid UTF-8, and the tokenizer calls.

Runs inside the worker process only (imports llama_cpp). Sampling itself is llama.cpp's sampler chain, one
chain per request, built from the request's :class:`~engine_bridge.sampling.SamplingParams` (:func:`build_chain`
is where a knob declared there takes effect); logprobs are computed here from the raw logits (before temperature and penalties), as
OpenAI reports them.
"""

from __future__ import annotations

import codecs
import ctypes
from typing import Any

import llama_cpp
import numpy as np

from engine_bridge import ops
from engine_bridge.errors import EngineError
from engine_bridge.sampling import SamplingParams


def build_chain(s: SamplingParams, n_vocab: int, penalty_last_n: int) -> Any:
    """A new llama.cpp sampler chain applying every knob of ``s``; the caller frees it with ``llama_sampler_free``.

    Order as llama.cpp's defaults: penalties (over the last ``penalty_last_n`` tokens: a request passes its
    ``max_tokens``, so they cover every token it generates), top-k, top-p, min-p, temperature, then the random
    draw (or greedy when the temperature is 0). A knob at its "off" value adds no stage.
    """
    cp = llama_cpp.llama_sampler_chain_default_params()
    cp.no_perf = True
    chain = llama_cpp.llama_sampler_chain_init(cp)
    stages: list[Any] = []
    presence, frequency = s.presence_penalty, s.frequency_penalty
    if presence or frequency:
        stages.append(llama_cpp.llama_sampler_init_penalties(n_vocab, penalty_last_n, 1.0, frequency, presence))
    if s.temperature == 0.0:
        stages.append(llama_cpp.llama_sampler_init_greedy())
    else:
        top_k, top_p, min_p = s.top_k, s.top_p, s.min_p
        if top_k > 0:
            stages.append(llama_cpp.llama_sampler_init_top_k(top_k))
        if top_p < 1.0:
            stages.append(llama_cpp.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0.0:
            stages.append(llama_cpp.llama_sampler_init_min_p(min_p, 1))
        seed = llama_cpp.LLAMA_DEFAULT_SEED if s.seed is None else s.seed & 0xFFFFFFFF
        stages += [llama_cpp.llama_sampler_init_temp(s.temperature), llama_cpp.llama_sampler_init_dist(seed)]
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

    def longest_token_bytes(self) -> int:
        """Bytes of the longest token text, control tokens written out (a prompt of more bytes than n_ctx
        times this cannot fit n_ctx tokens)."""
        buf = ctypes.create_string_buffer(512)
        longest = 0
        for t in range(self.n_vocab):
            n = llama_cpp.llama_token_to_piece(self.ptr, t, buf, len(buf), 0, True)
            longest = max(longest, abs(n))  # negative: the size it needs (longer than the buffer)
        return longest

    def tokenize(self, text: str, special: bool = True, add_special: bool = False) -> list[int]:
        """Token ids of ``text``; ``special`` parses control tokens, ``add_special`` adds BOS if the model does."""
        return self.tokenize_array(text, special, add_special).tolist()

    def tokenize_array(self, text: str, special: bool = True, add_special: bool = False) -> np.ndarray:
        """:meth:`tokenize` as an int32 array (a long prompt's ids, never a Python list of them)."""
        raw = text.encode("utf-8")
        cap = len(raw) + 8
        for _ in range(2):
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.ptr, raw, len(raw), buf, cap, add_special, special)
            if n >= 0:
                return np.ctypeslib.as_array(buf)[:n].astype(np.int32)
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


def token_logprobs(vocab: Vocab, logprobs: np.ndarray, token: int, k: int) -> tuple[float, list[ops.TopLogprob]]:
    """The chosen token's log-probability and the ``k`` best alternatives as protocol entries."""
    top: list[ops.TopLogprob] = [{"token": int(t), "text": vocab.piece(int(t)).decode("utf-8", errors="replace"),
            "bytes": list(vocab.piece(int(t))), "logprob": float(logprobs[t])} for t in top_ids(logprobs, k)]
    return float(logprobs[token]), top
