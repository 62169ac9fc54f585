"""Request models of the OpenAI-compatible API, and the one body parser every POST route uses.

Unknown fields are ignored (clients send vendor extensions); known fields are checked strictly: a wrong
type or an out-of-range value is a 400 naming the field (``param``), never a coerced guess. ``null`` means
"not given" everywhere, as OpenAI's own clients send it.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine_bridge.sampling import SamplingParams
from server.errors import InvalidRequest

MAX_STOPS = 4
MAX_STOP_CHARS = 512
MAX_TOKENS_LIMIT = 2**31 - 1
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_TOOLS = 128  # OpenAI's limit

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True, allow_inf_nan=False)


class StreamOptions(_Req):
    """``stream_options``."""

    include_usage: bool | None = None


class TextPart(_Req):
    """A text part of a message's content (the only kind this server runs)."""

    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class CalledFunction(_Req):
    """The function of a past tool call: ``arguments`` is JSON text (OpenAI) or an object."""

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class PastToolCall(_Req):
    """A tool call of an earlier assistant turn, sent back with the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Req):
    """One chat message."""

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[PastToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        for key in ("name", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


class FunctionSpec(_Req):
    """A function the model may call: ``parameters`` is the JSON schema of its arguments."""

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Req):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionSpec


class ChosenFunction(_Req):
    """``tool_choice.function``."""

    name: str = Field(min_length=1)


class NamedToolChoice(_Req):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: that function must be called."""

    type: Literal["function"]
    function: ChosenFunction


class TextFormat(_Req):
    """``response_format: {"type": "text"}``."""

    type: Literal["text"]


class JsonObjectFormat(_Req):
    """``response_format: {"type": "json_object"}``: the reply is a JSON object."""

    type: Literal["json_object"]


class JsonSchemaSpec(_Req):
    """``response_format.json_schema``."""

    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(_Req):
    """``response_format: {"type": "json_schema", "json_schema": {...}}``: the reply is valid for the schema."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


_SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)


def _nullable_knobs(schema: dict[str, Any]) -> None:
    """The JSON schema says what the body takes: a sampling knob may be ``null`` (left out)."""
    props = schema.get("properties", {})
    for name in _SAMPLING_FIELDS & props.keys():
        prop = props[name]
        if "anyOf" not in prop:
            keep = {k: prop.pop(k) for k in ("default", "description", "title") if k in prop}
            props[name] = {"anyOf": [prop, {"type": "null"}], **keep}


class Sampling(SamplingParams):
    """Fields shared by chat and text completions. The sampling knobs are :class:`SamplingParams`' own fields
    (the same names, ranges and defaults; ``null`` leaves one at its default): :meth:`sampling` gives them."""

    model_config = ConfigDict(**_Req.model_config, json_schema_extra=_nullable_knobs)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=128)
    stream: bool | None = None
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _unset_nulls(cls, data: Any) -> Any:
        """A sampling knob sent as ``null`` is one left out (OpenAI's clients send them so)."""
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in _SAMPLING_FIELDS):
            return {k: v for k, v in data.items() if v is not None or k not in _SAMPLING_FIELDS}
        return data

    def sampling(self) -> SamplingParams:
        """The request's sampling, every knob decided (a default where the request left one out)."""
        return SamplingParams.model_construct(self.model_fields_set & _SAMPLING_FIELDS,
                                              **{k: getattr(self, k) for k in _SAMPLING_FIELDS})

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences are allowed, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be 1 to {MAX_STOP_CHARS} characters")
        return v

    @field_validator("n")
    @classmethod
    def _one(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("only n=1 is supported")
        return v

    def stops(self) -> list[str]:
        """The stop sequences as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        """Whether a streamed reply ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    def reply_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name) or ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(v, list) and v and isinstance(v[0], str) and len(v) != 1:
            raise ValueError("only one prompt per request is supported")
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        if isinstance(v, list) and isinstance(v[0], int) and any(t < 0 for t in v):
            raise ValueError("token ids must not be negative")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (fill-in-the-middle) is not supported")
        return v

    def reply_limit(self) -> int | None:
        """``max_tokens``."""
        return self.max_tokens


class AdmissionRequest(BaseModel):
    """``POST /flux/admission``."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
    host_reserve_percent: float = Field(ge=0, le=99)


M = TypeVar("M", bound=BaseModel)
_BRANCHES = frozenset({"str", "int", "float", "bool", "function-after", "function-before"})
_TAGGED = {"response_format": frozenset({"text", "json_object", "json_schema"})}  # discriminated unions
# A lone surrogate can only come from a JSON escape (the body is valid UTF-8): \uD800-\uDFFF
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _field_path(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """A pydantic error location without union branches (``stop.str``, ``tool_choice.NamedToolChoice``) and
    discriminator tags (``response_format.json_schema.json_schema`` names ``response_format.json_schema``)."""
    out: list[int | str] = []
    for i, p in enumerate(loc):
        if isinstance(p, str) and ("[" in p or p in _BRANCHES or p[:1].isupper()):
            continue
        if i == 1 and isinstance(p, str) and p in _TAGGED.get(str(loc[0]), ()):
            continue
        out.append(p)
    return tuple(out)


def _param(loc: tuple[int | str, ...]) -> str | None:
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _first_error(exc: ValidationError) -> InvalidRequest:
    """A 400 naming the first invalid field; union branches are folded into one message."""
    errors = exc.errors(include_url=False)
    # Union branches add the branch type to the location ("stop.str", "stop.list[str]"): drop them; the
    # deepest error names the field best (an image part: messages[0].content[0].type, not "not a string").
    locs = [_field_path(tuple(e["loc"])) for e in errors]
    k = max(range(len(errors)), key=lambda i: len(locs[i]))
    first = errors[k]
    param = _param(locs[k])
    msg = first["msg"]
    if first["type"] == "missing":
        msg = "required field is missing"
    text = f"{param}: {msg}" if param else msg
    return InvalidRequest(f"Invalid request: {text}" + (f" (and {len(errors) - 1} more problems)"
                                                        if len(errors) > 1 else ""), param=param,
                          code="invalid_value" if first["type"] != "missing" else "missing_required_parameter")


def _not_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate(value: Any) -> tuple[int | str, ...] | None:
    """Where in a parsed JSON value a string (or an object's key) holds a lone UTF-16 surrogate, None if
    nowhere: such text is not Unicode, and neither the engine nor a grammar can take it. Iterative, as the
    value may be nested as deeply as the JSON parser allows."""
    stack: list[tuple[tuple[int | str, ...], Any]] = [((), value)]
    while stack:
        loc, v = stack.pop()
        if isinstance(v, str):
            if _not_unicode(v):
                return loc
        elif isinstance(v, dict):
            if any(_not_unicode(key) for key in v):
                return loc
            stack.extend(((*loc, key), item) for key, item in reversed(v.items()))  # popped in order
        elif isinstance(v, list):
            stack.extend(((*loc, i), item) for i, item in reversed(list(enumerate(v))))
    return None


def _check_unicode(text: str, value: dict[str, Any]) -> None:
    """400 naming the first field whose text holds a lone surrogate (``"\\ud800"`` sent as a JSON escape)."""
    if not _SURROGATE_ESCAPE.search(text):
        return
    loc = lone_surrogate(value)
    if loc is None:
        return
    param = _param(loc)
    raise InvalidRequest(f"Invalid request: {param or 'the request body'} holds a lone UTF-16 surrogate (a "
                         "\\ud800-\\udfff escape without its pair), which is not Unicode text: send surrogates in "
                         "pairs, or the character itself",
                         param=param, code="invalid_value")


def parse_body(raw: bytes, model: type[M]) -> M:
    """Parse a JSON request body into ``model``.

    Raises:
        InvalidRequest: empty body, invalid UTF-8, malformed JSON, not an object, text with a lone UTF-16
            surrogate, or an invalid field.
    """
    if not raw.strip():
        raise InvalidRequest("the request body is empty: send a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid UTF-8 (byte {exc.start})", code="invalid_json") from exc
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column "
                             f"{exc.colno}", code="invalid_json") from exc
    except RecursionError as exc:
        raise InvalidRequest("the request body is not valid JSON: nested too deeply", code="invalid_json") from exc
    except ValueError as exc:  # a number Python will not convert (an integer of more than 4,300 digits)
        raise InvalidRequest(f"the request body holds a number that cannot be read: {exc}",
                             code="invalid_json") from exc
    if not isinstance(value, dict):
        raise InvalidRequest(f"the request body must be a JSON object, got {type(value).__name__}",
                             code="invalid_json")
    _check_unicode(text, value)
    try:
        return model.model_validate(value, strict=True)  # the parsed value: a 100 KB agent request is parsed once
    except ValidationError as exc:
        raise _first_error(exc) from exc
    except (ValueError, RecursionError) as exc:
        raise InvalidRequest(f"invalid request: {exc}", code="invalid_json") from exc
