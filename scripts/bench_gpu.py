#!/usr/bin/env python3
"""The GPU record under its old name: ``flux bench record`` (tasks/bench/gpu_record.py), with ``--pairs P`` given as
its positional PAIRS; every other flag is passed on as it is.

    python3 scripts/bench_gpu.py --out DIR --pairs qwen3-30b-a3b/skewed:8 [flags]
        # is: python3 -m flows bench record qwen3-30b-a3b/skewed:8 --out DIR [flags]
    python3 scripts/bench_gpu.py --import --out DIR --record docs/benchmarks/h200/record.parquet
        # is: python3 -m flows bench record --import --out DIR --record docs/benchmarks/h200/record.parquet

Runs of the record before it was a bench suite name this script in their logs and commands.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def record_argv(argv: list[str]) -> list[str]:
    """``flux`` arguments for this script's: ``--pairs P`` (or ``--pairs=P``) becomes ``bench record P``."""
    rest, pairs, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--pairs" and i + 1 < len(argv):
            pairs, i = [argv[i + 1]], i + 2
            continue
        if arg.startswith("--pairs="):
            pairs = [arg.removeprefix("--pairs=")]
        else:
            rest.append(arg)
        i += 1
    return ["bench", "record", *pairs, *rest]


if __name__ == "__main__":
    from flows.cli import main

    sys.exit(main(record_argv(sys.argv[1:])))
