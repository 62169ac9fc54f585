"""Typed errors of the server and the ONE place that turns any failure into an OpenAI error body.

Every 4xx/5xx the server sends has the body ``{"error": {"message", "type", "param", "code"}}``: the
server's own :class:`ApiError` family, engine errors (``WorkerDied`` and friends), Litestar's
``ValidationException``/``HTTPException`` (unknown route, wrong method, body too large) and anything
unexpected (500, logged with its traceback). Decisions use types and fields, never exception text.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from artifacts.errors import FluxError
from engine_bridge.errors import EngineCode, EngineError
from server.transport import sent_status

log = logging.getLogger(__name__)


class ServeSetupError(FluxError):
    """``flux serve`` cannot start as asked (a busy port, an empty key, ...): one line, exit 2."""


class ApiError(Exception):
    """An error with an HTTP status and OpenAI's error fields."""

    status = 500
    type = "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        super().__init__(message)

    def body(self) -> dict[str, Any]:
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(ApiError):
    """A request the server will not run as sent (HTTP 400)."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """The prompt plus the reply room it must leave does not fit the context (HTTP 400, before generating)."""

    def __init__(self, prompt_tokens: int, reply_tokens: int, n_ctx: int, *, at_least: bool = False) -> None:
        self.prompt_tokens = prompt_tokens
        self.reply_tokens = reply_tokens
        self.n_ctx = n_ctx
        n = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
        super().__init__(
            f"This model's maximum context length is {n_ctx} tokens. However, your messages resulted in {n} "
            f"tokens and the reply needs room for {reply_tokens} more ({n} + {reply_tokens} > {n_ctx}). "
            "Please reduce the length of the messages or max_tokens.",
            code="context_length_exceeded", param="messages")


class PagesExhausted(ContextLengthExceeded):
    """The prompt plus its reply room fits a sequence but not the KV pages free now (HTTP 400
    ``context_length_exceeded``, before generating): other requests hold the rest, or the pool is smaller."""

    def __init__(self, prompt_tokens: int, reply_tokens: int, n_ctx: int, free_tokens: int, total_tokens: int) -> None:
        InvalidRequest.__init__(
            self, f"This request needs KV pages for {prompt_tokens + reply_tokens} tokens ({prompt_tokens} prompt + "
            f"{reply_tokens} reply room), and the free pages hold {free_tokens} tokens now ({total_tokens} in all, "
            "shared by the requests running at once). Please reduce the length of the messages or max_tokens, or "
            "retry when other requests have ended.", code="context_length_exceeded", param="messages")
        self.prompt_tokens = prompt_tokens
        self.reply_tokens = reply_tokens
        self.n_ctx = n_ctx
        self.free_tokens = free_tokens
        self.total_tokens = total_tokens


class Unauthorized(ApiError):
    """A missing or wrong API key (HTTP 401)."""

    status = 401
    type = "invalid_request_error"

    def __init__(self) -> None:
        super().__init__("Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key the "
                         "server was started with.", code="invalid_api_key")


class NotFound(ApiError):
    """An unknown model, route or request id (HTTP 404)."""

    status = 404
    type = "invalid_request_error"


class Conflict(ApiError):
    """A request id that a running request already uses (HTTP 409)."""

    status = 409
    type = "invalid_request_error"


class QueueFull(ApiError):
    """Every sequence is busy and the wait queue is full (HTTP 429)."""

    status = 429
    type = "rate_limit_error"

    def __init__(self, queued: int, retry_after_s: int) -> None:
        super().__init__(f"the server is at capacity ({queued} requests already wait for a sequence): "
                         f"retry after {retry_after_s} s", code="queue_full",
                         headers={"Retry-After": str(retry_after_s)})


class Unavailable(ApiError):
    """The server cannot take the request now: queue wait timed out, worker restarting, host memory low (503)."""

    status = 503
    type = "server_error"

    def __init__(self, message: str, *, code: str, retry_after_s: int) -> None:
        super().__init__(f"{message}: retry after {retry_after_s} s", code=code,
                         headers={"Retry-After": str(retry_after_s)})


class EngineFailed(ApiError):
    """The engine failed while running the request (HTTP 502/504/500)."""

    type = "server_error"

    def __init__(self, message: str, *, code: str, status: int) -> None:
        super().__init__(message, code=code)
        self.status = status


# Each engine code's HTTP answer, declared once: "invalid" 400 invalid_value, "context" 400
# context_length_exceeded, "unavailable" 503 with Retry-After, "died" 502, "timeout" 504, "failed" 500 (the
# engine's code kept). tests/server/test_errors.py checks that every EngineCode has one.
EngineAnswer = Literal["invalid", "context", "unavailable", "died", "timeout", "failed"]
ENGINE_HTTP: dict[EngineCode, EngineAnswer] = {
    "bad_request": "invalid", "bad_grammar": "invalid", "bad_params": "failed", "bad_override": "failed",
    "context_overflow": "context",
    "busy": "unavailable", "not_loaded": "unavailable", "rpc_unavailable": "unavailable",
    "worker_died": "died", "worker_timeout": "timeout",
    "decode_failed": "failed", "sampling_failed": "failed", "load_failed": "failed", "model_missing": "failed",
    "probe_failed": "failed", "validation_failed": "failed", "routing_unreadable": "failed",
    "routing_mismatch": "failed", "expert_split_mismatch": "failed", "unknown_op": "failed", "internal": "failed",
    "protocol_mismatch": "failed", "llama_server": "failed", "engine_error": "failed",
}


def from_engine(exc: EngineError) -> ApiError:
    """The API error for an engine error, by its code (:data:`ENGINE_HTTP`)."""
    answer = ENGINE_HTTP.get(exc.code, "failed")
    if answer == "died":
        return EngineFailed(f"{exc.message}; the request was not completed: send it again (the server restarts "
                            "the worker)", code="worker_died", status=502)
    if answer == "timeout":
        return EngineFailed(f"{exc.message}; the worker was restarted: send the request again",
                            code="worker_timeout", status=504)
    if answer == "invalid":
        return InvalidRequest(f"the engine refused the request: {exc.message}", code="invalid_value")
    if answer == "context":
        return InvalidRequest(exc.message, code="context_length_exceeded", param="messages")
    if answer == "unavailable":
        return Unavailable(f"the engine is not ready ({exc.message})", code=exc.code, retry_after_s=1)
    return EngineFailed(f"the engine failed: {exc.message}", code=exc.code, status=500)


def _param(loc: Any) -> str | None:
    """'messages[0].role' from a pydantic/Litestar error location."""
    if not loc:
        return None
    parts = [str(p) for p in (loc if isinstance(loc, list | tuple) else [loc])]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


def _validation(exc: ValidationException) -> ApiError:
    """The first problem Litestar found (query/path parameters)."""
    extra = exc.extra if isinstance(exc.extra, list) else []
    first = extra[0] if extra and isinstance(extra[0], dict) else {}
    param = _param(first.get("key"))
    message = str(first.get("message") or exc.detail)
    return InvalidRequest(f"{param}: {message}" if param else message, param=param)


_HTTP: dict[int, tuple[str, str]] = {
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
}


def to_api_error(exc: Exception) -> ApiError:
    """Map any exception to the API error it is reported as."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine(exc)
    if isinstance(exc, ValidationException):
        return _validation(exc)
    if isinstance(exc, HTTPException):
        err_type, code = _HTTP.get(exc.status_code, ("invalid_request_error" if exc.status_code < 500
                                                      else "server_error", "http_error"))
        out = ApiError(str(exc.detail), code=code, headers=exc.headers)
        out.status, out.type = exc.status_code, err_type
        return out
    log.exception("unexpected error while serving a request", exc_info=exc)
    return ApiError(f"internal server error ({type(exc).__name__}); see the server log", code="internal_error")


def error_response(request: Request[Any, Any, Any], exc: Exception) -> Response[dict[str, Any]]:
    """Litestar exception handler: every error as OpenAI's error body, counted by the status its client gets
    (the transport's own 408 when it cut a slow body: this response then reaches nobody)."""
    err = to_api_error(exc)
    svc: Any = request.app.state.get("flux")  # the FluxService (not imported: server.service imports this module)
    if svc is not None:
        svc.counters.error_response(sent_status(request.scope) or err.status)
    headers = dict(err.headers)
    rid = request.scope.get("state", {}).get("request_id")
    if rid:
        headers["x-request-id"] = rid
    return Response(content=err.body(), status_code=err.status, headers=headers, media_type="application/json")


EXCEPTION_HANDLERS: dict[type[Exception] | int, Any] = {Exception: error_response, HTTPException: error_response,
                                                        ApiError: error_response, EngineError: error_response}


def error_event(exc: Exception) -> dict[str, Any]:
    """The SSE ``data:`` payload for an error that ends a stream."""
    return to_api_error(exc).body()
