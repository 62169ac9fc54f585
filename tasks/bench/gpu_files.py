"""The GPU record's files (``flux bench record``): a run's Parquet rows, the docs' record they are appended to, and
the store's ``bench_gpu`` table.

A run writes its rows to ``OUT/h200_results.parquet`` (:data:`RESULTS`, one row per pair) and, with depths,
``OUT/h200_depths.parquet`` (:data:`DEPTHS`, one row per pair and depth). ``--import`` puts a run's rows into the
store (:func:`store_results`) and, with ``--record R``, appends them to ``R`` and ``R``'s sibling
``depths.parquet`` once (:func:`append_record`); ``--backfill-steps R`` gives ``R``'s older rows the step
columns (:func:`backfill_steps`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from artifacts.ids import content_id
from artifacts.store import Store
from tasks.bench.context import Progress
from tasks.bench.errors import BenchError
from tasks.bench.host_state import flag_record, probe_readings
from tasks.bench.step_facts import step_facts_from_show, step_times

RESULTS = "h200_results.parquet"
DEPTHS = "h200_depths.parquet"


def _say(progress: Progress | None, msg: str) -> None:
    """Report ``msg`` where there is someone to tell."""
    if progress is not None:
        progress(msg)


def united(rows: list[dict[str, Any]]) -> pa.Table:
    """Rows as one table with the union of their columns (Arrow would take the first row's keys alone)."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows])


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """Append rows to a Parquet file, the columns united."""
    every = [*(pq.read_table(path).to_pylist() if path.exists() else []), *rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(united(every), path)


def append_record(out: Path, record: Path, progress: Progress | None = None) -> int:
    """Append ``out``'s rows to ``record`` (the docs' record, rows from every run) unless a row of the same run
    and plan is there already, and its depth rows to ``record``'s sibling ``depths.parquet`` unless one of the
    same run, plan and depth is; returns how many pair rows were added."""
    have = {(r.get("run"), r.get("plan_id")) for r in pq.read_table(record).to_pylist()} if record.exists() else set()
    new = [r for r in pq.read_table(out / RESULTS).to_pylist() if (r.get("run"), r.get("plan_id")) not in have]
    if new:
        write_rows(new, record)
    _say(progress, f"appended {len(new)} row(s) to {record}")
    depths, record_depths = out / DEPTHS, record.with_name("depths.parquet")
    if depths.exists():
        seen = {(r.get("run"), r.get("plan_id"), r.get("depth_tokens"))
                for r in pq.read_table(record_depths).to_pylist()} if record_depths.exists() else set()
        more = [r for r in pq.read_table(depths).to_pylist()
                if (r.get("run"), r.get("plan_id"), r.get("depth_tokens")) not in seen]
        if more:
            write_rows(more, record_depths)
        _say(progress, f"appended {len(more)} depth row(s) to {record_depths}")
    return len(new)


def _shows(root: Path) -> dict[str, str]:
    """Plan id -> the ``flux show`` log saved for it in a run folder beside the record (``runN/**/show-*.log``)."""
    shows = {}
    for log_path in root.glob("run*/**/show-*.log"):
        text = log_path.read_text()
        shows[text.split("\n", 1)[0].rsplit(" ", 1)[-1]] = text  # "$ flux show <plan id>"
    return shows


def backfill_steps(record: Path, progress: Progress | None = None) -> int:
    """Give the record's rows made before the step columns (:mod:`tasks.bench.step_facts`) their figures: the
    split from the ``flux show`` log saved with the row's run (found by plan id), the step times from the row's
    own speeds; and every row its run's probe reading of the host with the flag of a slow host against the
    record's other runs (:func:`tasks.bench.host_state.flag_record`). Returns how many rows gained a step figure."""
    shows = _shows(record.parent)
    rows, changed = pq.read_table(record).to_pylist(), 0
    for r in rows:
        if not r.get("plan_id") or r.get("step_ms") is not None:
            continue
        facts = step_facts_from_show(shows.get(r["plan_id"], ""))
        r.update({k: v for k, v in facts.items() if r.get(k) is None})
        r.update(step_times(r.get("served_decode_tps"), r.get("all_gpu_decode_tps")))
        changed += 1
    host = flag_record(rows, probe_readings(record.parent))
    pq.write_table(united(rows), record)
    _say(progress, f"{record}: step figures for {changed} row(s), the host's probe reading for {host}; "
                   f"{sum(1 for r in rows if r.get('host_flag'))} row(s) on a host slower than usual")
    return changed


def store_results(out: Path, store: Store, progress: Progress | None = None) -> None:
    """Put the run's record into the store as table ``bench_gpu`` (``flux sql "SELECT * FROM bench_gpu"``).

    Raises:
        BenchError: ``out`` holds no rows (no run wrote there).
    """
    if not (out / RESULTS).is_file():
        raise BenchError(f"{out} has no {RESULTS}: give --out the folder a `flux bench record` run wrote")
    table = pq.read_table(out / RESULTS)
    key = content_id({"bench_gpu": [r.get("plan_id") for r in table.to_pylist()], "rows": table.num_rows})
    store.put_table("bench_gpu", table, key=key)
    _say(progress, f"stored {out / RESULTS} as bench_gpu/{key[:12]}")
