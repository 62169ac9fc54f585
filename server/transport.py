"""The HTTP connection layer under the app: uvicorn's h11 protocol with read timeouts and a connection limit.

uvicorn times out only idle keep-alive connections: a client that opens a connection and sends nothing,
or sends its headers or body a byte every few seconds, holds the connection (and its memory) for as long
as it likes. :func:`guarded_protocol` adds, per connection:

- a header timeout: the request line and headers must arrive within ``serve.header_timeout_s`` of the
  connection opening (or of the previous response on a kept-alive connection);
- a body timeout: the body must arrive within ``serve.body_timeout_s`` of the headers;
- a connection limit: a connection beyond ``serve.max_connections`` gets a 503 with OpenAI's error body and
  ``Retry-After`` as soon as it sends its request, and is closed.

A timed-out request gets a 408 with OpenAI's error body when no response has started, then the
connection closes (the app, if it was reading the body, sees a disconnect). The status the client got is
left in the request's ``scope["state"]`` under :data:`SENT_STATUS_KEY`, so the access log and the error
counters report it rather than whatever the app answered to the disconnect (which nobody receives).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from artifacts.config import ServeSettings

log = logging.getLogger(__name__)
SENT_STATUS_KEY = "flux_sent_status"  # scope["state"]: the status this layer answered in the app's stead


def sent_status(scope: Mapping[str, Any]) -> int | None:
    """The status the transport answered a request with itself (a 408 body timeout), None if it did not."""
    state = scope.get("state")
    status = state.get(SENT_STATUS_KEY) if isinstance(state, dict) else None
    return status if isinstance(status, int) else None


def raw_response(status: int, reason: str, code: str, message: str, extra: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response with OpenAI's error body that closes the connection."""
    err_type = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": code}}).encode()
    headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close",
               **(extra or {})}
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode("latin-1") + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header/body timeouts and a connection limit (class attributes are set by
    :func:`guarded_protocol`)."""

    header_timeout_s: ClassVar[float] = 10.0
    body_timeout_s: ClassVar[float] = 60.0
    max_connections: ClassVar[int] = 512
    on_refused: ClassVar[tuple[Callable[[str], None], ...]] = ()  # told "timeout" or "connections" (metrics)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "header" or "body" while a timer runs
        self._over_limit = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Count the connection; one over the limit is answered 503 once it speaks."""
        super().connection_made(transport)
        self._over_limit = len(self.connections) > self.max_connections
        self._arm("header", self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        """Feed h11, then move the timer to the phase the request is in."""
        if self._over_limit:
            self._refuse(503, "Service Unavailable", "too_many_connections",
                         f"the server has {self.max_connections} connections open (serve.max_connections): "
                         "retry shortly", {"retry-after": "1"})
            return
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._phase != "body":
            self._arm("body", self.body_timeout_s)
        elif state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()

    def on_response_complete(self) -> None:
        """The next request on this connection gets its own header timeout."""
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm("header", self.header_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the timer."""
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._timer = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _expired(self, phase: str, seconds: float) -> None:
        self._timer = None
        what = "request line and headers" if phase == "header" else "request body"
        log.warning("%s: the %s did not arrive within %g s (serve.%s_timeout_s); closed the connection",
                    _peer(self.client), what, seconds, phase)
        self._refuse(408, "Request Timeout", "request_timeout",
                     f"the {what} did not arrive within {seconds:g} s", None, reason="timeout")

    def _refuse(self, status: int, phrase: str, code: str, message: str, extra: dict[str, str] | None,
                reason: str = "connections") -> None:
        self._disarm()
        if self.transport.is_closing():
            return
        started = self.cycle is not None and getattr(self.cycle, "response_started", False)
        if not started:
            self.transport.write(raw_response(status, phrase, code, message, extra))
            state = self.cycle.scope.get("state") if self.cycle is not None else None
            if isinstance(state, dict):
                state[SENT_STATUS_KEY] = status
        if self.cycle is not None:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.transport.close()
        for hook in self.on_refused:
            hook(reason)


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def guarded_protocol(serve: ServeSettings, on_refused: Callable[[str], None] | None = None) -> type[H11Protocol]:
    """The protocol class uvicorn should use for ``serve``'s timeouts and connection limit."""
    return type("FluxH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": serve.header_timeout_s, "body_timeout_s": serve.body_timeout_s,
        "max_connections": serve.max_connections, "on_refused": (on_refused,) if on_refused else ()})
