"""HTTP routes: the OpenAI API under /v1, resume and cancel of requests, Flux's own /flux, /metrics, /health.

Streams are Server-Sent Events: ``id: N`` + ``data: {chunk}`` per event, ``data: [DONE]`` at the end. A
streaming reply is the request's journal followed live from event 0; ``GET /v1/requests/{id}/events``
follows the same journal from ``after`` (or ``Last-Event-ID``). A client going away does not stop the
generation (it runs on into the journal, for a resume); ``DELETE /v1/requests/{id}`` does.
"""

from __future__ import annotations

import hmac
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from litestar import Request, Response, delete, get, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath, QueryParameter
from litestar.response import Stream
from litestar.router import Router

from engine_bridge.serve_trace import PARQUET_MEDIA_TYPE, parquet_bytes
from server.access import GEN_KEY, RID_KEY
from server.errors import InvalidRequest, NotFound, Unauthorized
from server.generation import Generation
from server.journal import Entry
from server.metrics import CONTENT_TYPE
from server.openapi import body_operation, openapi_json
from server.schemas import AdmissionRequest, ChatRequest, CompletionRequest, parse_body
from server.service import FluxService

AnyRequest = Request[Any, Any, Any]
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def _svc(request: AnyRequest) -> FluxService:
    svc: FluxService = request.app.state.flux
    return svc


def _sse_event(index: int, data: str) -> str:
    return f"id: {index}\ndata: {data}\n\n"


async def _follow(svc: FluxService, entry: Entry, after: int, gen: Generation | None,
                  own: bool = False) -> AsyncIterator[str]:
    """SSE text of the journal after ``after``; while it is followed, a running generation is not orphaned
    (its own client counts from the start; a resuming one from here)."""
    if gen is not None and not own:
        gen.attach()
    try:
        async for ready in svc.journal.follow(entry, after):  # one write for the events already there
            yield "".join(_sse_event(index, data) for index, data in ready)
        yield "data: [DONE]\n\n"
    finally:
        if gen is not None:
            gen.detach()


async def _reply(request: AnyRequest, gen: Generation) -> Response[Any]:
    """A stream that follows the journal, or the whole response once the generation ended."""
    request.scope["state"][GEN_KEY] = gen
    headers = {"x-request-id": gen.spec.rid}
    if gen.spec.stream:
        return Stream(_follow(_svc(request), gen.entry, 0, gen, own=True), media_type="text/event-stream",
                      headers={**SSE_HEADERS, **headers})
    try:
        await gen.wait()
    finally:
        gen.detach()
    if gen.error is not None:
        raise gen.error
    return Response(gen.response(), headers=headers)


def _request_id(request: AnyRequest, kind: str) -> str:
    rid = _svc(request).request_id(request.headers.get("x-request-id"), "chat" if kind == "chat" else "text")
    request.scope["state"][RID_KEY] = rid
    return rid


@post("/chat/completions", status_code=200, operation_class=body_operation(ChatRequest))
async def chat_completions(request: AnyRequest) -> Response[Any]:
    """OpenAI chat completions (streamed or not)."""
    arrived, rid = time.monotonic(), _request_id(request, "chat")
    return await _reply(request, await _svc(request).chat(rid, await request.body(), arrived))


@post("/completions", status_code=200, operation_class=body_operation(CompletionRequest))
async def completions(request: AnyRequest) -> Response[Any]:
    """OpenAI (legacy) text completions (streamed or not)."""
    arrived, rid = time.monotonic(), _request_id(request, "text")
    return await _reply(request, await _svc(request).text(rid, await request.body(), arrived))


def _models(svc: FluxService) -> dict[str, Any]:
    """The model list, each card's ``meta`` naming the chat template (``chat_template``: a built-in's name,
    ``gguf`` or the file; ``chat_template_origin``: the flag, ``gguf``, or how the family's was chosen)."""
    body = svc.models()
    for card in body["data"]:
        card.setdefault("meta", {}).update(svc.template.meta())
    return body


@get("/models")
async def list_models(request: AnyRequest) -> dict[str, Any]:
    """The served model, with its context limit and chat template."""
    return _models(_svc(request))


@get("/models/{model_id:str}")
async def get_model(request: AnyRequest, model_id: FromPath[str]) -> dict[str, Any]:
    """One model card (404 model_not_found for another id)."""
    svc = _svc(request)
    svc.check_model(model_id)
    card: dict[str, Any] = _models(svc)["data"][0]
    return card


@get("/requests/{rid:str}/events")
async def request_events(request: AnyRequest, rid: FromPath[str],
                         after: Annotated[int | None, QueryParameter(ge=0)] = None) -> Stream:
    """Resume a request's events: every event with index > ``after`` (or ``Last-Event-ID``), live if running."""
    svc = _svc(request)
    start = after if after is not None else _last_event_id(request.headers.get("last-event-id"))
    entry = svc.journal.get(rid)
    if entry is None:
        raise NotFound(f"request '{rid}' is unknown or its journal expired (kept {svc.journal.ttl_s:g} s after "
                       "completion): send the request again", code="request_not_found", param="rid")
    return Stream(_follow(svc, entry, start, svc.running.get(rid)), media_type="text/event-stream",
                  headers={**SSE_HEADERS, "x-request-id": rid})


@delete("/requests/{rid:str}", status_code=200)
async def cancel_request(request: AnyRequest, rid: FromPath[str]) -> dict[str, Any]:
    """Cancel a request now: a running one stops (its journal keeps what it wrote), a queued one never starts;
    either ends with finish_reason 'length' and flux.finish_reason 'cancelled'."""
    return _svc(request).cancel(rid)


def _last_event_id(value: str | None) -> int:
    if value is None or value.strip() == "":
        return 0
    try:
        n = int(value.strip())
    except ValueError:
        raise InvalidRequest("Last-Event-ID must be an event index (an integer)", param="Last-Event-ID") from None
    if n < 0:
        raise InvalidRequest("Last-Event-ID must not be negative", param="Last-Event-ID")
    return n


@get("/stats")
async def flux_stats(request: AnyRequest) -> dict[str, Any]:
    """Memory by use, requests by outcome, tokens/s, queue, host reserve."""
    return await _svc(request).stats()


@get("/routing")
async def flux_routing(request: AnyRequest) -> Response[bytes]:
    """The served routing trace (Parquet): the expert picks counted for this plan, for `flux plan --routing-from`."""
    svc = _svc(request)
    await svc.routing.look(svc.engine)
    table = svc.routing.table()
    if table is None:
        raise NotFound("no expert picks counted yet: the server counts a MoE model's decode steps "
                       "([serve.routing] sample_every) on the native engine", code="routing_not_counted")
    name = f"{svc.plan.id[:12]}-routing.parquet"
    return Response(parquet_bytes(table), media_type=PARQUET_MEDIA_TYPE,
                    headers={"content-disposition": f'attachment; filename="{name}"'})


@post("/admission", status_code=200, operation_class=body_operation(AdmissionRequest))
async def flux_admission(request: AnyRequest) -> dict[str, Any]:
    """Override the host memory reserve until the server restarts."""
    svc = _svc(request)
    req = parse_body(await request.body(), AdmissionRequest)
    svc.host_reserve_percent = req.host_reserve_percent
    return {"host_reserve_percent": svc.host_reserve_percent}


@get("/metrics")
async def metrics(request: AnyRequest) -> Response[bytes]:
    """Prometheus metrics (names as llama-server's where they mean the same)."""
    return Response(await _svc(request).metrics_text(), media_type=CONTENT_TYPE)


@get("/health")
async def health(request: AnyRequest) -> Response[dict[str, Any]]:
    """Liveness: 200 with the worker's state and plan id; 503 while the worker (or an RPC server of the plan)
    is down."""
    body = _svc(request).health()
    return Response(body, status_code=200 if body["status"] == "ok" else 503)


def api_key_guard(key: str | None) -> Any:
    """A guard that wants ``Authorization: Bearer <key>`` (none when ``key`` is None)."""

    def guard(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
        if key is None:
            return
        auth = connection.headers.get("authorization", "")
        scheme, _sep, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise Unauthorized()

    return guard


def routers(api_key: str | None) -> list[Any]:
    """The app's route handlers; /v1, /flux and /metrics want the API key when one is set (not /health, nor
    the OpenAPI document)."""
    guard = api_key_guard(api_key)
    v1 = Router(path="/v1", route_handlers=[chat_completions, completions, list_models, get_model, request_events,
                                            cancel_request], guards=[guard])
    flux = Router(path="/flux", route_handlers=[flux_stats, flux_routing, flux_admission], guards=[guard])
    return [v1, flux, Router(path="/", route_handlers=[metrics], guards=[guard]), health, openapi_json]
