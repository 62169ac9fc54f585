"""llama.cpp's built-in chat templates as Jinja, the family's template for a GGUF without one, and the BOS rule.

The built-ins are compared with llama.cpp's own ``llama_chat_apply_template`` (the pinned build's), and the
BOS rule with its vocabulary's ``llama_vocab_get_add_bos``, on twins edited to hold each case.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
from gguf_edit import edited_gguf

from artifacts.gguf_header import read_header
from artifacts.synth import synthesize
from engine_bridge.bos import adds_bos, bos_id, with_bos
from server.chat import ChatTemplate, TemplateInfo, TemplateOverride, template_file, template_line
from server.chat_templates import (
    BUILTIN_TEMPLATES,
    builtin_source,
    check_name,
    family_template,
    marker_tokens,
    vocabulary_markers,
)
from server.errors import ServeSetupError

NO_TEMPLATE = ("tokenizer.chat_template",)
NO_CHATML = {"<|im_start|>": "<|xx_start|>", "<|im_end|>": "<|xx_end|>"}
CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": " Be brief.\n"}, {"role": "user", "content": "\tHi there \x0b"}],
    [{"role": "system", "content": "S1"}, {"role": "system", "content": "S2 "}, {"role": "user", "content": "u1"},
     {"role": "assistant", "content": " a1 \n"}, {"role": "user", "content": "u2"}],
    [{"role": "user", "content": "u1"}, {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "t1"},
     {"role": "user", "content": "é 你好 \u00a0"}],
    [{"role": "assistant", "content": "first"}, {"role": "user", "content": "then"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
    [{"role": "system", "content": "only a system turn"}],
]


def llama_cpp_render(name: str, messages: list[dict[str, str]]) -> str:
    """llama.cpp's rendering of ``messages`` with its built-in ``name``, the reply to follow."""
    chat = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, m in enumerate(messages):
        role, content = m["role"].encode(), m["content"].encode()
        keep += [role, content]
        chat[i].role, chat[i].content = role, content
    n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(messages), True, None, 0)
    assert n >= 0, f"llama.cpp does not know {name}"
    buf = ctypes.create_string_buffer(n + 1)
    llama_cpp.llama_chat_apply_template(name.encode(), chat, len(messages), True, buf, n + 1)
    return buf.raw[:n].decode()


def llama_cpp_builtins() -> list[str]:
    """``llama_chat_builtin_templates``."""
    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    names = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(names, n)
    return sorted(x.decode() for x in names if x is not None)


def llama_cpp_vocab(path: Path) -> tuple[bool, int]:
    """(add_bos, bos id) of llama.cpp's vocabulary of the GGUF at ``path`` (a vocab-only load)."""
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, path
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        return bool(llama_cpp.llama_vocab_get_add_bos(vocab)), int(llama_cpp.llama_vocab_bos(vocab))
    finally:
        llama_cpp.llama_model_free(model)


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """tiny-dense (llama) and tiny-gemma3 twins."""
    d = tmp_path_factory.mktemp("twins")
    out = {}
    for preset in ("tiny-dense", "tiny-gemma3"):
        out[preset] = d / f"{preset}.gguf"
        synthesize(preset, out[preset], quant="Q4_0")
    yield out


def test_every_llama_cpp_builtin_is_here_by_its_name() -> None:
    assert sorted(BUILTIN_TEMPLATES) == llama_cpp_builtins()


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_a_builtin_renders_what_llama_cpp_renders(name: str) -> None:
    template = ChatTemplate(BUILTIN_TEMPLATES[name])
    for messages in CONVERSATIONS:
        assert template.raw(messages) == llama_cpp_render(name, messages), (name, messages)


def test_a_builtin_starts_with_bos_where_llama_cpp_adds_it() -> None:
    hello = [{"role": "user", "content": "Hello"}]
    assert ChatTemplate(builtin_source("llama3", add_bos=True), bos_token="<|begin_of_text|>").render(hello) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ChatTemplate(builtin_source("gemma", add_bos=False), bos_token="<bos>").render(hello) == (
        "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n")


def test_a_bad_name_lists_the_names() -> None:
    assert check_name("llama3") == "llama3"
    with pytest.raises(ValueError) as exc:
        check_name("llama-3")
    assert "'llama-3'" in str(exc.value) and all(n in str(exc.value) for n in BUILTIN_TEMPLATES)


def _md(arch: str, model: str = "gpt2", pre: str = "") -> dict[str, Any]:
    return {"general.architecture": arch, "tokenizer.ggml.model": model, "tokenizer.ggml.pre": pre}


@pytest.mark.parametrize(("metadata", "tokens", "name", "origin"), [
    (_md("gemma3", "llama"), {"<|im_start|>", "<|im_end|>"}, "gemma", "architecture"),
    (_md("qwen3moe"), set(), "chatml", "architecture"),
    (_md("phi3", "llama"), set(), "phi3", "architecture"),
    (_md("llama"), {"<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>"}, "chatml", "vocabulary"),
    (_md("llama", pre="llama-bpe"), {"<|start_header_id|>", "<|end_header_id|>"}, "llama3", "vocabulary"),
    (_md("llama", "llama"), {"[INST]", "[/INST]"}, "mistral-v3", "vocabulary"),
    (_md("llama", pre="tekken"), {"[INST]", "[/INST]", "[SYSTEM_PROMPT]"}, "mistral-v7-tekken", "vocabulary"),
    (_md("deepseek2", pre="deepseek-v3"), {"<｜User｜>", "<｜Assistant｜>"}, "deepseek3", "vocabulary"),
    (_md("llama", pre="llama-bpe"), set(), "llama3", "tokenizer"),
    (_md("llama", pre="deepseek-coder"), set(), "deepseek", "tokenizer"),
    (_md("llama", "llama"), set(), "llama2-sys", "tokenizer"),
    (_md("llama", pre="qwen2"), set(), "llama3", "tokenizer"),
    (_md("deepseek2"), set(), "deepseek2", "tokenizer"),
    (_md("mpt"), set(), "chatml", "default"),
])
def test_the_family_template(metadata: dict[str, Any], tokens: set[str], name: str, origin: str) -> None:
    family = family_template(metadata, tokens)
    assert (family.name, family.origin) == (name, origin), family


def test_the_vocabulary_is_searched_in_the_header_bytes_when_the_reader_dropped_it(twins: dict[str, Path]) -> None:
    path = twins["tiny-dense"]
    h = read_header(path)
    listed = vocabulary_markers(path, h.metadata, h.metadata_end)
    assert listed == {"<|im_start|>", "<|im_end|>"} and listed <= marker_tokens()
    scanned = {k: v for k, v in h.metadata.items() if k != "tokenizer.ggml.tokens"}  # as for a 150k vocabulary
    assert vocabulary_markers(path, scanned, h.metadata_end) == listed


def test_a_gguf_without_a_template_gets_its_family_s(twins: dict[str, Path], tmp_path: Path) -> None:
    gemma = TemplateInfo(edited_gguf(twins["tiny-gemma3"], tmp_path / "g.gguf", drop=NO_TEMPLATE))
    assert (gemma.name, gemma.origin, gemma.has_template) == ("gemma", "architecture", False)
    assert gemma.describe() == "gemma: llama.cpp's built-in, the gemma3 architecture's (the GGUF has none)"
    assert gemma.meta() == {"chat_template": "gemma", "chat_template_origin": "architecture"}
    out = ChatTemplate(gemma.source).render([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    assert out == "<start_of_turn>user\nS\n\nHi<end_of_turn>\n<start_of_turn>model\n" and "<|im_start|>" not in out
    # a llama twin's vocabulary holds ChatML's control tokens: ChatML is its family's; without them, Llama 3's
    dense = TemplateInfo(edited_gguf(twins["tiny-dense"], tmp_path / "d.gguf", drop=NO_TEMPLATE))
    assert (dense.name, dense.origin) == ("chatml", "vocabulary")
    plain = TemplateInfo(edited_gguf(twins["tiny-dense"], tmp_path / "p.gguf", drop=NO_TEMPLATE, rename_tokens=NO_CHATML,
                                     bools={"tokenizer.ggml.add_bos_token": True}))
    assert (plain.name, plain.origin) == ("llama3", "tokenizer")
    assert plain.bos_text == "<|endoftext|>" and plain.source.startswith("{{ bos_token }}"), "BOS where it is added"
    assert template_line(tmp_path / "p.gguf") == ("chat template: llama3: llama.cpp's built-in, the llama "
                                                  "architecture's family of a BPE tokenizer (the GGUF has none)")


def test_the_gguf_s_own_template_and_the_overrides(twins: dict[str, Path], tmp_path: Path) -> None:
    own = TemplateInfo(twins["tiny-gemma3"])
    assert (own.name, own.origin) == ("gguf", "gguf") and "<|im_start|>" in own.source
    assert template_line(twins["tiny-gemma3"]) == "chat template: the GGUF's own (tokenizer.chat_template)"
    named = TemplateInfo(twins["tiny-gemma3"], TemplateOverride("llama3"))
    assert (named.name, named.origin) == ("llama3", "--chat-template") and "<|start_header_id|>" in named.source
    assert named.describe() == "llama3: llama.cpp's built-in, from --chat-template"
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}<<assistant>>")
    from_file = TemplateInfo(twins["tiny-gemma3"], template_file(f))
    assert (from_file.name, from_file.origin) == (str(f), "--chat-template-file")
    assert ChatTemplate(from_file.source).render([{"role": "user", "content": "Hi"}]) == "<<user>>Hi<<assistant>>"


@pytest.mark.parametrize(("text", "says"), [
    (None, "cannot read it (No such file or directory)"),
    ("{% for m in messages %}", "not a Jinja template: line 1"),
    ("{{ raise_exception('no users here') }}", "does not render a user message: the model's chat template refused "
                                               "these messages: no users here"),
    ("{{ messages[0].content + 1 }}", "does not render a user message"),
    ("{% for m in messages %}[{{ m.role }}]{% endfor %}", "renders a user message without its text"),
])
def test_a_template_file_that_cannot_serve_is_one_line(tmp_path: Path, text: str | None, says: str) -> None:
    f = tmp_path / "bad.jinja"
    if text is not None:
        f.write_text(text)
    with pytest.raises(ServeSetupError) as exc:
        template_file(f)
    assert says in str(exc.value) and "\n" not in str(exc.value) and str(f) in str(exc.value)


@pytest.mark.parametrize(("bools", "strings"), [
    ({}, {}),  # gpt2 + qwen2 pre, no key: no BOS
    ({"tokenizer.ggml.add_bos_token": True}, {}),
    ({"tokenizer.ggml.add_bos_token": False}, {"tokenizer.ggml.pre": "llama-bpe"}),
    ({}, {"tokenizer.ggml.pre": "llama-bpe"}),  # llama3's pre-tokenizer: BOS by default
])
def test_the_bos_rule_is_llama_cpp_s(twins: dict[str, Path], tmp_path: Path, bools: dict[str, bool],
                                     strings: dict[str, str]) -> None:
    path = edited_gguf(twins["tiny-dense"], tmp_path / "m.gguf", drop=("tokenizer.ggml.add_bos_token",),
                       bools=bools, strings=strings)
    md = read_header(path).metadata
    add, bos = llama_cpp_vocab(path)
    assert (adds_bos(md), bos_id(md)) == (add, bos)
    assert with_bos(md, [5, 6]) == ([bos, 5, 6] if add else [5, 6])
