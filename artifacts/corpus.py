"""The prompts and coding-agent conversations that measurement and validation run on.

Flux ships its own corpus (``artifacts/corpus_data/``): original prompts of seven kinds (code, prose,
log, qa, math, config, doc) whose lengths span 32 to ~4,500 tokens, split into ``tune`` (timed while
planning) and ``held_out`` (kept for validating the finalists), plus multi-turn coding-agent
conversations in OpenAI chat format with long system prompts, tool calls and tool results: the shape
of the traffic an agent sends, and the one that stresses prefill and the KV cache hardest.

Everything here is tokenizer-agnostic: prompts are text, and :func:`sized_prompts` cuts them to exact
token counts with whatever tokenizer the caller passes (a model's, or a synthetic byte-level one).
WikiText-2, the perplexity text of ``flux bench quality`` when reachable, is in :mod:`tasks.corpus_wikitext`.
"""

from __future__ import annotations

import functools
import json
import logging
import random
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

logger = logging.getLogger(__name__)

DATA_DIR = Path(__file__).parent / "corpus_data"
PROMPTS_FILE = DATA_DIR / "prompts.jsonl"
CONVERSATIONS_FILE = DATA_DIR / "conversations.jsonl"

PromptKind = Literal["code", "prose", "log", "qa", "math", "config", "doc"]
Split = Literal["tune", "held_out"]
SPLITS: tuple[Split, ...] = ("tune", "held_out")
ROLES = frozenset({"system", "user", "assistant", "tool"})
M = TypeVar("M", bound=BaseModel)

SEPARATOR = "\n\n"  # between prompts joined to reach a length no single prompt has
# Fixed "today" for chat templates that print the date (Llama 3.x): rendering stays deterministic.
TEMPLATE_DATE = datetime(2024, 6, 1)


class CorpusError(ValueError):
    """A bundled corpus file is missing or malformed (a packaging problem, not a user error)."""

    def __init__(self, path: Path, line: int, reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        super().__init__(
            f"{path}:{line}: {reason}; the bundled corpus is damaged: restore it with "
            f"`git checkout -- {DATA_DIR.name}` or reinstall flux"
        )


class CorpusPrompt(BaseModel):
    """One prompt of the bundled corpus."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=r"^p\d{2,}-[a-z0-9-]+$")
    kind: PromptKind
    split: Split
    text: str = Field(min_length=1)


class Conversation(BaseModel):
    """One coding-agent conversation in OpenAI chat format (system, user, assistant, tool messages)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=r"^c\d{2,}-[a-z0-9-]+$")
    messages: list[dict[str, Any]] = Field(min_length=1)

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, m in enumerate(messages):
            role = m.get("role")
            if role not in ROLES:
                raise ValueError(f"message {i}: role {role!r} is not one of {sorted(ROLES)}")
            if role == "tool" and not isinstance(m.get("tool_call_id"), str):
                raise ValueError(f"message {i}: a tool message needs a tool_call_id")
            for call in m.get("tool_calls") or []:
                if not isinstance(call.get("function", {}).get("name"), str):
                    raise ValueError(f"message {i}: tool call without function.name")
        return messages


# -- loading -----------------------------------------------------------------------------------------
def _read_jsonl(path: Path, model: type[M]) -> tuple[M, ...]:
    """Validate every line of a bundled JSONL file; ids must be unique."""
    if not path.is_file():
        raise CorpusError(path, 0, "file not found")
    rows: list[M] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = model.model_validate_json(line)
            except ValidationError as exc:
                raise CorpusError(path, n, f"invalid {model.__name__}: {exc.errors()[0]['msg']}") from exc
            row_id = str(getattr(row, "id", ""))
            if row_id in seen:
                raise CorpusError(path, n, f"duplicate id {row_id!r}")
            seen.add(row_id)
            rows.append(row)
    return tuple(rows)


@functools.lru_cache(maxsize=1)
def _all_prompts() -> tuple[CorpusPrompt, ...]:
    """The validated prompt file, read once per process."""
    return _read_jsonl(PROMPTS_FILE, CorpusPrompt)


@functools.lru_cache(maxsize=1)
def _all_conversations() -> tuple[Conversation, ...]:
    """The validated conversation file, read once per process."""
    return _read_jsonl(CONVERSATIONS_FILE, Conversation)


def load_prompts(split: str | None = None) -> list[CorpusPrompt]:
    """The bundled prompts, in file order.

    The file is read and validated once per process (cached); each call returns a new list of the
    same frozen models.

    Args:
        split: ``"tune"``, ``"held_out"``, or None for both.

    Returns:
        The prompts of that split.

    Raises:
        ValueError: ``split`` is not a known split.
        CorpusError: the bundled file is missing or malformed.
    """
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {SPLITS} or None")
    return [p for p in _all_prompts() if split is None or p.split == split]


def load_conversations() -> list[Conversation]:
    """The bundled coding-agent conversations, in file order.

    Returns:
        Deep copies (the message dicts are mutable), so callers may edit them freely.

    Raises:
        CorpusError: the bundled file is missing or malformed.
    """
    return [c.model_copy(deep=True) for c in _all_conversations()]


# -- flattening --------------------------------------------------------------------------------------
def _content_text(content: Any) -> str:
    """Message content as text: a string, None, or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _arguments(raw: Any) -> Any:
    """Tool-call arguments as an object when they are a JSON string (how templates expect them)."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _chatml(messages: Sequence[dict[str, Any]]) -> str:
    """ChatML with tool calls as JSON in <tool_call> blocks (Qwen/Hermes style)."""
    out: list[str] = []
    for m in messages:
        parts = [_content_text(m.get("content"))] if m.get("content") else []
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            body = {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))}
            parts.append(f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>")
        out.append(f"<|im_start|>{m['role']}\n" + "\n".join(parts) + "<|im_end|>\n")
    out.append("<|im_start|>assistant\n")
    return "".join(out)


def _render_template(template: str, messages: Sequence[dict[str, Any]]) -> str:
    """Render a Hugging Face style Jinja chat template, sandboxed as transformers does."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = TEMPLATE_DATE.strftime
    prepared = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
                for c in m["tool_calls"]
            ]
        prepared.append(m)
    return env.from_string(template).render(
        messages=prepared, add_generation_prompt=True, tools=None, bos_token="", eos_token=""
    )


def conversation_text(conv: Conversation, template: str | None = None) -> str:
    """Flatten a conversation to one prompt string that asks the model for the next assistant turn.

    Args:
        conv: The conversation.
        template: A Jinja chat template (a GGUF's ``tokenizer.chat_template``), or None for plain
            ChatML: ``<|im_start|>role\\n...<|im_end|>\\n`` per message, tool calls as JSON in
            ``<tool_call>`` blocks inside the assistant turn, tool results as role ``tool``.

    Returns:
        The text, ending with the opening of an assistant turn.

    Raises:
        jinja2.TemplateError: the template cannot render these messages.
    """
    if template is None:
        return _chatml(conv.messages)
    return _render_template(template, conv.messages)


# -- domains -----------------------------------------------------------------------------------------
# The corpus's domains: groups of its prompt kinds whose text differs enough for a domain-routed twin (``flux synth
# --routing domains``) to tell them apart, and the coding-agent conversations as "chat". A domain's prompts are
# what ``--domains`` times and traces, and what the twin's vocabulary groups are counted on.
DOMAINS: dict[str, tuple[str, ...]] = {
    "code": ("code", "config"),
    "prose": ("prose", "doc", "qa", "math"),
    "log": ("log",),
    "chat": ("conversation",),
}


class UnknownDomain(ValueError):
    """A domain name that is not one of :data:`DOMAINS` (a user error: the message names the known ones)."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"unknown domain {name!r}; known domains: {', '.join(DOMAINS)}")


class DomainMix(BaseModel):
    """``--domains TRACE[:MEASURE]``: the corpus domains the routing trace is taken on and those the measured
    rounds run (the same when MEASURE is left out); each a '+'-joined list of :data:`artifacts.corpus.DOMAINS`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    trace: tuple[str, ...]
    measure: tuple[str, ...]

    @property
    def shifts(self) -> bool:
        """True when the measured traffic is not the traced one."""
        return set(self.trace) != set(self.measure)


def parse_domains(text: str) -> DomainMix:
    """``"code"``, ``"code:prose"`` or ``"code+log:chat"`` as a :class:`DomainMix`.

    Raises:
        UnknownDomain: a name that is not a corpus domain (the message names the known ones).
        ValueError: an empty mix or more than one ``:``.
    """
    parts = text.split(":")
    if len(parts) > 2 or not all(parts):
        raise ValueError(f"expected TRACE[:MEASURE], each one or more domains joined by '+', e.g. code:prose "
                         f"(known domains: {', '.join(DOMAINS)})")
    mixes = [tuple(d.strip() for d in part.split("+")) for part in parts]
    for name in (d for mix in mixes for d in mix):
        if name not in DOMAINS:
            raise UnknownDomain(name)
    return DomainMix(trace=mixes[0], measure=mixes[-1])


def domain_texts(domain: str, split: str | None = None) -> list[str]:
    """The corpus text of one domain: its kinds' prompts (of ``split``, or all), or the conversations as ChatML."""
    if domain not in DOMAINS:
        raise UnknownDomain(domain)
    if split is not None and split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: use one of {SPLITS} or None")
    if DOMAINS[domain] == ("conversation",):
        convs = load_conversations()
        # the conversations have no split: the first half tunes, the rest is held out
        half = (len(convs) + 1) // 2
        picked = {"tune": convs[:half], "held_out": convs[half:], None: convs}[split]
        return [conversation_text(c) for c in picked]
    return [p.text for p in load_prompts(split) if p.kind in DOMAINS[domain]]


# -- sized prompts -----------------------------------------------------------------------------------
def _joined(
    texts: Sequence[str],
    counts: Sequence[int],
    order: list[int],
    n: int,
    tokenize: Callable[[str], list[int]],
    rng: random.Random,
) -> list[int]:
    """Tokens of prompts joined by blank lines until there are at least n (cycling if needed)."""
    picked: list[int] = []
    queue = list(order)
    estimate, target = 0, n
    tokens: list[int] = []
    while True:
        # Add prompts until their separate counts reach the target, then tokenize the join once.
        # Tokenizers are not additive across a join (one BOS, merges at the seams), so a short join
        # raises the target by what is missing and adds more prompts.
        while estimate < target:
            if not queue:
                queue = list(order)
                rng.shuffle(queue)
            i = queue.pop(0)
            picked.append(i)
            estimate += counts[i]
        joined = tokenize(SEPARATOR.join(texts[i] for i in picked))
        if len(joined) >= n:
            return joined
        if len(joined) <= len(tokens):
            raise ValueError("the tokenizer returns no more tokens for longer text")
        tokens = joined
        target = estimate + n - len(joined)


def sized_prompts(
    tokenize: Callable[[str], list[int]],
    lengths: list[int],
    split: str | None = "tune",
    seed: int = 0,
    domains: Sequence[str] = (),
) -> list[list[int]]:
    """Token sequences of exactly the requested lengths, cut from corpus prompts.

    For each length a prompt whose tokenization is at least that long is picked (deterministically
    from ``seed``) and cut to length. Prompts not yet used in this call are preferred, so that an
    engine's prefix cache cannot carry one measurement's prompt into the next. When no prompt is long
    enough, prompts are joined with blank lines until the join is.

    Args:
        tokenize: Text to token ids (a model's tokenizer, or e.g. ``lambda s: list(s.encode())``).
        lengths: Requested token counts, each at least 1.
        split: Which prompts to draw from (``"tune"``, ``"held_out"``, or None for all).
        seed: Selects the prompts; the same seed, tokenizer and lengths give the same tokens.
        domains: Draw from these :data:`DOMAINS` only (their prompts of ``split``); empty: every prompt.

    Returns:
        One token list per requested length, in order, each exactly that long.

    Raises:
        ValueError: a length is below 1, the split is unknown, or the tokenizer yields no tokens.
        UnknownDomain: a domain is not one of :data:`DOMAINS`.
    """
    bad = [n for n in lengths if n < 1]
    if bad:
        raise ValueError(f"prompt lengths must be at least 1 token, got {bad}")
    texts = [t for d in domains for t in domain_texts(d, split)] if domains else [p.text for p in load_prompts(split)]
    encoded = [tokenize(t) for t in texts]
    counts = [len(toks) for toks in encoded]
    if not any(counts):  # also what keeps _joined from looping forever
        raise ValueError("the tokenizer returns no tokens for the corpus text")
    rng = random.Random(seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    used: set[int] = set()
    out: list[list[int]] = []
    for n in lengths:
        fits = [i for i in order if counts[i] >= n]
        if fits:
            fresh = [i for i in fits if i not in used]
            i = rng.choice(fresh or fits)
            used.add(i)
            out.append(list(encoded[i][:n]))
            continue
        unused = [i for i in order if i not in used] + [i for i in order if i in used]
        tokens = _joined(texts, counts, unused, n, tokenize, rng)
        logger.debug("no single prompt has %d tokens; joined prompts give %d", n, len(tokens))
        out.append(list(tokens[:n]))
    return out
