"""How benchmark results read to a person: run tables, ``flux bench show`` (tables + PNG plots) and
``flux bench matrix`` (the latest verdict of every suite for every saved plan).

Everything here reads what the suites stored (``bench_summary`` and ``bench_<suite>_raw``), so a plot
or a matrix never shows a number that is not in the store.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
from rich.markup import escape
from rich.table import Table

from artifacts.errors import NotFound, StoreError
from artifacts.logs import console
from artifacts.records.kinds import PLAN
from artifacts.records.plan import Plan
from artifacts.records.store import Records
from artifacts.store import Store
from flows.commands.plan import load_plan
from tasks.bench.errors import BenchError
from tasks.bench.record import SUMMARY_KIND, BenchRun, overall
from tasks.bench.record import summary_table as summary_rows
from tasks.bench.registry import suites as declared_suites
from tasks.bench.served_depths import depth_lines

log = logging.getLogger(__name__)
STYLE = {"pass": "green", "fail": "bold red", "info": "yellow", "invalid": "bold magenta"}
NO_RESULT = "—"


def _f(x: float | None, fmt: str = ".2f") -> str:
    return NO_RESULT if x is None else format(x, fmt)


def _ratio(r: dict[str, Any], which: str) -> str:
    ratio = r.get(f"ratio_{which}")
    lo, hi = (r.get("prefill_ci_low"), r.get("prefill_ci_high")) if which == "prefill" else (r.get("ci_low"), r.get("ci_high"))
    if ratio is None:
        return NO_RESULT
    return f"{ratio:.2f}x" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else "")


def summary_table(rows: Sequence[dict[str, Any]], title: str) -> Table:
    """Summary rows as a table: baseline, verdict, ratios with 95% intervals, detail."""
    t = Table(title=title, show_edge=False, title_justify="left")
    for col in ("baseline", "verdict", "prefill plan/base [95% CI]", "decode plan/base [95% CI]", "n", "detail"):
        t.add_column(col, overflow="fold")
    for r in rows:
        v = str(r["verdict"])
        t.add_row(escape(str(r["baseline"])), f"[{STYLE.get(v, '')}]{v}[/]", _ratio(r, "prefill"), _ratio(r, "decode"),
                  str(r.get("n_samples") or ""), escape(str(r.get("detail") or "")))  # details are text, not markup
    return t


def engine_table(raw: pa.Table) -> Table | None:
    """Per-engine medians of a race's trials (run, ablate); None for other raw tables."""
    import numpy as np

    if "engine" not in raw.column_names or "decode_tps" not in raw.column_names:
        return None
    t = Table(title="per engine (medians over trials)", show_edge=False, title_justify="left")
    for col in ("engine", "trials", "prefill tok/s", "decode tok/s", "start s", "error"):
        t.add_column(col, overflow="fold")
    rows = raw.to_pylist()
    for name in dict.fromkeys(r["engine"] for r in rows):
        mine = [r for r in rows if r["engine"] == name]
        ok = [r for r in mine if not r["error"]]

        def med(key: str, ok: list[dict[str, Any]] = ok) -> str:
            vals = [r[key] for r in ok if r.get(key) is not None]
            return _f(float(np.median(vals)) if vals else None, ".1f")

        err = next((r["error"] for r in mine if r["error"]), "")
        t.add_row(escape(name), str(len(ok)), med("prefill_tps"), med("decode_tps"), med("start_s"), escape(err))
    return t


def findings_table(raw: pa.Table) -> Table | None:
    """Every disagreement of a conformance run; explained ones name their rule (reasons listed below it)."""
    if "check" not in raw.column_names:
        return None
    bad = [r for r in raw.to_pylist() if not r["ok"]]
    t = Table(title=f"disagreements ({len(bad)} of {raw.num_rows} comparisons)", show_edge=False, title_justify="left",
              caption=escape("\n".join(sorted({f"explained by {r['explained']}" for r in bad if r["explained"]}))) or None,
              caption_justify="left")
    for col in ("check", "case", "explained", "ours", "llama-server"):
        t.add_column(col, overflow="fold")
    for r in bad:
        rule = escape(r["explained"].split(":")[0]) if r["explained"] else "[bold red]no[/]"
        t.add_row(escape(r["check"]), escape(r["case"]), rule, escape(repr(r["ours"][:160])), escape(repr(r["theirs"][:160])))
    return t


def print_rows(rows: Sequence[dict[str, Any]], raw: pa.Table | None, title: str) -> None:
    """Print a stored run: summary rows, the engines' configurations, then what its raw table adds."""
    con = console()
    con.print(summary_table(rows, title))
    metrics = [json.loads(r.get("metrics") or "{}") for r in rows]
    if metrics and metrics[0].get("plan_engine"):
        con.print(f"plan: {metrics[0]['plan_engine']}", markup=False)
    for r, m in zip(rows, metrics, strict=True):
        note = (m.get("engine") or {}).get("note") or m.get("changed")
        if note:
            con.print(f"{r['baseline']}: {note}", markup=False)
    if raw is not None:
        for extra in (engine_table(raw), findings_table(raw)):
            if extra is not None:
                con.print(extra)
    for line in depth_lines(rows):  # a run with --depths: a table per depth
        con.print(line, markup=False)


def print_run(run: BenchRun) -> None:
    """Print a finished run (as stored)."""
    rows = summary_rows(run).to_pylist()
    title = f"flux bench {run.suite}: {run.ctx.subject} — {run.verdict.upper()}"
    print_rows(rows, run.raw, title)


def find_plans(store: Store) -> list[Plan]:
    """Every saved plan, oldest first (one another version of Flux wrote is skipped with a warning)."""
    records = Records(store)
    plans = []
    for row in records.rows(PLAN):
        try:
            plans.append(records.get(PLAN, row["id"]))
        except (NotFound, StoreError) as exc:
            log.warning("skipping unreadable plan %s: %s", row["id"], exc)
    return plans


# -- reading the store --------------------------------------------------------------------------------
def summaries(store: Store, where: str = "") -> list[dict[str, Any]]:
    """Rows of bench_summary (oldest first), or none when nothing is stored yet."""
    if not store.list(SUMMARY_KIND):
        return []
    return store.query(f"SELECT * FROM {SUMMARY_KIND} {where} ORDER BY created_at, baseline").to_pylist()


def latest_run(store: Store, plan: Plan, suite: str) -> tuple[str, list[dict[str, Any]]]:
    """The newest run of ``suite`` for ``plan``: (run id, its summary rows).

    Raises:
        BenchError: no stored run.
    """
    if not re.fullmatch(r"[a-z][a-z0-9_]*", suite):
        raise BenchError(f"invalid suite name {suite!r}")
    rows = summaries(store, f"WHERE plan_id = '{plan.id}' AND suite = '{suite}'")
    if not rows:
        raise BenchError(f"no stored `{suite}` results for plan {plan.id[:12]}: run `flux bench {suite} {plan.id[:12]}`")
    run_id = str(rows[-1]["run_id"])
    return run_id, [r for r in rows if r["run_id"] == run_id]


# -- plots --------------------------------------------------------------------------------------------
def _cdf_plot(raw: pa.Table, path: Path, title: str) -> Path | None:
    """CDF of per-trial prefill and decode tok/s, one line per engine."""
    import matplotlib.pyplot as plt
    import numpy as np

    if "engine" not in raw.column_names or "decode_tps" not in raw.column_names:
        return None
    rows = [r for r in raw.to_pylist() if not r["error"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "prefill_tps", "prefill tok/s"), (axes[1], "decode_tps", "decode tok/s")):
        for name in dict.fromkeys(r["engine"] for r in rows):
            xs = np.sort([r[key] for r in rows if r["engine"] == name and r[key]])
            if xs.size:
                ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=name, lw=2 if name == "plan" else 1)
        vals = [r[key] for r in rows if r[key]]
        wide = bool(vals) and max(vals) > 10 * min(vals)  # log only when the trials span a decade
        ax.set_xscale("log" if wide else "linear")
        ax.set(xlabel=f"{label} per trial" + (" (log)" if wide else ""), ylabel="fraction of trials", title=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _finalists_plot(plan: Plan, path: Path) -> Path | None:
    """Measured tok/s of every finalist of the plan, the chosen one marked."""
    import matplotlib.pyplot as plt
    import numpy as np

    fin = [s for s in plan.finalists if s.prefill_tps or s.decode_tps]
    if not fin:
        return None
    x = np.arange(len(fin))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in ((axes[0], "prefill_tps"), (axes[1], "decode_tps")):
        vals = [getattr(s, key) or 0.0 for s in fin]
        colors = ["tab:red" if s.candidate_id == plan.candidate.id else "tab:blue" for s in fin]
        ax.bar(x, vals, color=colors)
        ax.set_xticks(x, [s.candidate_id + (" (chosen)" if s.candidate_id == plan.candidate.id else "") for s in fin],
                      rotation=45, ha="right", fontsize=8)
        ax.set(ylabel=key.replace("_tps", " tok/s"), title=f"finalists: {key.replace('_tps', '')} (median)")
    fig.suptitle(f"plan {plan.id[:12]}: finalists measured while planning (red: chosen)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _quality_plot(raw: pa.Table, path: Path, title: str) -> Path | None:
    """Mean KL per compared sequence, by source (log scale)."""
    import matplotlib.pyplot as plt

    rows = [r for r in raw.to_pylist() if r.get("mean_kl") is not None] if "mean_kl" in raw.column_names else []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(rows)), [max(r["mean_kl"], 1e-12) for r in rows],
           color=["tab:blue" if r["source"] == "held_out" else "tab:orange" for r in rows])
    ax.set_xticks(range(len(rows)), [r["item"] for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set(yscale="log", ylabel="mean KL(ref || plan)", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _checks_plot(raw: pa.Table, path: Path, title: str) -> Path | None:
    """Comparisons per conformance check: agreeing, explained, unexplained."""
    import matplotlib.pyplot as plt

    if "check" not in raw.column_names:
        return None
    rows = raw.to_pylist()
    checks = sorted({r["check"] for r in rows})
    parts = (("agree", "tab:green", lambda r: r["ok"]), ("explained", "tab:olive", lambda r: not r["ok"] and r["explained"]),
             ("unexplained", "tab:red", lambda r: not r["ok"] and not r["explained"]))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    bottom = [0] * len(checks)
    for label, color, keep in parts:
        counts = [sum(1 for r in rows if r["check"] == c and keep(r)) for c in checks]
        ax.bar(checks, counts, bottom=bottom, color=color, label=label)
        bottom = [b + n for b, n in zip(bottom, counts, strict=True)]
    ax.set(ylabel="comparisons", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_plots(plan: Plan, suite: str, raw: pa.Table, out_dir: Path) -> list[Path]:
    """Every PNG this suite's results support, under ``out_dir`` (``<suite>-*.png``)."""
    import matplotlib

    matplotlib.use("Agg")
    out_dir.mkdir(parents=True, exist_ok=True)
    title = f"flux bench {suite}: plan {plan.id[:12]} ({plan.model_name})"
    makers: list[Callable[[], Path | None]] = [
        lambda: _cdf_plot(raw, out_dir / f"{suite}-tps-cdf.png", title),
        lambda: _quality_plot(raw, out_dir / f"{suite}-kl.png", title),
        lambda: _checks_plot(raw, out_dir / f"{suite}-checks.png", title)]
    if suite == "run":
        makers.append(lambda: _finalists_plot(plan, out_dir / f"{suite}-finalists.png"))
    return [p for p in (m() for m in makers) if p is not None]


def run_facts(metrics: dict[str, Any]) -> str:
    """The run's wall time and the machine's load average before and after it, in one line ('' when unknown)."""
    parts = []
    if isinstance(metrics.get("seconds"), int | float):
        parts.append(f"took {metrics['seconds']:.1f} s")
    start, end = metrics.get("load_avg_start"), metrics.get("load_avg_end")
    if start and end:
        parts.append(f"load average {start[0]:.2f} before, {end[0]:.2f} after (1 min)")
    return "run: " + "; ".join(parts) if parts else ""


# -- commands -----------------------------------------------------------------------------------------
def cmd_show(args: argparse.Namespace) -> int:
    """Print the newest stored run of one suite for a plan and write its plots."""
    store = Store(args.settings.data_dir)
    plan = load_plan(args.settings, args.plan)
    run_id, rows = latest_run(store, plan, args.suite)
    raw = store.get_table(f"bench_{args.suite}_raw", run_id) if store.has(f"bench_{args.suite}_raw", run_id) else None
    verdict = overall([str(r["verdict"]) for r in rows])
    print_rows(rows, raw, f"flux bench {args.suite}: plan {plan.id[:12]}, run {run_id[:12]} "
               f"({rows[0]['created_at']:%Y-%m-%d %H:%M} UTC, backend {rows[0]['backend_build']}) — {verdict.upper()}")
    for r in rows:  # the run's own facts, kept in each row's metrics: say them once
        line = run_facts(json.loads(r["metrics"] or "{}"))
        if line:
            console().print(line, markup=False)
            break
    pngs = make_plots(plan, args.suite, raw if raw is not None else pa.table({}), args.settings.data_dir / "bench" / plan.id[:12])
    for p in pngs:
        console().print(f"wrote {p}", markup=False)
    if not pngs:
        console().print(f"no plots for the stored `{args.suite}` results", markup=False)
    return 0


def matrix(store: Store) -> tuple[list[str], list[tuple[Plan, dict[str, str]]]]:
    """(suite columns, [(plan, {suite: latest verdict})]) over every saved plan."""
    rows = [r for r in summaries(store) if r["plan_id"]]  # a suite without a plan has no cell of a plan
    known = [name for name, s in declared_suites().items() if s.subject == "plan"]
    suites = known + sorted({str(r["suite"]) for r in rows} - set(known))
    latest: dict[tuple[str, str], str] = {}
    for r in rows:  # oldest first: the last run of a (plan, suite) wins
        latest[(str(r["plan_id"]), str(r["suite"]))] = str(r["run_id"])
    out = []
    for plan in find_plans(store):
        cells: dict[str, str] = {}
        for suite in suites:
            run_id = latest.get((plan.id, suite))
            if run_id is not None:
                cells[suite] = overall([str(r["verdict"]) for r in rows if r["run_id"] == run_id])
        out.append((plan, cells))
    return suites, out


def cmd_matrix(args: argparse.Namespace) -> int:
    """Print pass/fail of every suite over every saved plan."""
    suites, rows = matrix(Store(args.settings.data_dir))
    t = Table(title="flux bench matrix (latest run of each suite)", show_edge=False, title_justify="left")
    for col in ("plan", "model", "created", *suites):
        t.add_column(col)
    for plan, cells in rows:
        t.add_row(plan.id[:12], plan.model_name, plan.created_at[:16],
                  *(f"[{STYLE[c]}]{c}[/]" if c in STYLE else NO_RESULT for c in (cells.get(s) for s in suites)))
    con = console()
    con.print(t if rows else "no saved plans: `flux plan model.gguf` makes one")
    return 0


def _show_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="a unique prefix of a plan id")
    p.add_argument("--suite", default="run", help="which suite's newest run (default run)")


@dataclass(frozen=True)
class Report:
    """A ``flux bench`` subcommand that reads stored results instead of measuring."""

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    handler: Callable[[argparse.Namespace], int]


REPORTS = (
    Report("show", "print one suite's newest results for a plan and plot them (PNG)",
           "Tables from the stored results, and PNGs under <data_dir>/bench/<plan>/<suite>-*.png: the CDF of "
           "per-trial tok/s per engine, and for `run` the finalists' tok/s with the chosen one marked.",
           _show_args, cmd_show),
    Report("matrix", "print pass/fail of every suite over every saved plan",
           "Rows: saved plans; columns: suites; cells: the newest run's verdict, or — when never run.",
           lambda p: None, cmd_matrix),
)
