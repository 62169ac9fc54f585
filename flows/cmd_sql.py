"""``flux sql``: plain SQL over the store — probes, plans, planner trials, routing traces, benchmark results."""

from __future__ import annotations

import argparse

from rich.table import Table

from artifacts.logs import console
from artifacts.store import Store


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``flux sql`` to the ``flux`` parser."""
    p = sub.add_parser("sql", help="run SQL over the store (no query: list what can be queried)",
                       description="An in-memory DuckDB over the store's Parquet tables and JSON objects (it never "
                                   "locks the catalog, so it runs while `flux plan` writes). Views: plans, probes, "
                                   "plan_trials (the planner's trials with their plan), one per table kind "
                                   "(trials, routing, bench_summary, bench_<suite>_raw, bench_gpu, ...), objects.")
    p.add_argument("query", nargs="?", help="e.g. \"SELECT plan_id, model_name, decode_tps FROM plans\"")
    p.add_argument("--limit", type=int, default=50, help="rows printed (default 50)")
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
    t = Table(*result.column_names, show_edge=False)
    for row in result.slice(0, args.limit).to_pylist():
        t.add_row(*("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()))
    console().print(t)
    if result.num_rows > args.limit:
        console(stderr=True).print(f"... {result.num_rows - args.limit} more rows (--limit)")
    return 0
