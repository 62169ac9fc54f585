"""`flux sql` on wide results: one block per row instead of squeezed columns, and csv/json for programs."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pyarrow as pa
from rich.console import Console

from artifacts.store import Store
from flows.commands.sql import print_auto

# Like `SELECT * FROM plans`: many columns, some long values (ids, paths, flags).
WIDE = pa.table({
    "plan_id": ["3f2a" + "0" * 60, "9b1c" + "1" * 60],
    "model_name": ["tiny-moe", "qwen3-30b-a3b"],
    "model_path": ["/home/someone/.local/share/flux/models/tiny-moe-Q4_0.gguf", "/data/models/q.gguf"],
    "created_at": ["2025-01-01T00:00:00+00:00", "2025-01-02T00:00:00+00:00"],
    "prefill_tps": [1234.56789, 98.7654321],
    "decode_tps": [45.678901234, 12.3456789],
    "n_ctx": [512, 32768],
    "kv": ["f16", "q8_0"],
    "flags": ["--threads 2 --threads-batch 2 --batch-size 256 --ubatch-size 256 --flash-attn on",
              "-ngl 99 --n-cpu-moe 12 --tensor-split 1,0"],
    "note": [None, "x"],
})


def _store_wide(flux_env: dict[str, str], rows: pa.Table = WIDE) -> None:
    Store(Path(flux_env["XDG_DATA_HOME"]) / "flux").put_table("wide", rows, "a" * 64)


def _values_whole(out: str) -> None:
    for col in ("plan_id", "model_path", "flags"):
        for v in WIDE.column(col).to_pylist():
            assert v in out, (col, v)


def test_wide_result_prints_one_block_per_row(flux, flux_env: dict[str, str]) -> None:
    _store_wide(flux_env)
    got = flux("sql", "SELECT * FROM wide")
    assert got.returncode == 0, got.stderr
    assert got.stdout.count("-[ row ") == 2
    for line in got.stdout.splitlines():
        assert len(line) <= 200 and line == line.rstrip(), line
    _values_whole(got.stdout)  # a pipe is 200 wide: each value on one line, never cut to a few characters
    assert "1235" in got.stdout and "45.68" in got.stdout  # floats for people: 4 significant digits


def test_narrow_result_stays_a_table(flux, flux_env: dict[str, str]) -> None:
    _store_wide(flux_env)
    got = flux("sql", "SELECT model_name, n_ctx FROM wide ORDER BY n_ctx")
    assert got.returncode == 0, got.stderr
    assert "-[ row" not in got.stdout
    lines = got.stdout.splitlines()
    assert "model_name" in lines[0] and "n_ctx" in lines[0]
    assert "tiny-moe" in lines[2] and "512" in lines[2]
    forced = flux("sql", "--format", "vertical", "SELECT model_name, n_ctx FROM wide ORDER BY n_ctx")
    assert forced.returncode == 0 and forced.stdout.count("-[ row ") == 2


def test_csv_and_json_give_every_row_whole(flux, flux_env: dict[str, str]) -> None:
    many = pa.table({"i": list(range(120)), "x": [i / 7 for i in range(120)], "s": ['a,"b"\nc'] * 120})
    _store_wide(flux_env)
    Store(Path(flux_env["XDG_DATA_HOME"]) / "flux").put_table("many", many, "b" * 64)

    got = flux("sql", "--format", "csv", "SELECT * FROM wide")
    assert got.returncode == 0, got.stderr
    rows = list(csv.DictReader(io.StringIO(got.stdout)))
    assert [r["plan_id"] for r in rows] == WIDE.column("plan_id").to_pylist()
    assert float(rows[0]["decode_tps"]) == 45.678901234 and rows[0]["note"] == ""

    got = flux("sql", "--format", "json", "SELECT * FROM many ORDER BY i")
    assert got.returncode == 0, got.stderr
    data = json.loads(got.stdout)
    assert len(data) == 120 and "more rows" not in got.stderr  # no screen limit for programs
    assert data[3] == {"i": 3, "x": 3 / 7, "s": 'a,"b"\nc'}

    got = flux("sql", "--format", "csv", "--limit", "5", "SELECT * FROM many ORDER BY i")
    assert got.returncode == 0 and len(list(csv.reader(io.StringIO(got.stdout)))) == 1 + 5
    assert "115 more rows" in got.stderr

    screen = flux("sql", "SELECT i FROM many")
    assert "70 more rows" in screen.stderr


def test_a_narrow_terminal_gets_blocks_not_seven_character_columns() -> None:
    buf = io.StringIO()
    print_auto(Console(file=buf, width=80, force_terminal=False), WIDE)
    out = buf.getvalue()
    assert out.count("-[ row ") == 2
    assert all(len(line) <= 80 for line in out.splitlines())
    for col in WIDE.column_names:
        assert any(line.startswith(col) for line in out.splitlines()), col
    # a long value wraps under itself, whole: joining its lines gives it back
    flags = WIDE.column("flags").to_pylist()[0]
    block = out.split("-[ row 2 ]")[0]
    folded = [line.split("│", 1)[1] for line in block.splitlines() if "│" in line]
    assert flags.replace(" ", "") in "".join(folded).replace(" ", "")
