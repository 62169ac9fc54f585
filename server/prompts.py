"""How long a prompt is, in tokens, and how long its reply may be, refused as early as possible.

A prompt that cannot fit the context is refused (HTTP 400 ``context_length_exceeded``) before it costs
much: one longer in bytes than n_ctx times the longest token cannot fit and is refused before any
tokenizing; one far over the context is counted in pieces of about a context each, cut at whitespace or,
in text without any (one 10 MB word), where the piece must end, so no single worker call runs long and
the count stops as soon as it passes the context.
"""

from __future__ import annotations

import re

from server.errors import ContextLengthExceeded
from server.supervisor import WorkerSupervisor

DIRECT_TOKENIZE_CHARS_PER_TOKEN = 8  # prompts up to n_ctx x this many characters are tokenized whole
PIECE_CHARS_PER_TOKEN = 4  # a longer prompt is counted in pieces of n_ctx x this many characters
PIECE_SLACK_TOKENS = 4  # a cut can split one token into a few: each piece's count is lowered by this
CUT_WINDOW_CHARS = 256  # a piece ends at whitespace within this many characters, else where it must
_SPACE = re.compile(r"\s")


def reply_room(requested: int | None, min_reply: int) -> int:
    """The reply tokens a request must leave room for: ``min(max_tokens, min_reply)`` (``min_reply`` when it
    sets no limit), at least one."""
    return max(1, min(requested if requested is not None else min_reply, min_reply))


def reply_tokens(n_prompt: int, requested: int | None, n_ctx: int, min_reply: int) -> int:
    """The reply limit for a prompt, or ContextLengthExceeded when it cannot leave the room it must.

    A request must leave room for :func:`reply_room` reply tokens; its reply is then capped by the context
    that is left.
    """
    need = reply_room(requested, min_reply)
    if n_prompt + need > n_ctx:
        raise ContextLengthExceeded(n_prompt, need, n_ctx)
    left = n_ctx - n_prompt
    return min(requested, left) if requested is not None else left


def _cut(text: str, at: int) -> int:
    """A cut point just before whitespace at or after ``at`` (tokens rarely span it), else at ``at`` itself:
    a piece is never much longer than asked, even for text without a space (one 10 MB word)."""
    if at >= len(text):
        return len(text)
    m = _SPACE.search(text, at, at + CUT_WINDOW_CHARS)
    return m.start() if m and m.start() > 0 else at


async def prompt_tokens(engine: WorkerSupervisor, text: str, n_ctx: int, wait_s: float, add_special: bool = False) -> list[int]:
    """Tokens of a prompt. A prompt longer in bytes than the context's tokens can be (n_ctx x the longest
    token) is refused before any tokenizing; one far over the context is refused after tokenizing about
    one context, in pieces, so no single worker call runs long."""
    wait = wait_s
    limit = n_ctx
    max_token = int(engine.info.raw.get("max_token_bytes") or 0)
    if max_token > 0 and len(text) > limit * max_token:  # cheap first: characters <= bytes
        at_least = -(-len(text.encode("utf-8")) // max_token)
        if at_least > limit:
            raise ContextLengthExceeded(at_least, 1, limit, at_least=True)
    if len(text) <= limit * DIRECT_TOKENIZE_CHARS_PER_TOKEN:
        return await engine.tokenize(text, wait, add_special)
    count, pos, pieces = 0, 0, 0
    while pos < len(text):
        end = _cut(text, pos + limit * PIECE_CHARS_PER_TOKEN)
        count += len(await engine.tokenize(text[pos:end], wait))
        pieces, pos = pieces + 1, end
        if count - pieces * PIECE_SLACK_TOKENS > limit:
            raise ContextLengthExceeded(count - pieces * PIECE_SLACK_TOKENS, 1, limit, at_least=True)
    return await engine.tokenize(text, wait, add_special)

