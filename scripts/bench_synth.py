#!/usr/bin/env python3
"""Benchmark the synthetic GGUF writer: MB/s end to end, side by side with a plain write of as many bytes.

    python3 scripts/bench_synth.py                                   # qwen3moe-small and llama3-8b, Q4_0
    python3 scripts/bench_synth.py --preset qwen3-30b-a3b --quant Q4_K --dir /big/disk --fsync

The baseline writes the same number of bytes from one 16 MiB zero buffer into the same directory: the
ratio says how close the writer comes to what the file system takes. Runs are A/B pairs in alternating
order and medians are reported: on a small VM the first large write often waits for earlier writeback. Without --fsync both figures are
mostly page-cache speed; with it, each file is flushed to disk and the flush is timed in.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from artifacts.synth import PRESETS, QUANTS, Quant, planned_bytes, synthesize  # noqa: E402

CHUNK = 16 << 20


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def baseline(path: Path, nbytes: int, fsync: bool) -> float:
    """Seconds to write nbytes of zeros, unbuffered, in CHUNK writes."""
    zeros = memoryview(bytes(CHUNK))
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            left -= f.write(zeros[: min(left, CHUNK)])
    if fsync:
        _fsync(path)
    return time.perf_counter() - t0


def bench(preset: str, quant: Quant, directory: Path, fsync: bool, synth_first: bool) -> tuple[float, float]:
    """One A/B pair: (synth seconds, plain-write seconds), in the given order."""
    size = planned_bytes(preset, quant)
    out, plain = directory / f"{preset}-{quant}.gguf", directory / "plain.bin"

    def run_synth() -> float:
        t0 = time.perf_counter()
        synthesize(preset, out, quant=quant)
        if fsync:
            _fsync(out)
        return time.perf_counter() - t0

    if synth_first:
        synth_s, base_s = run_synth(), baseline(plain, size, fsync)
    else:
        base_s, synth_s = baseline(plain, size, fsync), run_synth()
    out.unlink()
    plain.unlink()
    return synth_s, base_s


def report(preset: str, quant: Quant, directory: Path, fsync: bool, repeat: int) -> None:
    """Run `repeat` A/B pairs, alternating which goes first, and print each and the medians."""
    size = planned_bytes(preset, quant)
    pairs = []
    for i in range(repeat):
        synth_s, base_s = bench(preset, quant, directory, fsync, synth_first=i % 2 == 0)
        pairs.append((synth_s, base_s))
        print(
            f"  {preset} {quant} run {i + 1}: synth {size / 1e6 / synth_s:6.0f} MB/s, "
            f"plain write {size / 1e6 / base_s:6.0f} MB/s",
            flush=True,
        )
    synth_mb = size / 1e6 / statistics.median(p[0] for p in pairs)
    base_mb = size / 1e6 / statistics.median(p[1] for p in pairs)
    print(
        f"{preset:16s} {quant:5s} {size / 1e9:7.3f} GB  median of {repeat}: synth {synth_mb:6.0f} MB/s  "
        f"plain write {base_mb:6.0f} MB/s  ratio {synth_mb / base_mb:.2f}",
        flush=True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", choices=sorted(PRESETS), help="repeatable")
    ap.add_argument("--quant", default="Q4_0", choices=QUANTS)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3, help="A/B pairs per preset, alternating order")
    ap.add_argument("--fsync", action="store_true", help="flush each file to disk and time the flush")
    args = ap.parse_args()
    presets = args.preset or ["qwen3moe-small", "llama3-8b"]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-synth-") as tmp:
        for preset in presets:
            report(preset, cast(Quant, args.quant), Path(tmp), args.fsync, args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
