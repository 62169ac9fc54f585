"""The arrivals replay's workload shapes: prompts and gaps per rate, and chat turns from agent conversations.

Pure: :func:`tasks.bench.arrivals.make_workload` fills a :class:`Workload` with the plan's own tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Workload:
    """Prompts (token ids) and unit-rate gaps per rate, chat turns per rate, and the calibration prompts."""

    prompts: list[list[list[int]]]
    gaps: list[list[float]]
    chats: list[list[list[dict[str, str]]]]
    calibration: list[list[int]]

    def offsets(self, k: int, rps: float) -> list[float]:
        """Arrival times (s from the replay's start) of rate ``k`` at ``rps`` requests/s; the first at 0."""
        out = [0.0]
        for g in self.gaps[k][:-1]:
            out.append(out[-1] + g / rps)
        return out


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def chat_messages(messages: Sequence[dict[str, Any]], max_chars: int) -> list[dict[str, str]]:
    """A conversation as plain text turns that any chat template takes.

    Tool calls and results are folded into the text, tool results sent as user turns, neighbours of one
    role merged (some templates insist on alternating roles), each message cut to ``max_chars``.
    """
    out: list[dict[str, str]] = []
    for m in messages:
        role = "user" if m["role"] == "tool" else str(m["role"])
        text = ("[tool result] " if m["role"] == "tool" else "") + _text(m.get("content"))
        for call in m.get("tool_calls") or []:
            fn = call.get("function", {})
            text += f"\n[tool call] {fn.get('name')}({fn.get('arguments')})"
        text = text.strip()[:max_chars] or "."
        if out and out[-1]["role"] == role:
            out[-1]["content"] += "\n\n" + text
        else:
            out.append({"role": role, "content": text})
    return out


def chat_turns(messages: list[dict[str, str]], tokenize: Callable[[str], list[int]], budget: int,
               limit: int) -> list[list[dict[str, str]]]:
    """The growing prefixes that end with a user turn, while their ChatML rendering fits ``budget`` tokens."""
    turns: list[list[dict[str, str]]] = []
    for i, m in enumerate(messages):
        if m["role"] != "user" or len(turns) >= limit:
            continue
        text = "".join(f"<|im_start|>{x['role']}\n{x['content']}<|im_end|>\n" for x in messages[:i + 1])
        if len(tokenize(text + "<|im_start|>assistant\n")) > budget:
            break
        turns.append(messages[:i + 1])
    return turns
