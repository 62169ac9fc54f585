"""`flux bench synth`: Flux's GGUF writer against a plain write, on the tiny-moe preset (no plan, no backend)."""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_support import bench_settings
from pydantic import ValidationError

from artifacts.synth import planned_bytes
from tasks.bench.context import open_site
from tasks.bench.record import save_run
from tasks.bench.synth import RAW_SCHEMA, SynthOptions, bench_synth, plain_write


def test_the_writer_races_a_plain_write_in_alternating_pairs_and_lands_in_the_store(tmp_path: Path) -> None:
    st, _ = bench_settings(tmp_path / "flux")
    where = tmp_path / "scratch"
    where.mkdir()
    seen: list[str] = []
    run = bench_synth(open_site(st), SynthOptions(preset="tiny-moe", repeat=3, directory=where), seen.append)

    assert run.raw.schema == RAW_SCHEMA
    rows = run.raw.to_pylist()
    assert [r["first"] for r in rows] == ["synth", "plain", "synth"]
    assert {r["bytes"] for r in rows} == {planned_bytes("tiny-moe", "Q4_0")}
    assert all(r["synth_s"] > 0 and r["plain_s"] > 0 for r in rows)
    assert list(where.iterdir()) == []  # every file and the temporary directory are gone
    assert len(seen) == 3
    (row,) = run.rows
    assert row.baseline == "plain-write" and row.verdict == "info" and row.n_samples == 3
    assert "writer/plain" in row.detail and row.metrics["ratio"] > 0

    save_run(run)
    stored = run.ctx.store.query("SELECT plan_id, suite, baseline FROM bench_summary").to_pylist()
    assert stored == [{"plan_id": "", "suite": "synth", "baseline": "plain-write"}]
    assert run.ctx.store.query("SELECT count(*) AS n FROM bench_synth_raw").to_pylist() == [{"n": 3}]


def test_plain_write_writes_exactly_the_bytes(tmp_path: Path) -> None:
    path = tmp_path / "plain.bin"
    assert plain_write(path, (16 << 20) + 5, fsync=True) > 0
    assert path.stat().st_size == (16 << 20) + 5


def test_an_unknown_preset_names_the_presets() -> None:
    with pytest.raises(ValidationError, match="tiny-moe"):
        SynthOptions(preset="no-such-model")
