"""The client side of ``flux bench serve`` and ``flux bench ttft``: streamed requests timed as a client sees them,
and the corpus texts they send.

Timing is client-side from the SSE stream on every server: TTFT = request sent -> first piece of text; decode
tok/s = (tokens - 1) / (last piece - first piece).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from artifacts.corpus import load_prompts
from tasks.bench.arrivals import timing
from tasks.bench.errors import BenchError
from tasks.bench.http import client_limits, exchange, finish_reason


@dataclass(frozen=True)
class Got:
    """One streamed request as the client saw it (``end_s``, ``sent_s``: ``time.perf_counter`` readings)."""

    ttft_s: float
    tokens: int
    decode_tps: float | None
    end_s: float
    sent_s: float
    cached: int | None

    def row(self) -> dict[str, Any]:
        """Its fields, for a benchmark's metrics."""
        return asdict(self)


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Got:
    """Send ``body`` as a stream (with usage) and read it to its end.

    Raises:
        BenchError: the request failed or streamed no text.
    """
    ex = await exchange(client, "POST", url, body={**body, "stream": True, "stream_options": {"include_usage": True}})
    t = timing(ex, ex.t0)
    if t["error"] or t["ttft_ms"] is None:
        raise BenchError(f"{url}: {t['error'] or 'no text'} ({ex.body[:200]})")
    usage = any('"usage"' in d for _, d in ex.events)
    n = t["completion_tokens"] if usage else (body["max_tokens"] if finish_reason(ex.events) == "length"
                                              else t["completion_tokens"])
    tpot = t["tpot_ms"] * t["completion_tokens"] / n if t["tpot_ms"] and t["completion_tokens"] != n else t["tpot_ms"]
    return Got(ttft_s=t["ttft_ms"] / 1e3, tokens=n, decode_tps=1e3 / tpot if tpot else None,
               end_s=ex.times[-1], sent_s=ex.t0, cached=t["cached_tokens"])


def streams(base: str, path: str, bodies: list[dict[str, Any]]) -> list[Got]:
    """Send every body at once (each its own stream) and wait for all."""
    async def go() -> list[Got]:
        limits = client_limits(max_connections=len(bodies) + 2)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10), limits=limits) as c:
            return list(await asyncio.gather(*(one(c, base + path, b) for b in bodies)))
    return asyncio.run(go())


def aggregate_tps(got: list[Got]) -> float:
    """Tokens of all streams over the time from the first request to the last token."""
    return sum(g.tokens for g in got) / (max(g.end_s for g in got) - min(g.sent_s for g in got))


def corpus_texts(n: int, chars: int, skip: int = 0) -> list[str]:
    """``n`` corpus prompts cut to ``chars`` characters that differ in their first 16 (no prefix cache can help).

    Raises:
        BenchError: the corpus has fewer such prompts.
    """
    texts = [p.text for p in load_prompts()]
    out: list[str] = []
    for t in texts[skip:] + texts[:skip]:
        if all(t[:16] != o[:16] for o in out) and len(t) >= chars // 2:
            out.append(t[:chars])
        if len(out) == n:
            return out
    raise BenchError(f"the corpus has fewer than {n} distinct prompts of {chars // 2}+ characters: ask for fewer "
                     "rounds or prompts")


def long_texts(tokenize: Callable[[str], list[int]], n: int, n_tokens: int) -> list[str]:
    """``n`` texts of about ``n_tokens`` tokens of the plan's model, each starting with a different corpus prompt."""
    texts = [p.text for p in load_prompts()]
    out = []
    for i in range(n):
        joined = "\n\n".join(texts[(i * 7 + k) % len(texts)] for k in range(len(texts)))
        per_char = len(tokenize(joined)) / len(joined)
        out.append(joined[: int(n_tokens / per_char)])
    return out


def shuffled(rng: random.Random, names: list[str]) -> list[str]:
    """A new random order of the arms for this round."""
    out = list(names)
    rng.shuffle(out)
    return out
