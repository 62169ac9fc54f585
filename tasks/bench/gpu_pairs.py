"""The GPU record's pairs (``flux bench record PAIRS``, :mod:`tasks.bench.gpu_record`): what to plan, and how to ask
``flux plan`` for it.

    MODEL[/ROUTING]:BUDGET[@CTX][~WORKLOAD][+spec|+draftK|+heads][%PLAN_S][#D1/D2/...]

BUDGET is GiB per GPU (0: the whole cards), CTX ``flux plan --ctx`` (else the model's trained context), WORKLOAD
``--workload`` (agent unless given), ``+spec`` ``--speculation``, ``+draftK`` also ``--draft-model`` of a draft twin
of the model's first K layers, ``+heads`` also ``--heads`` (the twin's next-token block, grafted by llama-server:
``--engines native,llama-server``), ``%PLAN_S`` this pair's ``--budget-s`` (else the run's ``--plan-budget-s``),
``#D1/D2/...`` the depths (tokens of context in the cache; ``64k`` is 65,536) this pair's plan is raced at after
the pairs' races (``flux bench run --via serve --depths``; else the run's ``--depths``). A plan refused for its
budget names the budget that can work (:func:`refused_budget`): the record plans again at it.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict

_DRAFTING = re.compile(r"^(spec|heads|draft(\d+))$")
_REFUSED = re.compile(r"use --budget-s (\d+) or more")


class Pair(BaseModel):
    """One pair of the record, parsed."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    preset: str
    routing: str = "uniform"
    budget_gib: float = 0.0
    ctx: int | None = None
    workload: str = ""
    draft_layers: int | None = None
    speculation: bool = False
    heads: bool = False
    plan_budget_s: float | None = None
    depths: tuple[int, ...] = ()

    @property
    def tag(self) -> str:
        """The pair's name in the run's file names."""
        return (f"{self.preset}-{self.routing}-{self.budget_gib:g}" + (f"@{self.ctx}" if self.ctx else "")
                + (f"-{self.workload}" if self.workload else "")
                + (f"+draft{self.draft_layers}" if self.draft_layers else "+heads" if self.heads
                   else "+spec" if self.speculation else ""))

    def plan_args(self, model: Path, draft: Path | None, budget_s: float | None, heads: Path | None = None) -> list[str]:
        """``flux plan`` for this pair: the twin, its budgets, context, workload and drafting."""
        budget_s = self.plan_budget_s or budget_s
        return ["plan", str(model), *(["--gpu-mem-budget", f"{self.budget_gib:g}"] if self.budget_gib else []),
                *(["--ctx", str(self.ctx)] if self.ctx else []), *(["--workload", self.workload] if self.workload else []),
                *(["--budget-s", f"{budget_s:g}"] if budget_s else []),
                *(["--speculation"] if self.speculation else []), *(["--draft-model", str(draft)] if draft else []),
                *(["--heads", str(heads), "--engines", "native,llama-server"] if heads else [])]


def split_drafting(text: str) -> tuple[str, int | None, bool, bool]:
    """``PAIR[+spec|+draftK|+heads]`` → (pair, draft layers or None, speculation asked for, grafted heads)."""
    pair, plus, drafting = text.partition("+")
    if not plus:
        return pair, None, False, False
    m = _DRAFTING.match(drafting)
    if m is None:
        raise ValueError(f"pair {text!r}: after '+' give spec (flux plan --speculation), draftK (a draft twin "
                         "of the model's first K layers, e.g. llama3-8b:0~chat+draft2) or heads (the twin's "
                         "next-token block grafted on llama-server)")
    layers = int(m.group(2)) if m.group(2) else None
    if layers is not None and layers < 1:
        raise ValueError(f"pair {text!r}: a draft twin needs at least one layer (draft1, draft2, ...)")
    return pair, layers, True, drafting == "heads"


def parse_depths(text: str) -> tuple[int, ...]:
    """Depths in tokens, separated by ``/`` or ``,`` (``4096/32k/256k``: a ``k`` is 1,024 tokens); ValueError, in one
    line, for a list it cannot read."""
    parts = [x.strip() for x in text.replace(",", "/").split("/") if x.strip()]
    try:
        got = tuple(int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in parts)
    except ValueError:
        got = ()
    if not got or min(got) < 1:
        raise ValueError(f"depths {text!r}: expected positive token counts, e.g. 4096/32768/131072 or 4k/32k/128k")
    return got


def parse_pair(text: str) -> Pair:
    """A pair from its text (the module's grammar); ValueError, in one line, for one it cannot read."""
    text, hash_, depth_text = text.partition("#")
    try:
        depths = parse_depths(depth_text) if hash_ else ()
    except ValueError as exc:
        raise ValueError(f"pair {text + hash_ + depth_text!r}: after '#' give the {exc}") from None
    rest, pct, plan_s = text.partition("%")
    try:
        plan_budget = float(plan_s) if pct else None
    except ValueError:
        raise ValueError(f"pair {text!r}: after '%' give the pair's flux plan --budget-s in seconds, e.g. %300") from None
    rest, layers, spec, heads = split_drafting(rest)
    rest, _, workload = rest.partition("~")
    if workload not in ("", "agent", "chat"):
        raise ValueError(f"pair {text!r}: the workload must be agent or chat (flux plan --workload)")
    model, _, sizes = rest.partition(":")
    preset, _, routing = model.partition("/")
    budget, _, ctx = sizes.partition("@")
    if routing not in ("", "uniform", "skewed", "local"):
        raise ValueError(f"pair {text!r}: routing must be uniform, skewed or local, e.g. qwen3-30b-a3b/skewed:10")
    try:
        return Pair(preset=preset, routing=routing or "uniform", budget_gib=float(budget or 0),
                    ctx=int(ctx) if ctx else None, workload=workload, draft_layers=layers, speculation=spec,
                    heads=heads, plan_budget_s=plan_budget, depths=depths)
    except ValueError:
        raise ValueError(f"pair {text!r}: expected MODEL[/ROUTING]:BUDGET[@CTX], e.g. qwen3-30b-a3b/skewed:12@8192") from None


def refused_budget(stderr: str) -> int | None:
    """The ``--budget-s`` a refused ``flux plan`` named as the least that can work, or None."""
    m = _REFUSED.search(stderr)
    return int(m.group(1)) if m else None
