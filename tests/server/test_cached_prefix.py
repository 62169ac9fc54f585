"""Turns that reuse what was computed: through a real server, a prompt that repeats or extends a cached one pays
only for its new tokens (token counts the worker reports, never wall time), in chat turns and in token prompts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from support import ServeEnv, Server, start_server, stop_server

from artifacts.records.plan import Plan

MIN_PARK_TOKENS = 32  # engine_bridge.worker.sequences: the server tests do not import the worker


@pytest.fixture(scope="module")
def long_server(senv: ServeEnv, tiny_moe: Path, plan_maker: Callable[..., Plan]) -> Iterator[Server]:
    """tiny-moe with its whole trained context (4,096 tokens) in each of 2 sequences."""
    srv = start_server(senv, plan_maker(senv.settings, tiny_moe, n_ctx=4096, n_seq_max=2).id)
    yield srv
    stop_server(srv)


def _worker(server: Server) -> dict[str, Any]:
    stats: dict[str, Any] = server.stats()["worker"]["serve_stats"]
    return stats


def _complete(server: Server, prompt: list[int], max_tokens: int = 2 * MIN_PARK_TOKENS) -> tuple[dict[str, Any], int]:
    """A greedy text completion of token ids: its usage, and the prompt tokens the worker computed for it."""
    before = _worker(server)["prefill_tokens"]
    r = httpx.post(f"{server.base}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0}, timeout=300)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body, int(_worker(server)["prefill_tokens"] - before)


def test_a_repeated_or_extended_prompt_computes_only_its_new_tokens(long_server: Server) -> None:
    prompt = np.random.default_rng(7).integers(10, 500, 3000).tolist()
    first, computed = _complete(long_server, prompt)
    assert computed == 3000 - first["usage"]["prompt_tokens_details"]["cached_tokens"]
    parked = _worker(long_server)["parked"]["parked_total"]

    again, computed = _complete(long_server, prompt)
    usage = again["usage"]
    assert usage["prompt_tokens"] == 3000 and usage["prompt_tokens_details"]["cached_tokens"] == 2999, \
        "all but the last token, whose logits give the first token"
    assert computed == 1
    assert again["choices"][0]["text"] == first["choices"][0]["text"], "the cached prefix gives the same reply"

    longer, computed = _complete(long_server, prompt + [11, 12, 13, 14, 15])
    usage = longer["usage"]
    assert usage["prompt_tokens"] == 3005 and usage["prompt_tokens_details"]["cached_tokens"] >= 3000
    assert computed == 3005 - usage["prompt_tokens_details"]["cached_tokens"] <= 5, "the new tokens alone (fewer when \
        the reply began with them)"
    assert _worker(long_server)["parked"]["parked_total"] == parked, \
        "a prompt that keeps its sequence trims the old reply: nothing is copied out on its way to its first token"


def test_the_next_chat_turn_computes_only_the_new_turn(long_server: Server) -> None:
    words = " ".join(np.random.default_rng(8).choice(["red", "blue", "green", "stone", "river"], 600))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You answer briefly."},
                                      {"role": "user", "content": f"Read this: {words}"}]

    def chat(msgs: list[dict[str, Any]]) -> tuple[dict[str, Any], int]:
        before = _worker(long_server)["prefill_tokens"]
        r = httpx.post(f"{long_server.base}/v1/chat/completions", json={"messages": msgs, "max_tokens": 40,
                                                                        "temperature": 0}, timeout=300)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body, int(_worker(long_server)["prefill_tokens"] - before)

    first, _ = chat(messages)
    n = first["usage"]["prompt_tokens"]
    again, computed = chat(messages)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == n - 1 and computed == 1
    turn = [*messages, {"role": "assistant", "content": again["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And then?"}]
    nxt, computed = chat(turn)
    usage = nxt["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= n, "the whole first prompt is reused"
    assert computed == usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert computed < usage["prompt_tokens"] - n + 8, "the new turn and (at most) the reply's re-tokenized end"
