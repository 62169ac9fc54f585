"""OpenAI response shapes: streamed chunks and whole responses, for chat and text completions.

One builder per kind (a registry keyed by the kind, not an if-chain). Builders are pure: the generation
feeds them text pieces and the worker's token events (for logprobs).

``finish_reason`` is always one of OpenAI's values, which typed clients check (the ``openai`` package's models
allow "stop", "length", "tool_calls", "content_filter", "function_call"). A reason of Flux's own that OpenAI
lacks goes out as the OpenAI value that means the same to a client (:data:`OPENAI_FINISH`), and is named in
the choice's extension field ``flux: {"finish_reason": ...}``, which OpenAI clients keep as an extra field.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from typing import Any, Literal

from engine_bridge.ops import TokenEvent

Kind = Literal["chat", "text"]
ToolCallBody = dict[str, Any]  # {"id", "type": "function", "function": {"name", "arguments"}}

# A cancelled reply (DELETE /v1/requests/{id}, or nobody followed it) was cut before its end, as a reply cut by
# max_tokens is: "length" tells a client the text is incomplete, where "stop" would claim the model ended it.
OPENAI_FINISH: dict[str, str] = {"cancelled": "length"}


def finish_fields(reason: str | None) -> dict[str, Any]:
    """A choice's ``finish_reason`` as OpenAI clients accept it, and Flux's own reason in ``flux`` when the two
    differ (``{"finish_reason": "length", "flux": {"finish_reason": "cancelled"}}``)."""
    if reason is None:
        return {"finish_reason": None}
    wire = OPENAI_FINISH.get(reason, reason)
    return {"finish_reason": wire} if wire == reason else {"finish_reason": wire, "flux": {"finish_reason": reason}}


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


class Builder(ABC):
    """Chunks and responses of one request."""

    kind: Kind = "chat"
    chunk_object = "chat.completion.chunk"
    object = "chat.completion"

    def __init__(self, rid: str, model: str, fingerprint: str, logprobs: bool, top_logprobs: int) -> None:
        """Build for request ``rid`` answering as ``model``."""
        self.rid = rid
        self.model = model
        self.fingerprint = fingerprint
        self.logprobs = logprobs
        self.top_logprobs = top_logprobs
        self.created = int(time.time())
        self.echo_chars = 0  # text completions: the echoed prompt comes before the first token

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def first(self) -> dict[str, Any] | None:
        """The chunk that opens a stream, if the kind has one."""
        return None

    @abstractmethod
    def piece(self, text: str, tokens: list[TokenEvent]) -> dict[str, Any]:
        """A chunk carrying generated text (and its tokens' logprobs)."""

    @abstractmethod
    def finish(self, reason: str) -> dict[str, Any]:
        """The chunk carrying the finish reason."""

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk, with usage and no choices (``stream_options.include_usage``)."""
        return {**self._head(self.chunk_object), "choices": [], "usage": usage}

    def tool_call(self, index: int, call: ToolCallBody, tokens: list[TokenEvent]) -> dict[str, Any]:
        """A chunk carrying a tool call, whole or a piece of it (only chat replies have them)."""
        raise NotImplementedError(f"{self.kind} completions have no tool calls")

    @abstractmethod
    def response(self, text: str, tokens: list[TokenEvent], reason: str, usage: dict[str, Any],
                 tool_calls: list[ToolCallBody] | None = None) -> dict[str, Any]:
        """The whole (non-streamed) response."""


class ChatBuilder(Builder):
    """``chat.completion`` / ``chat.completion.chunk``."""

    def _lp(self, tokens: list[TokenEvent]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        return {"content": [{
            "token": t["text"], "logprob": t["logprob"] if t["logprob"] is not None else 0.0,
            "bytes": t.get("bytes") or _bytes(t["text"]),
            "top_logprobs": [{"token": a["text"], "logprob": a["logprob"], "bytes": a["bytes"] or _bytes(a["text"])}
                             for a in t["top_logprobs"][: self.top_logprobs]],
        } for t in tokens], "refusal": None}

    def _chunk(self, delta: dict[str, Any], lp: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
        return {**self._head(self.chunk_object),
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, **finish_fields(reason)}]}

    def first(self) -> dict[str, Any] | None:
        """``delta: {role: assistant, content: ""}``."""
        return self._chunk({"role": "assistant", "content": ""}, None, None)

    def piece(self, text: str, tokens: list[TokenEvent]) -> dict[str, Any]:
        """``delta: {content}``."""
        return self._chunk({"content": text}, self._lp(tokens), None)

    def tool_call(self, index: int, call: ToolCallBody, tokens: list[TokenEvent]) -> dict[str, Any]:
        """``delta: {tool_calls: [{index, ...call}]}``: a whole call (id, type, function name and arguments), a
        call's start (its arguments still empty), or a piece of its arguments (``{function: {arguments}}``)."""
        return self._chunk({"tool_calls": [{"index": index, **call}]}, self._lp(tokens), None)

    def finish(self, reason: str) -> dict[str, Any]:
        """Empty delta with the finish reason."""
        return self._chunk({}, None, reason)

    def response(self, text: str, tokens: list[TokenEvent], reason: str, usage: dict[str, Any],
                 tool_calls: list[ToolCallBody] | None = None) -> dict[str, Any]:
        """``chat.completion`` (``content`` is null when the reply is only tool calls, as OpenAI's)."""
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None,
                                   "refusal": None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {**self._head(self.object), "usage": usage,
                "choices": [{"index": 0, "message": message, "logprobs": self._lp(tokens), **finish_fields(reason)}]}


class TextBuilder(Builder):
    """``text_completion`` (streamed chunks have the same object name)."""

    kind: Kind = "text"
    chunk_object = "text_completion"
    object = "text_completion"

    def __init__(self, rid: str, model: str, fingerprint: str, logprobs: bool, top_logprobs: int) -> None:
        """As :class:`Builder`; tracks the text offset of each token for logprobs."""
        super().__init__(rid, model, fingerprint, logprobs, top_logprobs)
        self._offset = 0

    def _lp(self, tokens: list[TokenEvent], offset: int) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t["text"])
        return {"tokens": [t["text"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
                "top_logprobs": [{a["text"]: a["logprob"] for a in t["top_logprobs"][: self.top_logprobs]}
                                 for t in tokens], "text_offset": offsets}

    def _chunk(self, text: str, lp: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
        return {**self._head(self.chunk_object),
                "choices": [{"index": 0, "text": text, "logprobs": lp, **finish_fields(reason)}]}

    def piece(self, text: str, tokens: list[TokenEvent]) -> dict[str, Any]:
        """``choices[0].text``."""
        lp = self._lp(tokens, self._offset)
        self._offset += len(text)
        return self._chunk(text, lp, None)

    def finish(self, reason: str) -> dict[str, Any]:
        """Empty text with the finish reason."""
        return self._chunk("", None, reason)

    def response(self, text: str, tokens: list[TokenEvent], reason: str, usage: dict[str, Any],
                 tool_calls: list[ToolCallBody] | None = None) -> dict[str, Any]:
        """``text_completion``."""
        return {**self._head(self.object), "usage": usage,
                "choices": [{"index": 0, "text": text, "logprobs": self._lp(tokens, self.echo_chars),
                             **finish_fields(reason)}]}


BUILDERS: dict[Kind, type[Builder]] = {"chat": ChatBuilder, "text": TextBuilder}
