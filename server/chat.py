"""Chat prompts from the model's own template (``tokenizer.chat_template`` in the GGUF), rendered with jinja2.

Rendered the way llama-cpp-python's ``Jinja2ChatFormatter`` and Hugging Face's transformers do: a
sandboxed environment with ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text, ``bos_token``/``eos_token`` and
``add_generation_prompt=True``. The rendered text already holds the template's special tokens, so it is
tokenized with special tokens parsed and no BOS added.

Tools reach the template as ``tools`` (OpenAI's list). What a template can do is probed once, as
llama-server's ``common_chat_templates`` caps do, by rendering small conversations
(:class:`TemplateCaps`); the messages are then adjusted the way llama-server adjusts them: ``developer``
becomes ``system``, a system turn a template drops is merged into the next message, and a tool call's
``arguments`` string becomes an object when the template writes objects as JSON.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from artifacts.gguf_header import read_header
from server.errors import InvalidRequest

log = logging.getLogger(__name__)

# Used only when a GGUF has no template: ChatML, which most instruction-tuned GGUFs without one expect.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class _GenerationTag(jinja2.ext.Extension):
    """Pass-through for Hugging Face's ``{% generation %}`` tag."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> str:
    raise TemplateRefused(message)


class TemplateRefused(Exception):
    """The template itself rejected the conversation (``raise_exception``)."""


class ChatTemplate:
    """A compiled chat template with the model's BOS/EOS texts."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        """Compile ``source``.

        Raises:
            jinja2.TemplateSyntaxError: the template does not compile.
        """
        env = ImmutableSandboxedEnvironment(loader=jinja2.BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                                            extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = env.from_string(source)
        self.caps = TemplateCaps.probe(self)

    def raw(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The template's text for ``messages`` as given (jinja2 errors propagate)."""
        return self._template.render(
            messages=list(messages), bos_token=self.bos_token, eos_token=self.eos_token, add_generation_prompt=True,
            raise_exception=_raise, strftime_now=lambda f: datetime.now().strftime(f), tools=tools or None,
            functions=None)

    def render(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The prompt text for ``messages`` (and ``tools``), ending where the assistant's reply starts.

        Raises:
            InvalidRequest: the template refuses the conversation (e.g. roles that do not alternate) or
                cannot render it.
        """
        try:
            return self.raw(self.caps.adjust(messages), tools)
        except TemplateRefused as exc:
            raise InvalidRequest(f"the model's chat template refused these messages: {exc}",
                                 param="messages", code="invalid_messages") from exc
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise InvalidRequest(f"the model's chat template cannot render these messages: "
                                 f"{type(exc).__name__}: {exc}", param="messages", code="invalid_messages") from exc


def _token_text(metadata: dict[str, Any], key: str) -> str | None:
    """The text of a special token from the header's vocabulary, when the header kept the list."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    tid = metadata.get(key)
    if isinstance(tokens, list) and isinstance(tid, int) and 0 <= tid < len(tokens):
        return str(tokens[tid])
    return None


class TemplateInfo:
    """What the server needs from the GGUF header for chat: template source and special token texts."""

    def __init__(self, model_path: Path) -> None:
        """Read the header of ``model_path`` (first shard)."""
        md = read_header(model_path).metadata
        source = md.get("tokenizer.chat_template")
        self.has_template = isinstance(source, str) and bool(source.strip())
        if not self.has_template:
            log.warning("%s has no tokenizer.chat_template: chat prompts use ChatML", model_path.name)
        self.source = source if isinstance(source, str) and self.has_template else FALLBACK_TEMPLATE
        self.bos_id = md.get("tokenizer.ggml.bos_token_id") if isinstance(
            md.get("tokenizer.ggml.bos_token_id"), int) else None
        self.eos_id = md.get("tokenizer.ggml.eos_token_id") if isinstance(
            md.get("tokenizer.ggml.eos_token_id"), int) else None
        self.bos_text = _token_text(md, "tokenizer.ggml.bos_token_id")
        self.eos_text = _token_text(md, "tokenizer.ggml.eos_token_id")


_PROBE_TOOL = {"type": "function", "function": {
    "name": "flux_probe_tool", "description": "Tool description",
    "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}, "required": ["arg"]}}}
_MARK = "flux-probe-7f3a"


def _probe_call(i: int, arguments: Any) -> dict[str, Any]:
    return {"id": f"call0000{i}", "type": "function", "function": {"name": f"flux_probe_call{i}", "arguments": arguments}}


@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template renders, found by rendering probe conversations (llama-server's caps)."""

    system_role: bool = True
    tools: bool = False
    tool_calls: bool = False
    object_arguments: bool = False
    parallel_tool_calls: bool = False

    @classmethod
    def probe(cls, template: ChatTemplate) -> TemplateCaps:
        """Render a few conversations with ``template`` and see what comes out."""
        def out(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
            try:
                return template.raw(messages, tools)
            except Exception:  # noqa: BLE001 - a template that fails on a probe lacks that capability
                return ""

        user: dict[str, Any] = {"role": "user", "content": "User message"}
        system = out([{"role": "system", "content": _MARK}, user])
        tools = out([user], [_PROBE_TOOL])
        calls: list[dict[str, Any]] = [user, {"role": "assistant", "content": "", "tool_calls": [_probe_call(1, {"arg": _MARK})]},
                 {"role": "tool", "tool_call_id": "call00001", "content": "Tool response"}]
        with_object = out(calls, [_PROBE_TOOL])
        parallel: list[dict[str, Any]] = [user, {"role": "assistant", "content": "", "tool_calls": [
            _probe_call(1, json.dumps({"arg": _MARK})), _probe_call(2, json.dumps({"arg": _MARK}))]},
            {"role": "tool", "tool_call_id": "call00001", "content": "r1"},
            {"role": "tool", "tool_call_id": "call00002", "content": "r2"}]
        two = out(parallel, [_PROBE_TOOL])
        return cls(system_role=_MARK in system, tools="flux_probe_tool" in tools,
                   tool_calls="flux_probe_call1" in with_object or "flux_probe_call1" in two,
                   object_arguments=f'"arg": "{_MARK}"' in with_object or f'"arg":"{_MARK}"' in with_object,
                   parallel_tool_calls="flux_probe_call1" in two and "flux_probe_call2" in two)

    def adjust(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Messages as this template wants them (llama-server's workarounds)."""
        out = [_for_template(m, self.object_arguments) for m in messages]
        if not self.system_role and out and out[0].get("role") == "system":
            first = out.pop(0)
            if out:
                out[0] = {**out[0], "content": f"{first['content']}\n{out[0]['content']}"}
        return out


def _for_template(message: dict[str, Any], object_arguments: bool) -> dict[str, Any]:
    """``content: null`` as "" (templates concatenate it), ``developer`` as ``system``, and tool-call
    arguments as objects when the template writes them as JSON."""
    m = {**message, "content": message.get("content") or ""}
    if m.get("role") == "developer":
        m["role"] = "system"
    if object_arguments and m.get("tool_calls"):
        m["tool_calls"] = [_object_arguments(c) for c in m["tool_calls"]]
    return m


def _object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the string as sent
    return {**call, "function": {**fn, "arguments": args}} if isinstance(args, dict) else call
