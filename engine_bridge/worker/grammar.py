"""A request's grammar constraint inside the worker: llama.cpp's grammar sampler, driven so it never
aborts the process and never lets out text that is not valid UTF-8.

Sampled the way llama.cpp's common sampler does: the request's chain samples from the raw logits first;
only when the grammar rejects that token are the logits constrained by the grammar and sampled again
(applying a grammar to every token of a large vocabulary costs milliseconds per step; checking one token
costs microseconds).

Two guards llama.cpp's grammar lacks:
- UTF-8. The grammar matches code points, and accepts any value a byte sequence decodes to (surrogates,
  overlong forms, values past U+10FFFF): a random-weight model picking byte tokens would write text no
  UTF-8 decoder accepts, and its JSON would not round-trip. A constrained token must also keep the reply
  valid UTF-8.
- Lazy grammars. A lazy grammar (with a :class:`~engine_bridge.gbnf.Trigger`) lets the reply run free until
  it writes a trigger word; the text after the word must follow the grammar. A token that would complete
  the word and run on past it is not taken (the chain draws again without it), so the grammar starts at a
  token boundary, right after the word, and never sees text it did not allow (llama.cpp's own lazy
  grammars throw, which aborts the process, on such text).
"""

from __future__ import annotations

import codecs
import ctypes
from typing import Any

import llama_cpp
import numpy as np

from engine_bridge.errors import EngineError, GrammarError
from engine_bridge.grammar_spec import GrammarSpec
from engine_bridge.worker.sampling import Vocab

_SPACE_BYTES = b" \t\r\n"
MAX_TRIGGER_REDRAWS = 16  # tokens that run past a trigger word, skipped before one is taken anyway
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data


_CONT = (0x80, 0xBF)
# RFC 3629: the ranges each byte after a lead byte must fall in (CPython's incremental decoder checks only
# 0x80-0xBF for an unfinished character, so it lets a surrogate's or an over-long form's first bytes by)
_AFTER_LEAD: dict[int, tuple[tuple[int, int], ...]] = {
    **{b: (_CONT,) for b in range(0xC2, 0xE0)},
    0xE0: ((0xA0, 0xBF), _CONT), **{b: (_CONT, _CONT) for b in range(0xE1, 0xED)}, 0xED: ((0x80, 0x9F), _CONT),
    0xEE: (_CONT, _CONT), 0xEF: (_CONT, _CONT),
    0xF0: ((0x90, 0xBF), _CONT, _CONT), **{b: (_CONT, _CONT, _CONT) for b in range(0xF1, 0xF4)},
    0xF4: ((0x80, 0x8F), _CONT, _CONT),
}


def _completable(tail: bytes) -> bool:
    """True when ``tail`` (the bytes of an unfinished character) can still become a valid character."""
    ranges = _AFTER_LEAD.get(tail[0]) if tail else ()
    return ranges is not None and all(lo <= b <= hi for b, (lo, hi) in zip(tail[1:], ranges, strict=False))


def incomplete_tail(data: bytes) -> bytes | None:
    """The bytes of an unfinished last character of ``data`` (b"" when it ends whole); None when ``data`` is
    not valid UTF-8 or valid UTF-8 cut inside its last character."""
    dec = codecs.getincrementaldecoder("utf-8")("strict")
    try:
        dec.decode(data, final=False)
    except UnicodeDecodeError:
        return None
    tail = dec.getstate()[0]
    return tail if not tail or _completable(tail) else None


def utf8_prefix_ok(data: bytes) -> bool:
    """True when ``data`` is valid UTF-8, or valid UTF-8 cut inside its last character."""
    return incomplete_tail(data) is not None


def _whole_or_prefix(data: bytes) -> bool:
    """:func:`utf8_prefix_ok`, fast for the usual token (whole characters)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return utf8_prefix_ok(data)
    return True


class Utf8Masks:
    """Per-vocabulary facts for the UTF-8 guard, computed once: tokens that cannot start valid text, and
    the tokens that start with a continuation byte (the only ones that can finish a started character)."""

    def __init__(self, vocab: Vocab) -> None:
        pieces = [vocab.piece(t) for t in range(vocab.n_vocab)]
        self.bad_start = np.array([not _whole_or_prefix(p) for p in pieces], dtype=bool)
        self.continuation = np.array([t for t, p in enumerate(pieces) if p and 0x80 <= p[0] < 0xC0], dtype=np.int64)
        self.pieces = pieces

    def banned_after(self, tail: bytes) -> np.ndarray:
        """Tokens that would make invalid UTF-8 after an unfinished character ``tail`` (or from a clean start)."""
        if not tail:
            return self.bad_start
        banned = np.ones(len(self.pieces), dtype=bool)
        ok = [t for t in self.continuation if utf8_prefix_ok(tail + self.pieces[t])]
        banned[ok] = False
        return banned


class GrammarSampler:
    """One request's grammar: compiled by llama.cpp, sampled with the chain, guarded as the module says."""

    _masks: dict[int, Utf8Masks] = {}  # per vocabulary (by its llama.cpp pointer): it never changes

    @classmethod
    def warm_up(cls, vocab: Vocab) -> None:
        """Pay the first grammar's one-time costs now (llama.cpp's and the UTF-8 masks', ~0.3 s for a 32k
        vocabulary), at load, not in the first constrained request's time to first token."""
        cls(vocab, GrammarSpec(gbnf='root ::= "a"\n')).close()

    def __init__(self, vocab: Vocab, spec: GrammarSpec) -> None:
        """Compile ``spec`` for ``vocab``.

        Raises:
            GrammarError: llama.cpp refused the grammar (its reason is in the worker log).
        """
        self.vocab = vocab
        self.ptr = llama_cpp.llama_sampler_init_grammar(vocab.ptr, spec.gbnf.encode(), spec.root.encode())
        if not self.ptr:
            raise GrammarError("grammar", "llama.cpp could not parse the grammar (see the worker log)")
        key = int(ctypes.cast(vocab.ptr, ctypes.c_void_p).value or 0)
        if key not in self._masks:
            self._masks[key] = Utf8Masks(vocab)
        self.utf8 = self._masks[key]
        self.trigger = spec.trigger
        self.awaiting = spec.trigger is not None
        self._words = [w.encode() for w in spec.trigger.words] if spec.trigger else []
        self._seen = b""  # text generated while awaiting: all of it for at_start, else a tail
        self._tail = b""  # an unfinished UTF-8 character at the end of the constrained text
        self._cand = np.zeros(vocab.n_vocab, dtype=_TOKEN_DATA)
        self._one = np.zeros(1, dtype=_TOKEN_DATA)

    @staticmethod
    def _array(buf: np.ndarray) -> Any:
        arr: Any = llama_cpp.llama_token_data_array()  # its stub types the pointer field as an array
        arr.data = buf.ctypes.data_as(llama_cpp.llama_token_data_p)
        arr.size, arr.selected, arr.sorted = len(buf), -1, False
        return arr

    def _draw(self, chain: Any, logits: np.ndarray, constrained: bool, banned: np.ndarray | list[int]) -> int:
        cand = self._cand
        cand["id"] = np.arange(len(cand), dtype=np.int32)
        cand["logit"], cand["p"] = logits, 0.0
        cand["logit"][banned] = -np.inf
        arr = self._array(cand)
        if constrained:
            llama_cpp.llama_sampler_apply(self.ptr, ctypes.byref(arr))
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
        if arr.selected < 0:
            raise EngineError("sampling_failed", "the sampler chain selected no token")
        return int(cand["id"][arr.selected])

    def allows(self, token: int) -> bool:
        """True when the (triggered or eager) grammar accepts ``token`` next and the text stays UTF-8."""
        if not self.vocab.is_eog(token) and not utf8_prefix_ok(self._tail + self.vocab.piece(token)):
            return False
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
                tok = self._draw(chain, logits, True, self.utf8.banned_after(self._tail))
            if not self.vocab.is_eog(tok):  # llama.cpp's grammar aborts on an end token it did not allow
                llama_cpp.llama_sampler_accept(self.ptr, tok)
                self._tail = incomplete_tail(self._tail + self.vocab.piece(tok)) or b""
        llama_cpp.llama_sampler_accept(chain, tok)
        return tok

    def close(self) -> None:
        """Free the llama.cpp sampler."""
        if self.ptr:
            llama_cpp.llama_sampler_free(self.ptr)
            self.ptr = None
