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
connection closes (the app, if it was reading the body, sees a disconnect). An idle kept-alive connection
that sent nothing of a next request is closed without one. Request lines and headers that h11 cannot read
get a 400 with OpenAI's error body (uvicorn's own is plain text).

Every such answer is reported to the ``on_refused`` hooks as a :class:`Refusal`. One written while the app
runs the request (a body timeout) is the request's: its status is left in ``scope["state"]`` under
:data:`SENT_STATUS_KEY`, so the request's access line and the error counters report it rather than whatever
the app answered to the disconnect (which nobody receives). One written before any request reached the app
(a header timeout, malformed headers, the connection limit) has no request to report it: its
:class:`Refusal` says so (``in_request`` False), and the hook gives it its access line and counts it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, NamedTuple

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from artifacts.config import ServeSettings

log = logging.getLogger(__name__)
SENT_STATUS_KEY = "flux_sent_status"  # scope["state"]: the status this layer answered in the app's stead
RefusalReason = Literal["timeout", "connections", "malformed"]


@dataclass(frozen=True)
class Refusal:
    """A connection this layer answered (or closed) itself, as told to the ``on_refused`` hooks.

    Attributes:
        reason: why, the label of ``flux_connections_refused_total``.
        what: what happened, for the access log (``header_timeout``, ``body_timeout``, ``too_many_connections``,
            ``malformed_request``; ``idle`` for a kept-alive connection closed without an answer).
        status: the status written, None when the connection was only closed.
        in_request: True when a request in the app reports it (its access line and error count carry
            ``status``); False when no request reached the app, so nothing else will.
        duration_s: from the start of what timed out (the connection, the previous response, the headers)
            to the answer.
        received: bytes of an unfinished request line and headers held when it was answered.
    """

    reason: RefusalReason
    what: str
    status: int | None
    in_request: bool
    duration_s: float
    received: int = 0


class _Answer(NamedTuple):
    """A response this layer writes itself: status, reason phrase, OpenAI error code, message, extra headers."""

    status: int
    phrase: str
    code: str
    message: str
    headers: dict[str, str] | None = None


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
    on_refused: ClassVar[tuple[Callable[[Refusal], None], ...]] = ()  # metrics, error counters, access log

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "header" or "body" while a timer runs
        self._armed_at = 0.0  # loop time the running timer's phase began
        self._last_data = 0.0  # loop time of the last bytes received
        self._served = False  # a response was completed on this connection (it is kept alive)
        self._over_limit = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Count the connection; one over the limit is answered 503 once it speaks."""
        super().connection_made(transport)
        self._over_limit = len(self.connections) > self.max_connections
        self._arm("header", self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        """Feed h11, then move the timer to the phase the request is in."""
        self._last_data = self.loop.time()
        if self._over_limit:
            self._refuse("connections", "too_many_connections", _Answer(
                503, "Service Unavailable", "too_many_connections", f"the server has {self.max_connections} "
                "connections open (serve.max_connections): retry shortly", {"retry-after": "1"}))
            return
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY and self._phase != "body":
            self._arm("body", self.body_timeout_s)
        elif state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()

    def on_response_complete(self) -> None:
        """The next request on this connection gets its own header timeout."""
        self._served = True
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm("header", self.header_timeout_s)

    def send_400_response(self, msg: str) -> None:
        """Request line or headers h11 cannot read: OpenAI's error body (not uvicorn's plain text), reported
        like the other answers of this layer."""
        self._refuse("malformed", "malformed_request", _Answer(
            400, "Bad Request", "malformed_request", "the request line or headers are not valid HTTP/1.1 (a "
            "malformed line, a bad header name or value, or headers over 16 KiB): the connection is closed"))

    def connection_lost(self, exc: Exception | None) -> None:
        """Stop the timer."""
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._armed_at = self.loop.time()
        self._timer = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _expired(self, phase: str, seconds: float) -> None:
        self._timer = None
        if phase == "body":
            log.warning("%s: the request body did not arrive within %g s (serve.body_timeout_s); closed the "
                        "connection", _peer(self.client), seconds)
            self._refuse("timeout", "body_timeout", _Answer(408, "Request Timeout", "request_timeout",
                                                            f"the request body did not arrive within {seconds:g} s"))
            return
        held = len(self.conn.trailing_data[0])  # the unfinished request line and headers h11 holds
        if held == 0 and self._served:  # an idle kept-alive connection: closed, as its keep-alive timeout would
            self._refuse("timeout", "idle", None)
            return
        message = _header_timeout_message(seconds, held, self.loop.time() - self._last_data)
        log.warning("%s: %s (serve.header_timeout_s); closed the connection", _peer(self.client), message)
        self._refuse("timeout", "header_timeout", _Answer(408, "Request Timeout", "request_timeout", message), held)

    def _refuse(self, reason: RefusalReason, what: str, answer: _Answer | None, received: int = 0) -> None:
        """Write ``answer`` in the app's stead when no response has started (None: only close), close the
        connection and tell the hooks."""
        phase, armed_at = self._phase, self._armed_at
        self._disarm()
        if self.transport.is_closing():
            return
        # a request is in the app only while its body is read or its response is being made (not a finished
        # one whose connection now waits for the next request)
        cycle = self.cycle if phase != "header" and self.cycle is not None and not self.cycle.response_complete \
            else None
        sent: int | None = None
        if answer is not None and not (cycle is not None and cycle.response_started):
            self.transport.write(raw_response(*answer))
            sent = answer.status
            if cycle is not None and isinstance(cycle.scope.get("state"), dict):
                cycle.scope["state"][SENT_STATUS_KEY] = sent
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()
        t0 = armed_at if phase is not None else self.loop.time()
        refusal = Refusal(reason=reason, what=what, status=sent, in_request=cycle is not None,
                          duration_s=max(0.0, self.loop.time() - t0), received=received)
        for hook in self.on_refused:
            hook(refusal)


def _header_timeout_message(seconds: float, held: int, idle_s: float) -> str:
    """What the client is told when its request line and headers did not end in time: nothing came, bytes
    still came (too slow), or bytes came and then stopped without the empty line that ends the headers (a
    corrupted line end, or a client that stopped sending): the server cannot tell those two apart, so it
    says what it saw rather than calling the headers truncated."""
    if held == 0:
        return f"no request arrived within {seconds:g} s"
    if idle_s < min(1.0, seconds / 2):
        return (f"the request line and headers came too slowly: {held} bytes in {seconds:g} s, still without "
                "the empty line that ends them")
    return (f"the request line and headers did not end within {seconds:g} s: {held} bytes came, then nothing for "
            f"{idle_s:.1f} s, and no empty line (CRLF CRLF) ends them (a malformed or corrupted line end, or a "
            "request the client did not finish)")


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def guarded_protocol(serve: ServeSettings, on_refused: Callable[[Refusal], None] | None = None) -> type[H11Protocol]:
    """The protocol class uvicorn should use for ``serve``'s timeouts and connection limit; ``on_refused`` is
    told of every connection it answers or closes itself."""
    return type("FluxH11Protocol", (GuardedH11Protocol,), {
        "header_timeout_s": serve.header_timeout_s, "body_timeout_s": serve.body_timeout_s,
        "max_connections": serve.max_connections, "on_refused": (on_refused,) if on_refused else ()})
