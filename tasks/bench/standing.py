"""The GPU record's standing: the latest valid row of each pair, as the table at the top of
``docs/benchmarks/gpu-record.md`` (``python3 scripts/standing.py`` rewrites it from ``h200/record.parquet``).

A pair is a model twin (preset and routing), a GPU budget, a context and a workload (a row made before
``--workload`` existed planned for the agent). A row is valid when its plan was made and raced, its ``--fit``
baseline held its budget (``fit_valid``, so ``tg_vs_fit`` is a result) and no later race superseded it
(``superseded_by``). Of a pair's valid rows the latest stands: the latest date, then the last appended.

Each row says how it was raced (``race``). Every row recorded by ``flux bench run --via serve`` so far had every
contender loaded for the whole race (:data:`CO_RESIDENT`); a row without the column is one of them. The table
marks those rows, so a reader knows their baselines were read beside the other contenders, until the pair is
raced again and the old row is marked ``superseded_by`` the new run (:func:`supersede`).

Card and date are the row's own columns (``card``, ``date``); rows made before those columns existed take them
from their run's name (``h200-2026-12-03e``: an NVIDIA H200, 2026-12-03).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

BEGIN = "<!-- standing:begin -->"
END = "<!-- standing:end -->"
CO_RESIDENT = "co-resident"
_RUN_CARD = re.compile(r"^([a-z]\d{2,3})-\d{4}-", re.IGNORECASE)
_RUN_DATE = re.compile(r"(\d{4})-?(\d{2})-?(\d{2})")
_CTX_SUFFIX = re.compile(r"@\d+$")
_ROUTING_ORDER = {"uniform": 0, "skewed": 1, "local": 2}

Row = dict[str, Any]
PairKey = tuple[str, str, float, int, str]


def card(row: Row) -> str:
    """The row's GPU as NVML names it (``NVIDIA H200``), from its ``card`` column or its run's name; "" unknown."""
    if row.get("card"):
        return str(row["card"])
    m = _RUN_CARD.match(str(row.get("run") or ""))
    return f"NVIDIA {m.group(1).upper()}" if m else ""


def gpu_card(names: Sequence[str]) -> str | None:
    """The ``card`` of a machine from its GPUs' names: ``NVIDIA H200``, ``2x NVIDIA H100 80GB HBM3``, or
    ``A + B`` for unlike cards; None without a GPU."""
    if not names:
        return None
    if len(set(names)) == 1:
        return names[0] if len(names) == 1 else f"{len(names)}x {names[0]}"
    return " + ".join(names)


def date(row: Row) -> str:
    """The row's date (``YYYY-MM-DD``), from its ``date`` column or its run's name; "" unknown."""
    if row.get("date"):
        return str(row["date"])
    m = _RUN_DATE.search(str(row.get("run") or ""))
    return "-".join(m.groups()) if m else ""


def race(row: Row) -> str:
    """How the row was raced; a row without the column is of the co-resident race (every row before it)."""
    return str(row.get("race") or CO_RESIDENT)


def race_of_metrics(metrics: Iterable[dict[str, Any]]) -> str:
    """The ``race`` column of a new record row from its ``bench_summary`` metrics (their ``race`` key), else
    :data:`CO_RESIDENT`: the race ``flux bench run --via serve`` ran when none said otherwise."""
    kinds = sorted({str(m["race"]) for m in metrics if m.get("race")})
    return ",".join(kinds) or CO_RESIDENT


def pair_key(row: Row) -> PairKey:
    """(model, routing, budget GiB, context, workload) of a row."""
    return (str(row.get("model")), str(row.get("routing") or "uniform"), float(row.get("budget_gib") or 0.0),
            int(row.get("ctx") or 0), str(row.get("workload") or "agent"))


def valid(row: Row) -> bool:
    """Planned, raced, against a ``--fit`` that held its budget, and not superseded."""
    return (bool(row.get("plan_id")) and not row.get("error") and row.get("fit_valid") is True
            and row.get("tg_vs_fit") is not None and not row.get("superseded_by"))


def standing(rows: Sequence[Row]) -> list[Row]:
    """The latest valid row of each pair, in the table's order (model, routing, workload, budget, context)."""
    latest: dict[PairKey, tuple[tuple[str, int], Row]] = {}
    for i, row in enumerate(rows):
        if not valid(row):
            continue
        key, when = pair_key(row), (date(row), i)
        if key not in latest or when >= latest[key][0]:
            latest[key] = (when, row)
    return [latest[k][1] for k in sorted(latest, key=lambda k: (k[0], _ROUTING_ORDER.get(k[1], 9), k[4], k[2], k[3]))]


def supersede(rows: Sequence[Row], run: str, by: str, plan_id: str | None = None) -> tuple[list[Row], int]:
    """Rows with those of ``run`` (and ``plan_id``, a prefix, when given) marked ``superseded_by`` ``by``;
    returns the rows and how many were marked. No other column changes."""
    out, n = [], 0
    for row in rows:
        if row.get("run") == run and (plan_id is None or str(row.get("plan_id") or "").startswith(plan_id)):
            row, n = {**row, "superseded_by": by}, n + 1
        out.append(row)
    return out, n


def _ratio(value: Any) -> str:
    return f"{value:.2f}x" if isinstance(value, int | float) else "—"


def _pair_label(row: Row) -> str:
    model, routing, budget, ctx, workload = pair_key(row)
    size = f"{budget:g} GiB" if budget else "whole GPU"
    spec = " +spec" if row.get("spec_trials") is not None else ""
    return f"{model} {routing}, {size}, {ctx:,} tokens, {workload}{spec}"


def _marks(row: Row) -> str:
    kind = race(row).split(":", 1)[0]  # the race's name, before what it says of itself
    marks = [f"{kind} ¹" if kind == CO_RESIDENT else kind]
    if row.get("host_flag"):
        marks.append("host slow ²")
    return ", ".join(marks)


def table_line(row: Row) -> str:
    """One row of the standing table."""
    family = _CTX_SUFFIX.sub("", str(row.get("plan_family") or "—"))
    fit = " / ".join(_ratio(row.get(f"{r}_vs_fit")) for r in ("tg", "pp", "agent"))
    ncmoe = " / ".join(_ratio(row.get(f"{r}_vs_ncmoe")) for r in ("tg", "pp", "agent"))
    return (f"| {_pair_label(row)} | `{row.get('run')}` | {card(row).removeprefix('NVIDIA ')} | {date(row)} "
            f"| {family} | {fit} | {ncmoe} | {_marks(row)} |")


HEADER = ("| pair: twin, GPU budget, context, workload | run | card | date | plan | vs `--fit`: decode / prefill / "
          "agent turn | vs best `--n-cpu-moe`: decode / prefill / agent turn | race |\n|---|---|---|---|---|---|---|---|")


def table(rows: Sequence[Row]) -> str:
    """The standing block's text (between :data:`BEGIN` and :data:`END`, markers excluded)."""
    stand = standing(rows)
    superseded = sum(1 for r in rows if r.get("superseded_by"))
    co_resident = sum(1 for r in stand if race(r) == CO_RESIDENT)
    n_valid = sum(1 for r in rows if valid(r))
    lines = ["<!-- generated by `python3 scripts/standing.py` from h200/record.parquet: do not edit by hand -->",
             "", HEADER, *(table_line(r) for r in stand), "",
             f"The latest valid row of each of {len(stand)} pairs, from the record's {len(rows)} rows ({n_valid} valid:"
             f" planned, raced, against a `--fit` that held its budget; {superseded} superseded by a later race)."
             " Ratios are plan / baseline at the same GPU memory and context, medians of the race's paired rounds:"
             " decode and prefill of its pp512-tg128 turn, and its agent turn (a 2,048-token prompt, a 32-token"
             " reply) end to end; — : not raced. `+spec`: planned with `--speculation`."]
    if co_resident:
        lines.append(f"\n¹ {co_resident} of {len(stand)} rows: their baselines' readings are from the co-resident race"
                     " (every contender loaded for the whole race), until the pair is raced again.")
    if any(r.get("host_flag") for r in stand):
        lines.append("\n² the run's probe read the host under 75% of the record's median (`host_flag`): ratios hold"
                     " for that host state only.")
    return "\n".join(lines)


def rewrite(doc: str, block: str) -> str | None:
    """``doc`` with the text between its :data:`BEGIN` and :data:`END` lines replaced by ``block``; None when
    the doc has not both markers, in that order."""
    start, end = doc.find(BEGIN), doc.find(END)
    if start < 0 or end < start:
        return None
    return f"{doc[:start]}{BEGIN}\n{block}\n{doc[end:]}"


def block_of(doc: str) -> str | None:
    """The text between the doc's markers (what :func:`rewrite` put there), or None without them."""
    start, end = doc.find(BEGIN), doc.find(END)
    if start < 0 or end < start:
        return None
    return doc[start + len(BEGIN) + 1:end].removesuffix("\n")
