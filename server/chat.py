"""Chat prompts from the model's own template (``tokenizer.chat_template`` in the GGUF), rendered with jinja2.

Rendered the way llama-cpp-python's ``Jinja2ChatFormatter`` and Hugging Face's transformers do: a
sandboxed environment with ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text, ``bos_token``/``eos_token`` and
``add_generation_prompt=True``. The rendered text already holds the template's special tokens, so it is
tokenized with special tokens parsed and no BOS added.

Which template: ``flux serve --chat-template NAME`` (one of llama.cpp's built-ins, llama-server's names) or
``--chat-template-file PATH`` (Jinja), else the GGUF's own, else its family's built-in
(:mod:`server.chat_templates`; llama-server would use ChatML). :class:`TemplateInfo` says which and why.

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
from typing import Any, Literal

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from artifacts.errors import ModelFileError
from artifacts.gguf_header import read_header
from engine_bridge.bos import adds_bos
from server.chat_templates import BUILTIN_TEMPLATES, builtin_source, family_template, vocabulary_markers
from server.errors import InvalidRequest, ServeSetupError

log = logging.getLogger(__name__)

# ChatML: llama-server's template for a GGUF without one; Flux's for one whose family it cannot tell.
FALLBACK_TEMPLATE = BUILTIN_TEMPLATES["chatml"]


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


TemplateOrigin = Literal["gguf", "--chat-template", "--chat-template-file", "architecture", "vocabulary",
                         "tokenizer", "default"]


@dataclass(frozen=True)
class TemplateOverride:
    """A chat template given to ``flux serve``: a built-in's name, or a Jinja file's path and text."""

    name: str
    file_text: str | None = None

    @property
    def origin(self) -> TemplateOrigin:
        """The flag it came from."""
        return "--chat-template" if self.file_text is None else "--chat-template-file"


def template_file(path: Path) -> TemplateOverride:
    """A Jinja chat template file, checked by rendering one user message.

    Raises:
        ServeSetupError: the file cannot be read, does not compile, or does not render a user's message.
    """
    where = f"--chat-template-file {path}"
    try:
        text = path.expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ServeSetupError(f"{where}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from exc
    try:
        template = ChatTemplate(text, "<s>", "</s>")
    except jinja2.TemplateSyntaxError as exc:
        raise ServeSetupError(f"{where}: not a Jinja template: line {exc.lineno}: {exc.message}") from exc
    probe = "flux-template-check"
    try:
        out = template.render([{"role": "user", "content": probe}])
    except InvalidRequest as exc:
        raise ServeSetupError(f"{where}: does not render a user message: {exc.message}") from exc
    if probe not in out:
        raise ServeSetupError(f"{where}: renders a user message without its text (it wrote {out[:80]!r}): "
                              "it must write messages[i]['content']")
    return TemplateOverride(str(path), text)


class TemplateInfo:
    """What the server needs from the GGUF header for chat: template source and special token texts, and which
    template that is (``name``: the built-in's name, ``gguf`` or the file) and why (``origin``, ``reason``)."""

    def __init__(self, model_path: Path, override: TemplateOverride | None = None, quiet: bool = False) -> None:
        """Read the header of ``model_path`` (first shard); ``override`` is ``flux serve``'s flag; ``quiet``
        keeps the warning a GGUF without a template gets (``flux show`` says it its own way)."""
        header = read_header(model_path)
        md = header.metadata
        source = md.get("tokenizer.chat_template")
        self.has_template = isinstance(source, str) and bool(source.strip())
        self.origin: TemplateOrigin
        if override is not None:
            self.name, self.origin = override.name, override.origin
            self.source = override.file_text if override.file_text is not None else builtin_source(
                override.name, adds_bos(md))
            self.reason = f"from {override.origin}"
        elif isinstance(source, str) and self.has_template:
            self.name, self.origin, self.source = "gguf", "gguf", source
            self.reason = "the GGUF's own (tokenizer.chat_template)"
        else:
            family = family_template(md, vocabulary_markers(model_path, md, header.metadata_end))
            self.name, self.origin, self.source = family.name, family.origin, builtin_source(family.name, adds_bos(md))
            self.reason = f"{family.reason} (the GGUF has none)"
            if not quiet:
                log.warning("%s has no tokenizer.chat_template: chat prompts use llama.cpp's built-in %r template, "
                            "%s%s; `flux serve --chat-template NAME` or --chat-template-file PATH sets another",
                            model_path.name, family.name, family.reason,
                            "" if family.name == "chatml" else " (llama-server would use ChatML)")
        self.bos_id = md.get("tokenizer.ggml.bos_token_id") if isinstance(
            md.get("tokenizer.ggml.bos_token_id"), int) else None
        self.eos_id = md.get("tokenizer.ggml.eos_token_id") if isinstance(
            md.get("tokenizer.ggml.eos_token_id"), int) else None
        self.bos_text = _token_text(md, "tokenizer.ggml.bos_token_id")
        self.eos_text = _token_text(md, "tokenizer.ggml.eos_token_id")

    def describe(self) -> str:
        """One line: the template and why (``flux show``, the server's log)."""
        if self.origin == "gguf":
            return self.reason
        what = "a Jinja file" if self.origin == "--chat-template-file" else "llama.cpp's built-in"
        return f"{self.name}: {what}, {self.reason}"

    def meta(self) -> dict[str, str]:
        """What ``GET /v1/models`` reports in a card's ``meta``."""
        return {"chat_template": self.name, "chat_template_origin": self.origin}


def template_line(model_path: Path) -> str:
    """``flux show``'s line: the chat template ``flux serve`` renders this model's chats with (no template flag)."""
    try:
        info = TemplateInfo(model_path, quiet=True)
    except (ModelFileError, OSError) as exc:
        return f"chat template: unknown ({exc})"
    return f"chat template: {info.describe()}"


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
