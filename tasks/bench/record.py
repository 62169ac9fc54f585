"""Recording a suite's results: a finished run (:class:`BenchRun`) and how it lands in the store.

Each run writes its raw rows (one per trial, request or check) as a Parquet table of kind
``bench_<suite>_raw`` keyed by the run id, and one row per (run, baseline) as a table of kind
``bench_summary`` keyed ``<plan>.<suite>.<baseline>.<backend build>.<run>`` (``no-plan`` and an empty
``plan_id`` for a suite that needs none), so
``Store.query("SELECT * FROM bench_summary")`` shows every run of every suite.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from tasks.bench.context import BenchSite

# "invalid": a race whose readings disagree with themselves (a baseline's solo and race readings more than 5%
# apart, tasks/bench/served.py): no ratio of it is a result, and the run exits non-zero as a fail does
Verdict = Literal["pass", "fail", "info", "invalid"]
SUMMARY_KIND = "bench_summary"
SUMMARY_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("plan_id", pa.string()), ("suite", pa.string()), ("baseline", pa.string()),
    ("backend_build", pa.string()), ("created_at", pa.timestamp("us", tz="UTC")), ("verdict", pa.string()),
    ("detail", pa.string()), ("ratio_prefill", pa.float64()), ("ratio_decode", pa.float64()),
    ("ci_low", pa.float64()), ("ci_high", pa.float64()), ("prefill_ci_low", pa.float64()),
    ("prefill_ci_high", pa.float64()), ("n_samples", pa.int64()), ("metrics", pa.string()),
])


class SummaryRow(BaseModel):
    """One row of ``bench_summary``: a run's result against one baseline."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    baseline: str
    verdict: Verdict
    detail: str = ""
    ratio_prefill: float | None = None
    ratio_decode: float | None = None
    ci_low: float | None = Field(None, description="decode ratio interval (the suite's main ratio)")
    ci_high: float | None = None
    prefill_ci_low: float | None = None
    prefill_ci_high: float | None = None
    n_samples: int | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)


@dataclass
class BenchRun:
    """A finished suite run: its summary rows and its raw rows."""

    suite: str
    ctx: BenchSite  # a BenchContext for a suite of a plan
    rows: list[SummaryRow]
    raw: pa.Table
    run_id: str = ""
    created_at: datetime | None = None

    def __post_init__(self) -> None:
        self.run_id = self.run_id or uuid.uuid4().hex
        self.created_at = self.created_at or datetime.now(UTC)

    @property
    def verdict(self) -> Verdict:
        """The run's verdict (:func:`overall`)."""
        return overall([r.verdict for r in self.rows])


def overall(verdicts: Sequence[str]) -> Verdict:
    """Combine row verdicts: any invalid → invalid; any fail → fail; all info (or none) → info; else pass."""
    if "invalid" in verdicts:
        return "invalid"
    if "fail" in verdicts:
        return "fail"
    return "pass" if "pass" in verdicts else "info"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._-") or "x"


def summary_table(run: BenchRun) -> pa.Table:
    """The run's ``bench_summary`` rows."""
    rows = [{"run_id": run.run_id, "plan_id": run.ctx.plan_id, "suite": run.suite, "backend_build": run.ctx.backend_build,
             "created_at": run.created_at, **r.model_dump(exclude={"metrics"}),
             "metrics": json.dumps(r.metrics, sort_keys=True, default=str)} for r in run.rows]
    return pa.Table.from_pylist(rows, schema=SUMMARY_SCHEMA)


def save_run(run: BenchRun) -> list[Path]:
    """Store the raw table (``bench_<suite>_raw``) and one ``bench_summary`` table per row; their paths."""
    store, plan_id = run.ctx.store, run.ctx.plan_id
    raw = run.raw.append_column("run_id", pa.array([run.run_id] * run.raw.num_rows, pa.string()))
    meta = {"plan_id": plan_id, "suite": run.suite, "run_id": run.run_id}
    paths = [store.put_table(f"bench_{run.suite}_raw", raw, key=run.run_id, meta=meta)]
    table = summary_table(run)
    for i, row in enumerate(run.rows):
        key = ".".join([plan_id[:16] or "no-plan", _safe(run.suite), _safe(row.baseline)[:40], _safe(run.ctx.backend_build)[:16],
                        run.run_id[:12]])
        paths.append(store.put_table(SUMMARY_KIND, table.slice(i, 1), key=key,
                                     meta={**meta, "baseline": row.baseline, "verdict": row.verdict}))
    return paths
