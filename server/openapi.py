"""The server's own OpenAPI document: Litestar's, with the request bodies the routes parse themselves.

The POST routes read their body as bytes and parse it with :func:`server.schemas.parse_body` (one parser,
OpenAI's error body for every mistake), so Litestar cannot see what they take. Each declares its body
model with ``operation_class=body_operation(Model)``: the operation's ``requestBody`` is the model's JSON
schema (pydantic's, references inlined, so each operation stands alone in the document). The document is
served at ``/openapi.json`` and ``/schema/openapi.json`` (``/schema`` too), without the API key: it says
what the server takes, not what it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from litestar import Request, get
from litestar.enums import OpenAPIMediaType
from litestar.openapi.config import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import Operation
from pydantic import BaseModel

_REF_PREFIX = "#/$defs/"


def _inline(node: Any, defs: dict[str, Any], within: frozenset[str] = frozenset()) -> Any:
    """``node`` with every ``#/$defs/X`` reference replaced by X's schema (a model that contains itself keeps
    its reference, which nothing here does); discriminator mappings name references, so they go too."""
    if isinstance(node, list):
        return [_inline(x, defs, within) for x in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith(_REF_PREFIX) and ref[len(_REF_PREFIX):] not in within:
        name = ref[len(_REF_PREFIX):]
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return _inline({**defs[name], **rest}, defs, within | {name})
    return {k: _inline(v, defs, within) for k, v in node.items() if k not in ("$defs", "discriminator")}


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The JSON schema of a request body ``model`` as its fields are sent (aliases), self-contained."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    out: dict[str, Any] = _inline(schema, schema.get("$defs", {}))
    return out


def body_operation(model: type[BaseModel], media_type: str = "application/json") -> type[Operation]:
    """An operation class whose ``requestBody`` is ``model`` (for a route that parses its own body)."""
    body = {"required": True, "content": {media_type: {"schema": body_schema(model)}}}

    @dataclass
    class BodyOperation(Operation):
        def to_schema(self) -> dict[str, Any]:
            return {**super().to_schema(), "requestBody": body}

    BodyOperation.__name__ = BodyOperation.__qualname__ = f"{model.__name__}Operation"
    return BodyOperation


def _flux_version() -> str:
    try:
        return version("flux")
    except PackageNotFoundError:
        return "dev"


def openapi_config() -> OpenAPIConfig:
    """Litestar's OpenAPI settings: the JSON document under ``/schema`` (no UI: it would load scripts from a
    CDN); :func:`openapi_json` serves it at ``/openapi.json`` too."""
    return OpenAPIConfig(title="Flux", version=_flux_version(), path="/schema", use_handler_docstrings=True,
                         description="An OpenAI-compatible server of one measured plan (docs/serving.md).",
                         render_plugins=[JsonRenderPlugin()])


@get("/openapi.json", include_in_schema=False, media_type=OpenAPIMediaType.OPENAPI_JSON, sync_to_thread=False)
def openapi_json(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """The OpenAPI document, where most tools look for it first."""
    return request.app.openapi_schema.to_schema()
