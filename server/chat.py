"""Chat prompts from the model's own template (``tokenizer.chat_template`` in the GGUF), rendered with jinja2.

Rendered the way llama-cpp-python's ``Jinja2ChatFormatter`` and Hugging Face's transformers do: a
sandboxed environment with ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text, ``bos_token``/``eos_token`` and
``add_generation_prompt=True``. The rendered text already holds the template's special tokens, so it is
tokenized with special tokens parsed and no BOS added.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
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

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        """The prompt text for ``messages``, ending where the assistant's reply starts.

        Raises:
            InvalidRequest: the template refuses the conversation (e.g. roles that do not alternate) or
                cannot render it.
        """
        try:
            return self._template.render(
                messages=[_content_or_empty(m) for m in messages], bos_token=self.bos_token, eos_token=self.eos_token,
                add_generation_prompt=True, raise_exception=_raise,
                strftime_now=lambda f: datetime.now().strftime(f), tools=None, functions=None)
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


def _content_or_empty(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn with tool calls may carry ``content: null``; templates concatenate it (as llama-server)."""
    if message.get("content") is None:
        return {**message, "content": ""}
    return message
