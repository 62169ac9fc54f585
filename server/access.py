"""One access-log line per request (logger ``server.access``, on stderr), as an ASGI middleware.

The line is written when the request is over: when its response has been sent and, for a generation, when
the generation has ended too (a client that drops a stream does not end its generation, so the line then
comes later, with ``client=gone``). It carries the request id, method, path, status, prompt and completion
tokens, cached tokens, time to first token and duration, and the outcome. Headers are never logged, so
neither is the API key.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from server.generation import Generation
from server.transport import sent_status

log = logging.getLogger("server.access")
GEN_KEY = "flux_generation"  # routes put the request's Generation in scope["state"] under this key
RID_KEY = "request_id"


def configure(enabled: bool) -> None:
    """Send access lines to stderr, one unwrapped line each (``serve.access_log``; ``FLUX_LOG`` may still
    set ``server.access=warning`` to silence them)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s access %(message)s"))
    log.handlers[:] = [handler]
    log.propagate = False
    if not enabled:
        log.setLevel(logging.CRITICAL + 10)
    elif log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def access_line(scope: Scope, status: int | None, duration_s: float, client_gone: bool) -> str:
    """The log line of a finished request, with the status its client got (the transport's own 408 when the
    body timed out, not the app's answer to the disconnect that followed)."""
    status = sent_status(scope) or status
    state: dict[str, Any] = scope.get("state") or {}
    gen: Generation | None = state.get(GEN_KEY)
    parts = [f"id={state.get(RID_KEY, '-')}", f"method={scope.get('method')}", f"path={scope.get('path')}",
             f"status={status if status is not None else '-'}"]
    st = gen.stats if gen is not None else None
    if st is not None:
        parts += [f"prompt_tokens={st.prompt_tokens}", f"cached_tokens={st.cached_tokens}",
                  f"completion_tokens={st.completion_tokens}", f"ttft_ms={_ms(st.ttft_s)}",
                  f"duration_ms={_ms(st.duration_s)}", f"outcome={st.outcome}"]
        if gen is not None and gen.finish_reason:
            parts.append(f"finish_reason={gen.finish_reason}")
    else:
        parts.append(f"duration_ms={_ms(duration_s)}")
    if client_gone:
        parts.append("client=gone")
    return " ".join(parts)


def access_log(app: ASGIApp) -> ASGIApp:
    """ASGI middleware: log each HTTP request once it is over."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            await app(scope, receive, send)
            return
        t0 = time.monotonic()
        status: int | None = None
        completed = False

        async def watch(message: Message) -> None:
            nonlocal status, completed
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                completed = True
            await send(message)

        try:
            await app(scope, receive, watch)
        finally:
            _log_when_done(scope, status, time.monotonic() - t0, client_gone=not completed)

    return middleware


def _log_when_done(scope: Scope, status: int | None, duration_s: float, client_gone: bool) -> None:
    gen: Generation | None = (scope.get("state") or {}).get(GEN_KEY)
    if gen is None or gen.done:
        log.info(access_line(scope, status, duration_s, client_gone))
    else:
        gen.when_done(lambda: log.info(access_line(scope, status, duration_s, client_gone)))
