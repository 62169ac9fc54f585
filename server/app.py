"""The Litestar app: a small factory; the lifespan owns the engine worker."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from litestar import Litestar

from artifacts.config import Settings
from server.errors import EXCEPTION_HANDLERS
from server.routes import routers
from server.service import FluxService
from tasks.models import Plan

log = logging.getLogger(__name__)

MIN_BODY_BYTES = 16 * 2**20
BODY_BYTES_PER_CTX_TOKEN = 32  # a whole context of text with JSON escaping fits


def create_app(settings: Settings, plan: Plan, api_key: str | None = None) -> Litestar:
    """The OpenAI-compatible app for ``plan``; the worker starts when the app starts.

    Args:
        settings: the process's settings (serve.*, timeouts, logs_dir).
        plan: a plan already checked against this machine.
        api_key: when set, /v1 and /flux want ``Authorization: Bearer <api_key>``.
    """
    service = FluxService(settings, plan)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        info = await service.start()
        app.state.flux = service
        log.info("serving plan %s (%s): n_ctx %d, %d sequences", plan.id[:12], plan.model_name, info.n_ctx,
                 info.n_seq_max)
        try:
            yield
        finally:
            await service.close()

    max_body = max(MIN_BODY_BYTES, (plan.candidate.params.n_ctx * BODY_BYTES_PER_CTX_TOKEN))
    return Litestar(route_handlers=routers(api_key), lifespan=[lifespan], exception_handlers=EXCEPTION_HANDLERS,
                    request_max_body_size=max_body, openapi_config=None)
