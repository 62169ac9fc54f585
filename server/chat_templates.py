"""llama.cpp's built-in chat templates as Jinja, by llama-server's names, and which one a GGUF without its own gets.

llama-server's ``--chat-template NAME`` takes the names of llama.cpp's built-in templates (``LLM_CHAT_TEMPLATES``
in ``src/llama-chat.cpp``; ``llama_chat_builtin_templates``), rendered there by ``llm_chat_apply_template``
in C++. Flux renders every chat prompt with jinja2 (:class:`server.chat.ChatTemplate`, the template's caps
probed, tools shown), so each built-in is written here as the Jinja that yields the same text, byte for byte
(``tests/server/test_chat_templates.py`` compares them with llama.cpp's on many conversations). llama-server
tokenizes such a prompt adding BOS when the model asks for one; :func:`builtin_source` writes ``bos_token``
first in that case, as Flux tokenizes chat prompts without adding it.

A GGUF without ``tokenizer.chat_template`` gets ChatML from llama-server; Flux picks the family's template
instead (:func:`family_template`). Where an architecture is one family's (gemma3: ``gemma``, phi3: ``phi3``,
qwen3moe: ``chatml``) the architecture decides. Where several families share one (``llama`` holds Llama 2
and 3, Mistral, Yi, OpenHermes...), the vocabulary's control tokens tell which, the way llama.cpp's
``llm_chat_detect_template`` tells templates apart by their markers: a family whose markers are not tokens
of the model would make it read them as text and write them back. Then the tokenizer decides (a SentencePiece
llama is Llama 2's, a BPE one Llama 3's), and ChatML is left only for an architecture no family claims.

Light on purpose (no jinja2, no Litestar): ``flux serve``'s flags are built from :data:`BUILTIN_TEMPLATES`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# C++'s isspace(), what llama-chat.cpp's trim() strips (str.strip() would also strip other Unicode spaces)
_TRIM = r"|trim(' \t\n\x0b\x0c\r')"
_C = "m['content']"
_CT = f"({_C}{_TRIM})"


def _each(body: str, generation: str = "") -> str:
    """A template writing ``body`` per message (``m``), then ``generation`` when the reply is to follow."""
    tail = f"{{% if add_generation_prompt %}}{{{{ '{generation}' }}}}{{% endif %}}" if generation else ""
    return f"{{% for m in messages %}}{body}{{% endfor %}}{tail}"


def _role_cases(cases: dict[str, str], other: str = "") -> str:
    """An if-chain on ``m['role']``: each role's expression; ``other`` for any other role (none: nothing)."""
    parts = [f"{{% {'if' if i == 0 else 'elif'} m['role'] == '{role}' %}}{{{{ {expr} }}}}"
             for i, (role, expr) in enumerate(cases.items())]
    return "".join(parts) + (f"{{% else %}}{{{{ {other} }}}}" if other else "") + "{% endif %}"


def _mistral_v7(space: str) -> str:
    return _each(_role_cases({"system": f"'[SYSTEM_PROMPT]{space}' + {_C} + '[/SYSTEM_PROMPT]'",
                              "user": f"'[INST]{space}' + {_C} + '[/INST]'"}, other=f"'{space}' + {_C} + '</s>'"))


def _mistral_v1_v3(leading: str, trailing: str, trim_reply: bool) -> str:
    reply = _CT if trim_reply else _C
    return ("{% set ns = namespace(inside=false) %}" + _each(
        f"{{% if not ns.inside %}}{{{{ '{leading}[INST]{trailing}' }}}}{{% set ns.inside = true %}}{{% endif %}}"
        f"{{% if m['role'] == 'system' %}}{{{{ {_C} + '\\n\\n' }}}}"
        f"{{% elif m['role'] == 'user' %}}{{{{ {_C} + '{leading}[/INST]' }}}}"
        f"{{% else %}}{{{{ '{trailing}' + {reply} + '</s>' }}}}{{% set ns.inside = false %}}{{% endif %}}"))


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    c = _CT if strip else _C
    sys_expr = f"'<<SYS>>\\n' + {c} + '\\n<</SYS>>\\n\\n'" if system else f"{c} + '\\n'"
    return ("{{ '[INST] ' }}{% set ns = namespace(inside=true) %}" + _each(
        f"{{% if not ns.inside %}}{{% set ns.inside = true %}}{{{{ '{'<s>' if bos_inside else ''}[INST] ' }}}}"
        f"{{% endif %}}{{% if m['role'] == 'system' %}}{{{{ {sys_expr} }}}}"
        f"{{% elif m['role'] == 'user' %}}{{{{ {c} + ' [/INST]' }}}}"
        f"{{% else %}}{{{{ {c} + '</s>' }}}}{{% set ns.inside = false %}}{{% endif %}}"))


def _bailing(think: bool) -> str:
    return _each("{{ '<role>' + ('HUMAN' if m['role'] == 'user' else m['role']|upper) + '</role>' + "
                 f"{_C} }}}}", "<role>ASSISTANT</role>" + ("<think>" if think else ""))


def _granite() -> str:
    return _each("{% if m['role'] == 'assistant_tool_call' %}{{ '<|start_of_role|>assistant<|end_of_role|>"
                 "<|tool_call|>' }}{% else %}{{ '<|start_of_role|>' + m['role'] + '<|end_of_role|>' }}{% endif %}"
                 f"{{{{ {_C} + '<|end_of_text|>\\n' }}}}", "<|start_of_role|>assistant<|end_of_role|>")


def _per_role(tags: dict[str, tuple[str, str]], trim: bool, generation: str) -> str:
    """Each listed role's text between its prefix and suffix (other roles: nothing)."""
    c = _CT if trim else _C
    return _each(_role_cases({r: f"'{pre}' + {c} + '{post}'" for r, (pre, post) in tags.items()}), generation)


_EXAONE3 = {"system": ("[|system|]", "[|endofturn|]\\n"), "user": ("[|user|]", "\\n"),
            "assistant": ("[|assistant|]", "[|endofturn|]\\n")}
_HY_HOLDER3 = "<｜hy_place▁holder▁no▁3｜>"

# name -> Jinja; names and order as llama.cpp's LLM_CHAT_TEMPLATES
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": _each(f"{{{{ '<|im_start|>' + m['role'] + '\\n' + {_C} + '<|im_end|>\\n' }}}}",
                    "<|im_start|>assistant\\n"),
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral_v1_v3(" ", " ", trim_reply=False),
    "mistral-v3": _mistral_v1_v3("", " ", trim_reply=True),
    "mistral-v3-tekken": _mistral_v1_v3("", "", trim_reply=False),
    "mistral-v7": _mistral_v7(" "),
    "mistral-v7-tekken": _mistral_v7(""),
    "phi3": _each(f"{{{{ '<|' + m['role'] + '|>\\n' + {_C} + '<|end|>\\n' }}}}", "<|assistant|>\\n"),
    "phi4": _each(f"{{{{ '<|im_start|>' + m['role'] + '<|im_sep|>' + {_C} + '<|im_end|>' }}}}",
                  "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _each(f"{{{{ '<|' + m['role'] + '|>\\n' + {_C} + '\\n' }}}}", "<|assistant|>\\n"),
    "zephyr": _each(f"{{{{ '<|' + m['role'] + '|>\\n' + {_C} + '<|endoftext|>\\n' }}}}", "<|assistant|>\\n"),
    "monarch": _each(f"{{{{ ('' if loop.first else '<s>') + m['role'] + '\\n' + {_C} + '</s>\\n' }}}}",
                     "<s>assistant\\n"),
    # system turns are merged into the next user turn (trimmed, joined without a separator)
    "gemma": "{% set ns = namespace(system='') %}" + _each(
        f"{{% if m['role'] == 'system' %}}{{% set ns.system = ns.system + {_CT} %}}{{% else %}}"
        "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
        "{{ '<start_of_turn>' + role + '\\n' }}{% if ns.system and role != 'model' %}"
        "{{ ns.system + '\\n\\n' }}{% set ns.system = '' %}{% endif %}"
        f"{{{{ {_CT} + '<end_of_turn>\\n' }}}}{{% endif %}}", "<start_of_turn>model\\n"),
    "orion": "{% set ns = namespace(system='') %}" + _each(
        f"{{% if m['role'] == 'system' %}}{{% set ns.system = ns.system + {_C} %}}"
        "{% elif m['role'] == 'user' %}{{ 'Human: ' }}{% if ns.system %}{{ ns.system + '\\n\\n' }}"
        f"{{% set ns.system = '' %}}{{% endif %}}{{{{ {_C} + '\\n\\nAssistant: </s>' }}}}"
        f"{{% else %}}{{{{ {_C} + '</s>' }}}}{{% endif %}}"),
    "openchat": _each(_role_cases({"system": f"{_C} + '<|end_of_turn|>'"}, other=(
        f"'GPT4 Correct ' + (m['role'][:1]|upper) + m['role'][1:] + ': ' + {_C} + '<|end_of_turn|>'")),
        "GPT4 Correct Assistant:"),
    "vicuna": _per_role({"system": ("", "\\n\\n"), "user": ("USER: ", "\\n"), "assistant": ("ASSISTANT: ", "</s>\\n")},
                        False, "ASSISTANT:"),
    "vicuna-orca": _per_role({"system": ("SYSTEM: ", "\\n"), "user": ("USER: ", "\\n"),
                              "assistant": ("ASSISTANT: ", "</s>\\n")}, False, "ASSISTANT:"),
    "deepseek": _per_role({"system": ("", ""), "user": ("### Instruction:\\n", "\\n"),
                           "assistant": ("### Response:\\n", "\\n<|EOT|>\\n")}, False, "### Response:\\n"),
    "deepseek2": _per_role({"system": ("", "\\n\\n"), "user": ("User: ", "\\n\\n"),
                            "assistant": ("Assistant: ", "<｜end▁of▁sentence｜>")}, False, "Assistant:"),
    "deepseek3": _per_role({"system": ("", "\\n\\n"), "user": ("<｜User｜>", ""),
                            "assistant": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")}, False, "<｜Assistant｜>"),
    "deepseek-ocr": _each(f"{{{{ {_C} }}}}"),
    "command-r": _per_role({r: (f"<|START_OF_TURN_TOKEN|><|{t}_TOKEN|>", "<|END_OF_TURN_TOKEN|>") for r, t in
                            (("system", "SYSTEM"), ("user", "USER"), ("assistant", "CHATBOT"))}, True,
                           "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"),
    "llama3": _each(f"{{{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + {_CT} + '<|eot_id|>' }}}}",
                    "<|start_header_id|>assistant<|end_header_id|>\\n\\n"),
    "chatglm3": "{{ '[gMASK]sop' }}" + _each(f"{{{{ '<|' + m['role'] + '|>\\n ' + {_C} }}}}", "<|assistant|>"),
    "chatglm4": "{{ '[gMASK]<sop>' }}" + _each(f"{{{{ '<|' + m['role'] + '|>\\n' + {_C} }}}}", "<|assistant|>\\n"),
    "glmedge": _each(f"{{{{ '<|' + m['role'] + '|>\\n' + {_C} }}}}", "<|assistant|>"),
    "minicpm": _each(_role_cases({"user": f"'<用户>' + {_CT} + '<AI>'"}, other=_CT)),
    "exaone3": _per_role(_EXAONE3, True, "[|assistant|]"),
    "exaone4": _per_role({**_EXAONE3, "tool": ("[|tool|]", "[|endofturn|]\\n")}, True, "[|assistant|]"),
    "exaone-moe": _per_role({r: (f"<|{r}|>\\n", "<|endofturn|>\\n") for r in ("system", "user", "assistant", "tool")},
                            True, "<|assistant|>\\n"),
    "rwkv-world": _each(_role_cases({
        "system": f"'System: ' + {_CT} + '\\n\\n'",
        "user": f"'User: ' + {_CT} + '\\n\\n' + ('Assistant:' if loop.last else '')",
        "assistant": f"'Assistant: ' + {_CT} + '\\n\\n'"})),
    "granite": _each("{{ '<|start_of_role|>' + m['role'] + '<|end_of_role|>' }}{% if m['role'] == "
                     f"'assistant_tool_call' %}}{{{{ '<|tool_call|>' }}}}{{% endif %}}{{{{ {_C} + '<|end_of_text|>\\n' }}}}",
                     "<|start_of_role|>assistant<|end_of_role|>"),
    "granite-4.0": _granite(),
    "granite-4.1": _granite(),
    "gigachat": "{% set system = messages and messages[0]['role'] == 'system' %}{{ '<s>' }}"
                "{% if system %}{{ messages[0]['content'] + '<|message_sep|>' }}{% endif %}" + _each(
        "{% if not (system and loop.first) %}" + _role_cases({
            "user": f"'user<|role_sep|>' + {_C} + '<|message_sep|>available functions<|role_sep|>[]<|message_sep|>'",
            "assistant": f"'assistant<|role_sep|>' + {_C} + '<|message_sep|>'"}) + "{% endif %}",
        "assistant<|role_sep|>"),
    "megrez": _each(f"{{{{ '<|role_start|>' + m['role'] + '<|role_end|>' + {_C} + '<|turn_end|>' }}}}",
                    "<|role_start|>assistant<|role_end|>"),
    "yandex": _per_role({"user": (" Пользователь: ", "\\n\\n"), "assistant": (" Ассистент: ", "\\n\\n")}, False,
                        " Ассистент:[SEP]"),
    "bailing": _bailing(think=False),
    "bailing-think": _bailing(think=True),
    "bailing2": "{% if not (messages and messages[0]['role'] == 'system') %}"
                "{{ '<role>SYSTEM</role>detailed thinking off<|role_end|>' }}{% endif %}" + _each(
        "{{ '<role>' + ('HUMAN' if m['role'] == 'user' else m['role']|upper) + '</role>' + "
        f"{_C} + '<|role_end|>' }}}}", "<role>ASSISTANT</role>"),
    "llama4": _each(f"{{{{ '<|header_start|>' + m['role'] + '<|header_end|>\\n\\n' + {_CT} + '<|eot|>' }}}}",
                    "<|header_start|>assistant<|header_end|>\\n\\n"),
    "smolvlm": "{{ '<|im_start|>' }}" + _each(_role_cases({
        "system": f"{_C} + '\\n\\n'", "user": f"'User: ' + {_C} + '<end_of_utterance>\\n'"},
        other=f"'Assistant: ' + {_C} + '<end_of_utterance>\\n'"), "Assistant:"),
    "hunyuan-moe": _each(_role_cases({"system": f"'<|startoftext|>' + {_C} + '<|extra_4|>'",
                                      "assistant": f"{_C} + '<|eos|>'"},
                                     other=f"'<|startoftext|>' + {_C} + '<|extra_0|>'")),
    "gpt-oss": _each(f"{{{{ '<|start|>' + m['role'] + '<|message|>' + {_C} + ('<|return|>' if m['role'] == "
                     "'assistant' else '<|end|>') }}", "<|start|>assistant"),
    "hunyuan-dense": _each(f"{{% if loop.first and m['role'] == 'system' %}}{{{{ {_C} + '{_HY_HOLDER3}' }}}}{{% endif %}}"
                           + _role_cases({"assistant": f"'<｜hy_Assistant｜>' + {_C} + '<｜hy_place▁holder▁no▁2｜>'",
                                          "user": f"'<｜hy_User｜>' + {_C} + '<｜hy_Assistant｜>'"})),
    "hunyuan-vl": "{{ '<｜hy_begin▁of▁sentence｜>' }}" + _each(
        f"{{% if loop.first and m['role'] == 'system' %}}{{{{ {_C} + '{_HY_HOLDER3}' }}}}{{% else %}}"
        + _role_cases({"user": f"{_C} + '<｜hy_User｜>'", "assistant": f"{_C} + '<｜hy_Assistant｜>'"})
        + "{% endif %}"),
    "kimi-k2": _each(_role_cases({r: f"'<|im_{t}|>{r}<|im_middle|>'" for r, t in (
        ("system", "system"), ("user", "user"), ("assistant", "assistant"), ("tool", "system"))})
        + f"{{{{ {_C} + '<|im_end|>' }}}}", "<|im_assistant|>assistant<|im_middle|>"),
    "seed_oss": _each(f"{{{{ '<seed:bos>' + m['role'] + '\\n' + ({_CT} if m['role'] == 'assistant' else {_C})"
                      " + '<seed:eos>' }}", "<seed:bos>assistant\\n"),
    "grok-2": _each(_role_cases({"system": f"'System: ' + {_CT} + '<|separator|>\\n\\n'",
                                 "user": f"'Human: ' + {_CT} + '<|separator|>\\n\\n'",
                                 "assistant": f"'Assistant: ' + {_C} + '<|separator|>\\n\\n'"}), "Assistant:"),
    "pangu-embedded": _each("{% if loop.first and m['role'] != 'system' %}{{ '[unused9]系统：[unused10]' }}{% endif %}"
                            + _role_cases({r: f"'[unused9]{t}：' + {_C} + '[unused10]'" for r, t in (
                                ("system", "系统"), ("user", "用户"), ("assistant", "助手"), ("tool", "工具"),
                                ("function", "方法"))}), "[unused9]助手："),
    "solar-open": _each(f"{{{{ '<|begin|>' + m['role'] + '<|content|>' + {_C} + '<|end|>' }}}}", "<|begin|>assistant"),
}


def check_name(name: str) -> str:
    """``name`` if it names a built-in template.

    Raises:
        ValueError: it names none (the message lists them all).
    """
    if name not in BUILTIN_TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}: llama.cpp's built-ins are {', '.join(BUILTIN_TEMPLATES)} "
                         "(or give a Jinja file with --chat-template-file)")
    return name


def builtin_source(name: str, add_bos: bool) -> str:
    """The Jinja of built-in template ``name``, with ``bos_token`` first when the model adds BOS (llama-server
    tokenizes a built-in's prompt adding it)."""
    return ("{{ bos_token }}" if add_bos else "") + BUILTIN_TEMPLATES[name]


# Architectures that are one family's: the template of that family.
ARCH_TEMPLATES: dict[str, str] = {
    **dict.fromkeys(("qwen", "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe", "qwen3next", "qwen3vl",
                     "qwen3vlmoe", "qwen35", "qwen35moe", "minicpm3", "smollm3"), "chatml"),
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "gemma3n"), "gemma"),
    **dict.fromkeys(("phi3", "phimoe"), "phi3"),
    **dict.fromkeys(("command-r", "cohere2"), "command-r"),
    **dict.fromkeys(("chatglm", "glm4", "glm4moe"), "chatglm4"),
    **dict.fromkeys(("granite", "granitemoe"), "granite"),
    **dict.fromkeys(("rwkv6", "rwkv7"), "rwkv-world"),
    "llama4": "llama4", "deepseek": "deepseek2", "minicpm": "minicpm", "exaone": "exaone3", "exaone4": "exaone4",
    "exaone-moe": "exaone-moe", "granitehybrid": "granite-4.0", "orion": "orion", "gpt-oss": "gpt-oss",
    "hunyuan-moe": "hunyuan-moe", "hunyuan-dense": "hunyuan-dense", "hunyuan_vl": "hunyuan-vl",
    "bailingmoe": "bailing", "bailingmoe2": "bailing2", "seed_oss": "seed_oss", "grok": "grok-2",
    "pangu-embedded": "pangu-embedded",
}

# A template's markers as tokens of the vocabulary, for architectures several families share; the first whose
# markers are all tokens wins (ChatML's variants before ChatML, as llm_chat_detect_template orders them).
VOCAB_MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("phi4", ("<|im_start|>", "<|im_sep|>")),
    ("smolvlm", ("<|im_start|>", "<end_of_utterance>")),
    ("kimi-k2", ("<|im_assistant|>", "<|im_middle|>")),
    ("chatml", ("<|im_start|>", "<|im_end|>")),
    ("mistral-v7", ("[SYSTEM_PROMPT]", "[INST]")),
    ("mistral-v3", ("[INST]", "[/INST]")),
    ("llama3", ("<|start_header_id|>", "<|end_header_id|>")),
    ("llama4", ("<|header_start|>", "<|header_end|>")),
    ("gemma", ("<start_of_turn>", "<end_of_turn>")),
    ("deepseek3", ("<｜User｜>", "<｜Assistant｜>")),
    ("command-r", ("<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>")),
    ("granite", ("<|start_of_role|>", "<|end_of_role|>")),
    ("phi3", ("<|user|>", "<|assistant|>", "<|end|>")),
)
# Tokenizers (tokenizer.ggml.pre) that name a family of a shared architecture.
PRE_TEMPLATES: dict[str, str] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe"), "llama3"), "tekken": "mistral-v7-tekken",
    "deepseek-coder": "deepseek", "deepseek-llm": "deepseek2", "deepseek-v3": "deepseek3", "falcon3": "falcon3",
}
# Shared architectures without those tokens: (SentencePiece tokenizer's family, BPE tokenizer's family)
SHARED_DEFAULTS: dict[str, tuple[str, str]] = {"llama": ("llama2-sys", "llama3"),
                                               "mistral3": ("mistral-v7", "mistral-v7-tekken"),
                                               "deepseek2": ("deepseek2", "deepseek2")}
_TEKKEN = {"mistral-v7": "mistral-v7-tekken", "mistral-v3": "mistral-v3-tekken"}

Origin = Literal["architecture", "vocabulary", "tokenizer", "default"]


@dataclass(frozen=True)
class FamilyTemplate:
    """The built-in template a GGUF without its own is served with, and why."""

    name: str
    origin: Origin
    reason: str


def family_template(metadata: dict[str, Any], tokens: set[str]) -> FamilyTemplate:
    """The built-in template for a GGUF that carries none.

    Args:
        metadata: the GGUF header's key/values.
        tokens: which of :func:`marker_tokens` the vocabulary holds (:func:`vocabulary_markers`).
    """
    arch = str(metadata.get("general.architecture") or "?")
    pre = str(metadata.get("tokenizer.ggml.pre") or "")
    if arch in ARCH_TEMPLATES:
        return FamilyTemplate(ARCH_TEMPLATES[arch], "architecture", f"the {arch} architecture's")
    for name, markers in VOCAB_MARKERS:
        if all(t in tokens for t in markers):
            name = _TEKKEN.get(name, name) if pre == "tekken" else name
            return FamilyTemplate(name, "vocabulary", f"the {arch} architecture's family whose control tokens "
                                  f"({', '.join(markers)}) the vocabulary holds")
    if pre in PRE_TEMPLATES:
        return FamilyTemplate(PRE_TEMPLATES[pre], "tokenizer", f"the {arch} architecture's family of the {pre} "
                              "tokenizer")
    if arch in SHARED_DEFAULTS:
        spm = metadata.get("tokenizer.ggml.model") == "llama"
        name = SHARED_DEFAULTS[arch][0 if spm else 1]
        return FamilyTemplate(name, "tokenizer", f"the {arch} architecture's family of a "
                              f"{'SentencePiece' if spm else 'BPE'} tokenizer")
    return FamilyTemplate("chatml", "default", f"llama-server's default: no family is known for the {arch} "
                          "architecture")


def marker_tokens() -> set[str]:
    """Every token :data:`VOCAB_MARKERS` looks for."""
    return {t for _, markers in VOCAB_MARKERS for t in markers}


def vocabulary_markers(path: Path, metadata: dict[str, Any], metadata_end: int) -> set[str]:
    """Which marker tokens are in the vocabulary of the GGUF at ``path``: read from the header's token list when
    it was kept, else found as GGUF strings (length + bytes) in the header's bytes (a 150k-token vocabulary is
    not kept by :func:`artifacts.gguf_header.read_header`)."""
    wanted = marker_tokens()
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        return wanted & {str(t) for t in tokens}
    found: set[str] = set()
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        for t in wanted:
            raw = t.encode()
            if mm.find(struct.pack("<Q", len(raw)) + raw, 0, metadata_end) >= 0:
                found.add(t)
    return found
