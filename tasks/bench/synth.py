"""``flux bench synth``: Flux's GGUF writer (:func:`artifacts.synth.synthesize`) against a plain write.

The writer writes a preset's twin; the baseline writes as many bytes from one 16 MiB zero buffer, unbuffered,
into the same directory: the ratio says how close the writer comes to what the file system takes. Runs are
A/B pairs in alternating order (on a small VM the first large write often waits for earlier writeback), and
the ratio is the median of the pairs' ratios with a bootstrap interval. Without ``--fsync`` both figures are
mostly page-cache speed; with it, each file is flushed to disk and the flush is timed in.

The subject is a synth preset, not a plan (``flux bench synth qwen3moe-small``). The one row is ``info``.
``bench_synth_raw``: one row per pair (which went first, seconds and MB/s of each side).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator

from artifacts.synth import PRESETS, Quant, planned_bytes, synthesize
from tasks.bench.context import BenchSite, Progress
from tasks.bench.record import BenchRun, SummaryRow
from tasks.bench.registry import Suite
from tasks.bench.stats import paired_ratio

CHUNK = 16 << 20  # the plain write's buffer, as the writer's own chunk
RAW_SCHEMA = pa.schema([
    ("preset", pa.string()), ("quant", pa.string()), ("bytes", pa.int64()), ("pair", pa.int32()),
    ("first", pa.string()), ("fsync", pa.bool_()), ("synth_s", pa.float64()), ("plain_s", pa.float64()),
    ("synth_mb_s", pa.float64()), ("plain_mb_s", pa.float64()),
])


class SynthOptions(BaseModel):
    """What ``flux bench synth`` writes."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    preset: str = Field(description="the synth preset whose twin is written")
    quant: Quant = Field("Q4_0", description="weight type of the twin")
    repeat: int = Field(3, ge=1, le=50, description="A/B pairs, alternating which side goes first")
    fsync: bool = Field(False, description="flush each file to disk and time the flush")
    directory: Path | None = Field(None, description="where to write (default: a temporary directory)")
    n_boot: int = Field(4000, ge=100)

    @field_validator("preset")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in PRESETS:
            raise ValueError(f"unknown synth preset; presets: {', '.join(sorted(PRESETS))}")
        return v


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_write(path: Path, nbytes: int, fsync: bool) -> float:
    """Seconds to write ``nbytes`` of zeros, unbuffered, in :data:`CHUNK` writes (and flush them if ``fsync``)."""
    zeros = memoryview(bytes(CHUNK))
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            left -= f.write(zeros[: min(left, CHUNK)])
    if fsync:
        _fsync(path)
    return time.perf_counter() - t0


def synth_write(preset: str, path: Path, quant: Quant, fsync: bool) -> float:
    """Seconds for Flux's writer to write ``preset``'s twin (and flush it if ``fsync``)."""
    t0 = time.perf_counter()
    synthesize(preset, path, quant=quant)
    if fsync:
        _fsync(path)
    return time.perf_counter() - t0


def _pair(opts: SynthOptions, directory: Path, size: int, i: int) -> dict[str, Any]:
    """One A/B pair, the writer first on even pairs; both files are removed after it."""
    out, plain = directory / f"{opts.preset}-{opts.quant}.gguf", directory / "plain.bin"
    try:
        if i % 2 == 0:
            synth_s, plain_s = synth_write(opts.preset, out, opts.quant, opts.fsync), plain_write(plain, size, opts.fsync)
        else:
            plain_s, synth_s = plain_write(plain, size, opts.fsync), synth_write(opts.preset, out, opts.quant, opts.fsync)
    finally:
        out.unlink(missing_ok=True)
        plain.unlink(missing_ok=True)
    return {"preset": opts.preset, "quant": opts.quant, "bytes": size, "pair": i,
            "first": "synth" if i % 2 == 0 else "plain", "fsync": opts.fsync, "synth_s": synth_s, "plain_s": plain_s,
            "synth_mb_s": size / 1e6 / synth_s, "plain_mb_s": size / 1e6 / plain_s}


def bench_synth(site: BenchSite, opts: SynthOptions, progress: Progress | None = None) -> BenchRun:
    """Race the writer against a plain write of as many bytes, ``opts.repeat`` pairs; one ``info`` row."""
    size = planned_bytes(opts.preset, opts.quant)
    raw: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=opts.directory, prefix="bench-synth-") as tmp:
        for i in range(opts.repeat):
            raw.append(_pair(opts, Path(tmp), size, i))
            if progress:
                r = raw[-1]
                progress(f"synth: {opts.preset} {opts.quant} pair {i + 1}/{opts.repeat}: writer "
                         f"{r['synth_mb_s']:.0f} MB/s, plain write {r['plain_mb_s']:.0f} MB/s")
    # writer speed / plain speed, per pair
    ci = paired_ratio([r["plain_s"] for r in raw], [r["synth_s"] for r in raw], n_boot=opts.n_boot)
    synth_mb = size / 1e6 / statistics.median(r["synth_s"] for r in raw)
    plain_mb = size / 1e6 / statistics.median(r["plain_s"] for r in raw)
    how = "flushed to disk" if opts.fsync else "page cache"
    detail = (f"{opts.preset} {opts.quant}, {size / 1e9:.3f} GB, {how}: writer {synth_mb:.0f} MB/s, plain write "
              f"{plain_mb:.0f} MB/s (medians of {len(raw)} pairs); writer/plain {ci.text()}")
    metrics = {"preset": opts.preset, "quant": opts.quant, "bytes": size, "fsync": opts.fsync,
               "synth_mb_s": synth_mb, "plain_mb_s": plain_mb, "ratio": ci.ratio, "ratio_low": ci.low,
               "ratio_high": ci.high, "directory": str(opts.directory or tempfile.gettempdir())}
    row = SummaryRow(baseline="plain-write", verdict="info", detail=detail, n_samples=len(raw), metrics=metrics)
    return BenchRun(suite="synth", ctx=site, rows=[row], raw=pa.Table.from_pylist(raw, schema=RAW_SCHEMA))


SUITE = Suite(
    name="synth", help="Flux's GGUF writer against a plain write of as many bytes (no plan: a synth preset)",
    description="Writes PRESET's twin with Flux's writer and as many zero bytes with plain unbuffered writes, "
                "in A/B pairs of alternating order, into the same directory; prints both MB/s and writer/plain. "
                "--fsync flushes each file and times the flush. The row is info.",
    options=SynthOptions, run=bench_synth, flags=("quant", "repeat", "fsync", "directory"),
    rename={"directory": "--dir"}, subject="preset")
