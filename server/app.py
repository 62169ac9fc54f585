"""The Litestar app: a small factory; the lifespan owns the engine worker."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from litestar import Litestar
from litestar.datastructures import State
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from artifacts.config import Settings
from artifacts.records.plan import Plan
from server import access
from server.chat import ChatTemplate, TemplateInfo, TemplateOverride
from server.errors import EXCEPTION_HANDLERS
from server.openapi import openapi_config
from server.routes import routers
from server.service import FluxService
from server.tools.formats import detect_format

log = logging.getLogger(__name__)

MIN_BODY_BYTES = 2**20
BODY_BYTES_PER_CTX_TOKEN = 32  # a whole context of text with JSON escaping fits


class ClientWriteTimeout(Exception):
    """A client took nothing of its response for ``client_write_timeout_s``."""


def client_write_timeout(timeout_s: float) -> Callable[[ASGIApp], ASGIApp]:
    """ASGI middleware: a response write that waits on its client longer than ``timeout_s`` ends the response.

    A client that stops reading a stream makes the server's writes wait once the socket's buffers are
    full. After ``timeout_s`` the response is abandoned, which closes the connection; as for any client
    that goes away, the generation runs on into the journal for a resuming reader (and is cancelled if
    nobody follows it for the journal's TTL).
    """

    def wrap(app: ASGIApp) -> ASGIApp:
        async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            timed_out = False

            async def timed_send(message: Message) -> None:
                nonlocal timed_out
                try:
                    async with asyncio.timeout(timeout_s):
                        await send(message)
                except TimeoutError:
                    timed_out = True
                    raise ClientWriteTimeout from None

            try:
                await app(scope, receive, timed_send)
            except Exception:
                if not timed_out:  # Litestar re-raises it wrapped (the response had started): match the flag
                    raise
                log.warning("%s %s: the client read nothing for %g s (serve.client_write_timeout_s); "
                            "closed its connection", scope.get("method"), scope.get("path"), timeout_s)

        return middleware

    return wrap


def max_body_bytes(settings: Settings, plan: Plan) -> int:
    """The largest request body: ``serve.max_body_bytes``, or enough for a whole context of text."""
    if settings.serve.max_body_bytes:
        return settings.serve.max_body_bytes
    return max(MIN_BODY_BYTES, plan.candidate.params.n_ctx * BODY_BYTES_PER_CTX_TOKEN)


def create_app(settings: Settings, plan: Plan, api_key: str | None = None, model_path: Path | None = None,
               chat_template: TemplateOverride | None = None) -> Litestar:
    """The OpenAI-compatible app for ``plan``; the worker starts when the app starts.

    Args:
        settings: the process's settings (serve.*, timeouts, logs_dir).
        plan: a plan already checked against this machine.
        api_key: when set, /v1, /flux and /metrics want ``Authorization: Bearer <api_key>``.
        model_path: the plan's model at another path (already checked to hold the same bytes).
        chat_template: ``--chat-template``/``--chat-template-file``, used instead of the GGUF's template.
    """
    service = FluxService(settings, plan, model_path)
    if chat_template is not None:  # before the worker starts, as the service sets up the GGUF's own
        info = service.template = TemplateInfo(service.model_path, chat_template)
        service.tool_format = detect_format(info.source)
        service._set_template(ChatTemplate(info.source, info.bos_text or "", info.eos_text or ""))
    access.configure(settings.serve.access_log)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        info = await service.start()
        log.info("serving plan %s (%s): n_ctx %d, %d sequences", plan.id[:12], plan.model_name, info.n_ctx,
                 info.n_seq_max)
        try:
            yield
        finally:
            await service.close()

    app = Litestar(route_handlers=routers(api_key), lifespan=[lifespan], exception_handlers=EXCEPTION_HANDLERS,
                   request_max_body_size=max_body_bytes(settings, plan), openapi_config=openapi_config(),
                   state=State({"flux": service}),
                   middleware=[client_write_timeout(settings.serve.client_write_timeout_s)])
    # Litestar runs an app's middleware for matched routes only: around the whole handler, the access log also
    # sees the router's own answers (404 no such route, 405 wrong method), which it counts as errors
    app.asgi_handler = access.access_log(app.asgi_handler)
    return app
