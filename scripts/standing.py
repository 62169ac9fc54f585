#!/usr/bin/env python3
"""Rewrite the standing table of the GPU record (docs/benchmarks/gpu-record.md) from its Parquet record.

The table, between ``<!-- standing:begin -->`` and ``<!-- standing:end -->``, is the latest valid row of each
pair (:mod:`tasks.bench.standing`). Run it after ``flux bench record --import --record`` appends a run;
tests/tasks/bench/test_standing.py fails while the doc and the record disagree.

    python3 scripts/standing.py                     # rewrite the block
    python3 scripts/standing.py --check             # exit 1 if the block is not what the record gives
    python3 scripts/standing.py --supersede h200-2026-12-05c --by h100-2026-12-09a [--plan 202fc114]
        # mark a run's rows (or one plan's) superseded by a later race of their pairs, then rewrite
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tasks.bench.standing import block_of, rewrite, supersede, table  # noqa: E402

DOC = REPO / "docs" / "benchmarks" / "gpu-record.md"
RECORD = REPO / "docs" / "benchmarks" / "h200" / "record.parquet"


def mark_superseded(record: Path, run: str, by: str, plan_id: str | None) -> int:
    """Write ``superseded_by`` into ``record``'s rows of ``run``; every other column is left as it was read."""
    old = pq.read_table(record)
    rows, n = supersede(old.to_pylist(), run, by, plan_id)
    marks = pa.array([r.get("superseded_by") for r in rows], pa.string())
    names = old.schema.names
    new = (old.set_column(names.index("superseded_by"), "superseded_by", marks) if "superseded_by" in names
           else old.append_column("superseded_by", marks))
    pq.write_table(new, record)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--record", type=Path, default=RECORD)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if the doc's block is stale")
    ap.add_argument("--supersede", metavar="RUN", help="mark this run's rows superseded (with --by)")
    ap.add_argument("--by", metavar="RUN", help="the run that raced their pairs again")
    ap.add_argument("--plan", metavar="ID", help="with --supersede: only the row of this plan (an id prefix)")
    args = ap.parse_args()
    if bool(args.supersede) != bool(args.by):
        ap.error("--supersede RUN and --by RUN go together")
    if args.supersede and not args.check:
        n = mark_superseded(args.record, args.supersede, args.by, args.plan)
        print(f"{args.record}: {n} row(s) of {args.supersede} marked superseded by {args.by}")
        if n == 0:
            return 1
    doc = args.doc.read_text()
    block = table(pq.read_table(args.record).to_pylist())
    if args.check:
        if block_of(doc) == block:
            return 0
        print(f"{args.doc}: the standing table is not the record's: run python3 scripts/standing.py", file=sys.stderr)
        return 1
    new = rewrite(doc, block)
    if new is None:
        print(f"{args.doc}: no '<!-- standing:begin -->' ... '<!-- standing:end -->' lines to write between",
              file=sys.stderr)
        return 1
    if new != doc:
        args.doc.write_text(new)
    print(f"{args.doc}: standing table of {block.count(chr(10) + '| ') - 1} pair(s) from {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
