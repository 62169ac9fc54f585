"""Chat templates from the GGUF header, rendered like llama-cpp-python / transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.chat import FALLBACK_TEMPLATE, ChatTemplate, TemplateInfo
from server.errors import InvalidRequest


def test_template_comes_from_the_gguf(tiny_moe: Path) -> None:
    info = TemplateInfo(tiny_moe)
    assert info.has_template and "im_start" in info.source
    t = ChatTemplate(info.source, info.bos_text or "", info.eos_text or "")
    out = t.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}])
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_template_helpers_match_transformers() -> None:
    src = ("{{ bos_token }}{% for m in messages %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}"
           "{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ strftime_now('%Y') | length }}")
    out = ChatTemplate(src, bos_token="<s>").render([{"content": "é"}, {"content": "b"}, {"content": "c"}])
    assert out == '<s>"é""b"4'


def test_template_refusal_is_400() -> None:
    src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    with pytest.raises(InvalidRequest) as exc:
        ChatTemplate(src).render([{"role": "assistant", "content": "x"}])
    assert exc.value.status == 400 and "first message must be user" in exc.value.message
    with pytest.raises(InvalidRequest):
        ChatTemplate("{{ messages[5]['content'] + 1 }}").render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_attribute_escapes() -> None:
    with pytest.raises(InvalidRequest):
        ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}").render([])


def test_fallback_is_chatml() -> None:
    out = ChatTemplate(FALLBACK_TEMPLATE).render([{"role": "user", "content": "hi"}])
    assert out.endswith("<|im_start|>assistant\n")


def test_messages_are_adjusted_as_llama_server_does(tiny_moe_template: str) -> None:
    t = ChatTemplate(tiny_moe_template)
    out = t.render([{"role": "developer", "content": "Rules."}, {"role": "user", "content": "hi"}])
    assert out.startswith("<|im_start|>system\nRules.<|im_end|>"), "developer is system"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
    out = t.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert '{"name": "f", "arguments": {"a": 1}}' in out, "arguments as an object, written by the template's tojson"
    no_system = ChatTemplate("{% for m in messages %}{% if m.role != 'system' %}[{{ m.content }}]{% endif %}"
                             "{% endfor %}")
    assert not no_system.caps.system_role
    assert no_system.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]) == "[S\nU]"
