"""One access-log line per request (logger ``server.access``, on stderr), as an ASGI middleware.

The line is written when the request is over: when its response has been sent and, for a generation, when
the generation has ended too (a client that drops a stream does not end its generation, so the line then
comes later, with ``client=gone``). It carries the request id, method, path, status, prompt and completion
tokens, cached tokens, time to first token and duration, and the outcome. Headers are never logged, so
neither is the API key.

The middleware wraps the whole app (:func:`server.app.create_app`), so requests no route takes (a router's 404
and 405) get their line too. Answers the transport gives before a request reaches the app (a header timeout,
malformed headers, the connection limit) get theirs from :func:`refusal_line`. A line is always one line of
``key=value`` fields: what a client controls (the path, the method) is percent-escaped, so a ``%0A`` or a
space in a path cannot start a forged line or field.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any
from urllib.parse import quote

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from server.generation import Generation
from server.transport import Refusal, sent_status

log = logging.getLogger("server.access")
GEN_KEY = "flux_generation"  # routes put the request's Generation in scope["state"] under this key
RID_KEY = "request_id"
_SAFE = "/:@!$&'()*+,;-._~"  # kept as they are in a logged path; everything else (%, =, space, controls) escaped


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


def escaped(value: object) -> str:
    """A client-controlled value as one field: percent-escaped (UTF-8) but for URL punctuation, so it holds no
    space, ``=``, line break or other control character; ``-`` when there is none."""
    return "-" if value is None or value == "" else quote(str(value), safe=_SAFE)


def access_line(scope: Scope, status: int | None, duration_s: float, client_gone: bool) -> str:
    """The log line of a finished request, with the status its client got (the transport's own 408 when the
    body timed out, not the app's answer to the disconnect that followed)."""
    status = sent_status(scope) or status
    state: dict[str, Any] = scope.get("state") or {}
    gen: Generation | None = state.get(GEN_KEY)
    parts = [f"id={escaped(state.get(RID_KEY))}", f"method={escaped(scope.get('method'))}",
             f"path={escaped(scope.get('path'))}", f"status={status if status is not None else '-'}"]
    st = gen.stats if gen is not None else None
    if st is not None:
        parts += [f"prompt_tokens={st.prompt_tokens}", f"cached_tokens={st.cached_tokens}",
                  f"completion_tokens={st.completion_tokens}", f"ttft_ms={_ms(st.ttft_s)}",
                  f"duration_ms={_ms(st.duration_s)}", f"outcome={st.outcome}"]
        if gen is not None and gen.finish_reason:  # Flux's own reason: "cancelled" where the client read "length"
            parts.append(f"finish_reason={gen.finish_reason}")
    else:
        parts.append(f"duration_ms={_ms(duration_s)}")
    if client_gone:
        parts.append("client=gone")
    return " ".join(parts)


def refusal_line(refusal: Refusal) -> str:
    """The log line of an answer the transport gave before any request reached the app (no id, method or path
    was read): its status, how long it waited, the bytes of the unfinished request it held, and its error."""
    parts = ["id=-", "method=-", "path=-", f"status={refusal.status}", f"duration_ms={_ms(refusal.duration_s)}"]
    if refusal.received:
        parts.append(f"received_bytes={refusal.received}")
    return " ".join([*parts, f"error={refusal.what}"])


def log_refusal(refusal: Refusal) -> None:
    """Write :func:`refusal_line` for an answer no request in the app reports (it has no other line)."""
    if refusal.status is not None and not refusal.in_request:
        log.info(refusal_line(refusal))


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
