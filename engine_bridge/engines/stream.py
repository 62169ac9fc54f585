"""The one OpenAI client every engine other than the worker is checked, timed and scored through.

``POST /v1/completions``, streamed, the prompt as token ids, with per-token logprobs and the usage chunk
(``stream_options.include_usage``): what Flux needs of an engine. A trial's timing is the engine's own
``timings`` object when its last chunk carries one (llama-server: measured inside llama.cpp, like the worker's,
so HTTP is charged to neither engine), else the client's clock: request to first token (prefill), first to
last token over ``completion_tokens - 1`` steps (decode).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from engine_bridge import ops
from engine_bridge.errors import EngineError


class StreamedToken(BaseModel):
    """One generated token as the stream reported it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    id: int | None
    text: str
    logprob: float | None
    top: dict[int, float] = Field(default_factory=dict, description="alternatives by token id")


class Completion(BaseModel):
    """What one streamed completion carried, and when."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    tokens: list[StreamedToken]
    usage: dict[str, Any] | None
    timings: dict[str, float] | None
    finish_reason: str | None
    sent_s: float
    first_s: float | None
    last_s: float | None

    def missing(self) -> list[str]:
        """What Flux needs that the stream lacked: per-token logprobs (with token ids) and completion usage."""
        out = []
        if not self.tokens or any(t.logprob is None or t.id is None for t in self.tokens):
            out.append("per-token logprobs with token ids (logprobs.content[].id)")
        if not self.usage or "completion_tokens" not in self.usage:
            out.append("completion usage (stream_options.include_usage)")
        return out

    def timing(self, prompt_tokens: int) -> ops.Timing:
        """The trial's timing: the engine's own when reported, else the client's."""
        t = self.timings or {}
        if {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms"} <= t.keys():
            return ops.Timing(prompt_tokens=int(t["prompt_n"]), prompt_ms=float(t["prompt_ms"]),
                              gen_tokens=max(int(t["predicted_n"]) - 1, 0), gen_ms=float(t["predicted_ms"]))
        n = int((self.usage or {}).get("completion_tokens") or len(self.tokens))
        first, last = self.first_s or self.sent_s, self.last_s or self.sent_s
        return ops.Timing(prompt_tokens=prompt_tokens, prompt_ms=(first - self.sent_s) * 1e3,
                          gen_tokens=max(n - 1, 0), gen_ms=(last - first) * 1e3)


def client(timeout_s: float) -> httpx.Client:
    """An HTTP client for an engine that keeps no connection for reuse: llama-server (cpp-httplib) closes a
    kept connection after a few requests, and a request sent on it as it closes is lost."""
    return httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_keepalive_connections=0))


def body(prompt: Sequence[int], max_tokens: int, *, top_logprobs: int = 1, ignore_eos: bool = True,
         **extra: Any) -> dict[str, Any]:
    """A greedy streamed completion request (llama.cpp's ``ignore_eos`` and ``cache_prompt`` are ignored by
    engines that do not know them)."""
    return {"prompt": [int(t) for t in prompt], "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": top_logprobs, "ignore_eos": ignore_eos,
            "cache_prompt": False, **extra}


def parse_token(entry: dict[str, Any]) -> StreamedToken:
    """One ``logprobs.content`` entry."""
    top = {int(a["id"]): float(a["logprob"]) for a in entry.get("top_logprobs") or [] if a.get("id") is not None}
    tid = entry.get("id")
    return StreamedToken(id=int(tid) if tid is not None else None, text=str(entry.get("token", "")),
                         logprob=float(entry["logprob"]) if entry.get("logprob") is not None else None, top=top)


def chunk_tokens(chunk: dict[str, Any]) -> tuple[str, list[StreamedToken], str | None]:
    """(text, tokens, finish reason) of one stream chunk's first choice."""
    choice = (chunk.get("choices") or [{}])[0]
    content = ((choice.get("logprobs") or {}).get("content")) or []
    return str(choice.get("text") or ""), [parse_token(e) for e in content], choice.get("finish_reason")


def completion(client: httpx.Client, base: str, request: dict[str, Any]) -> Completion:
    """Send one streamed completion and read it to its end.

    Raises:
        EngineError: ``llama_server`` for an HTTP error or a dead engine.
    """
    tokens: list[StreamedToken] = []
    usage: dict[str, Any] | None = None
    timings: dict[str, float] | None = None
    finish: str | None = None
    first = last = None
    sent = time.perf_counter()
    try:
        with client.stream("POST", f"{base}/v1/completions", json=request) as r:
            if r.status_code != 200:
                raise EngineError("llama_server", f"{base}/v1/completions answered {r.status_code}: "
                                                  f"{r.read().decode(errors='replace')[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                chunk = json.loads(line[5:])
                text, got, reason = chunk_tokens(chunk)
                if got or text:
                    last = time.perf_counter()
                    first = first or last
                tokens += got
                finish = reason or finish
                usage = chunk.get("usage") or usage
                timings = chunk.get("timings") or timings
    except httpx.HTTPError as exc:
        raise EngineError("llama_server", f"{base}/v1/completions failed: {type(exc).__name__}: {exc}") from exc
    return Completion(tokens=tokens, usage=usage, timings=timings, finish_reason=finish, sent_s=sent, first_s=first,
                      last_s=last)


def row(tok: StreamedToken, n_vocab: int) -> np.ndarray:
    """A log-softmax row over the vocabulary from a token's top alternatives; what they leave of the
    probability mass is spread evenly over the tokens they do not name."""
    out = np.empty(n_vocab, dtype=np.float32)
    top = dict(tok.top)
    if tok.id is not None and tok.logprob is not None:
        top.setdefault(tok.id, tok.logprob)
    mass = sum(math.exp(v) for v in top.values())
    rest = n_vocab - len(top)
    out[:] = math.log(max(1.0 - mass, 1e-12) / rest) if rest > 0 else -1e30
    for tid, lp in top.items():
        if 0 <= tid < n_vocab:
            out[tid] = lp
    return out


def score(client: httpx.Client, base: str, prompt: Sequence[int], continuation: Sequence[int], n_vocab: int,
          top_logprobs: int) -> np.ndarray:
    """The engine's log-probabilities of ``continuation`` after ``prompt`` ([len(continuation), n_vocab]).

    One one-token request per position, not streamed, on the reference's own path (teacher forcing), with the
    prompt cache on: a longer or streamed answer would not do, because llama-server holds back a token that ends
    inside a UTF-8 character and then reports it merged with the next, without its logprobs. Even alone such a
    token may come without logprobs: its row is NaN, a position the quality gate leaves out."""
    rows: list[np.ndarray] = []
    for pos in range(len(continuation)):
        request = body([*prompt, *continuation[:pos]], 1, top_logprobs=top_logprobs, cache_prompt=True, stream=False)
        request.pop("stream_options")
        try:
            resp = client.post(f"{base}/v1/completions", json=request)
        except httpx.HTTPError as exc:
            raise EngineError("llama_server", f"{base}/v1/completions failed: {type(exc).__name__}: {exc}") from exc
        if resp.status_code != 200:
            raise EngineError("llama_server", f"{base}/v1/completions answered {resp.status_code}: {resp.text[:300]}")
        _, got, _ = chunk_tokens(resp.json())
        rows.append(row(got[0], n_vocab) if got else np.full(n_vocab, np.nan, dtype=np.float32))
    return np.stack(rows) if rows else np.zeros((0, n_vocab), dtype=np.float32)
