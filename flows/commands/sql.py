"""``flux sql``: plain SQL over the store — probes, plans, planner trials, routing traces, benchmark results.

Rows print as a table when it fits the terminal, else one record per block (column, value) so that a wide
``SELECT *`` stays readable; ``--format csv|json`` gives every row, whole, for other programs.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
from collections.abc import Callable
from decimal import Decimal
from typing import Any

import pyarrow as pa
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from artifacts.logs import console
from artifacts.store import Store

SCREEN_LIMIT = 50  # rows printed for people unless --limit says otherwise; csv and json print every row


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``flux sql`` to the ``flux`` parser."""
    p = sub.add_parser("sql", help="run SQL over the store (no query: list what can be queried)",
                       description="An in-memory DuckDB over the store's Parquet tables and JSON objects (it never "
                                   "locks the catalog, so it runs while `flux plan` writes). Views: plans, probes, "
                                   "plan_trials (the planner's trials with their plan), one per table kind "
                                   "(trials, routing, bench_summary, bench_<suite>_raw, bench_gpu, ...), objects.")
    p.add_argument("query", nargs="?", help="e.g. \"SELECT plan_id, model_name, decode_tps FROM plans\"")
    p.add_argument("--format", choices=list(FORMATS), default="auto",
                   help="auto (the default): a table when it fits the terminal, else vertical; vertical: one "
                        "block per row, a line per column; csv, json: every row and whole values, for programs")
    p.add_argument("--limit", type=int, help=f"rows printed (default {SCREEN_LIMIT} for table and vertical, "
                                             "all for csv and json)")
    p.set_defaults(handler=cmd_sql)


def cmd_sql(args: argparse.Namespace) -> int:
    """Print the query's rows, or the views with their row counts."""
    store = Store(args.settings.data_dir)
    if not args.query:
        t = Table("view", "rows", show_edge=False)
        for name in store.views():
            t.add_row(name, str(store.query(f'SELECT count(*) AS n FROM "{name}"').to_pylist()[0]["n"]))
        console().print(t)
        return 0
    result = store.query(args.query)
    machine = args.format in ("csv", "json")
    limit = args.limit if args.limit is not None else None if machine else SCREEN_LIMIT
    shown = result if limit is None else result.slice(0, max(limit, 0))
    FORMATS[args.format](console(), shown)
    if shown.num_rows < result.num_rows:
        console(stderr=True).print(f"... {result.num_rows - shown.num_rows} more rows (--limit)")
    return 0


def _cell(v: Any) -> str:
    """A value for people: floats to 4 significant digits, NULL as nothing."""
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)


def _table(rows: pa.Table) -> Table:
    t = Table(*rows.column_names, show_edge=False)
    for row in rows.to_pylist():
        t.add_row(*(_cell(v) for v in row.values()))
    return t


def print_table(con: Console, rows: pa.Table) -> None:
    """Columns side by side (rich squeezes them when the terminal is too narrow)."""
    con.print(_table(rows))


def print_vertical(con: Console, rows: pa.Table) -> None:
    """One block per row, one line per column (psql's ``\\x``); a long value wraps under itself."""
    width = max((len(c) for c in rows.column_names), default=0)
    room = max(20, con.width - width - 3)
    for i, row in enumerate(rows.to_pylist(), 1):
        con.print(Text(f"-[ row {i} ]" + "-" * max(0, width - 8), style="dim"), soft_wrap=True)
        for name, v in row.items():
            lines = Text(_cell(v)).wrap(con, room, overflow="fold") or [Text()]
            for j, line in enumerate(lines):
                line.rstrip()
                sep = " │ " if line.plain else " │"
                con.print(Text.assemble(((name if j == 0 else "").ljust(width), "bold"), sep, line), soft_wrap=True)
    if rows.num_rows == 0:
        con.print(Text("(0 rows)", style="dim"))


def print_auto(con: Console, rows: pa.Table) -> None:
    """A table when its natural width fits the console, else one block per row."""
    # measured without the console's width as the cap: the width the table would take unsqueezed
    natural = Measurement.get(con, con.options.update(max_width=1 << 20), _table(rows)).maximum
    if rows.num_rows and natural > con.width:
        print_vertical(con, rows)
    else:
        print_table(con, rows)


def _plain(v: Any) -> Any:
    """A value JSON can hold as is (nested lists and structs kept; dates, decimals, bytes as text)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v.hex() if isinstance(v, bytes) else str(v)


def print_csv(con: Console, rows: pa.Table) -> None:
    """RFC 4180 CSV with a header row; nested values as JSON, NULL as an empty field."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(rows.column_names)
    for row in rows.to_pylist():
        w.writerow("" if v is None else json.dumps(p) if isinstance(p := _plain(v), (dict, list)) else p
                   for v in row.values())
    con.out(buf.getvalue(), end="", highlight=False)


def print_json(con: Console, rows: pa.Table) -> None:
    """A JSON array of objects, one per row, values whole."""
    con.out(json.dumps([_plain(r) for r in rows.to_pylist()], indent=1, allow_nan=True), highlight=False)


FORMATS: dict[str, Callable[[Console, pa.Table], None]] = {
    "auto": print_auto, "table": print_table, "vertical": print_vertical, "csv": print_csv, "json": print_json,
}
