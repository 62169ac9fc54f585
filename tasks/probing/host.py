"""Host measurements of the probe stage: RAM read bandwidth, storage read speed, and the CPU time other processes
took while the probe ran (the CPU's identity and ISA are machine facts: :mod:`engine_bridge.machine_facts`).

Everything here is measured or read from the kernel on the machine at hand; nothing is looked up
from a table of known parts.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import psutil

log = logging.getLogger(__name__)

MIB = 2**20
GIB = 2**30
CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")
SMALL_FILE_BYTES = 64 * MIB


class RamBandwidth(NamedTuple):
    """Measured RAM read bandwidth."""

    gbs: float
    gbs_1thread: float
    threads: int
    buffer_bytes: int


class StorageRead(NamedTuple):
    """Measured sequential read of one file, with how the page cache was kept out."""

    gbs: float
    method: str
    bytes_read: int


def usable_cpus() -> int:
    """CPUs this process may run on (affinity mask, which a container may narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


# -- other processes' CPU -------------------------------------------------------------------------------
class CpuContention(NamedTuple):
    """What other processes took of the CPUs this process may run on while something was measured."""

    others_cpus: float  # their CPU seconds (steal included) over the wall seconds: CPUs kept busy on average
    load_avg_1m: float | None  # the 1-minute load average when the measurement started (it lags: a figure for people)
    seconds: float


def _busy_seconds(cpus: set[int]) -> float:
    """CPU seconds the kernel counts as busy (user, nice, system, interrupts, stolen by a hypervisor) on ``cpus``."""
    per = psutil.cpu_times(percpu=True)
    fields = ("user", "nice", "system", "irq", "softirq", "steal")
    return sum(sum(getattr(t, f, 0.0) for f in fields) for i, t in enumerate(per) if not cpus or i in cpus)


def _own_seconds() -> float:
    """CPU seconds of this process, its reaped children and its live descendants (the probe's workers)."""
    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.Error:  # ended between the listing and the read: its time is its parent's now
            continue
        total += c.user + c.system
    return total


class ContentionMeter:
    """Measures :class:`CpuContention` from its creation to :meth:`read`: every busy second of the CPUs this process
    may run on, less this process tree's own. A process that started and ended meanwhile (a compiler, a test) is
    counted, which a walk of the process table would miss."""

    def __init__(self) -> None:
        self._cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
        self._load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self._t0 = time.monotonic()
        self._busy0 = _busy_seconds(self._cpus)
        self._own0 = _own_seconds()

    def read(self) -> CpuContention:
        """Other processes' CPU use since the meter started."""
        wall = max(time.monotonic() - self._t0, 1e-3)
        others = (_busy_seconds(self._cpus) - self._busy0) - (_own_seconds() - self._own0)
        return CpuContention(others_cpus=max(0.0, others / wall), load_avg_1m=self._load, seconds=wall)


def cpu_contention(seconds: float = 1.0) -> CpuContention:
    """Other processes' CPU use over the next ``seconds`` (this process sleeps meanwhile)."""
    meter = ContentionMeter()
    time.sleep(seconds)
    return meter.read()


# -- RAM -----------------------------------------------------------------------------------------------
def last_level_cache_bytes(cache_dir: Path = CACHE_DIR) -> int:
    """Size of cpu0's largest cache level from sysfs (0 when unknown)."""
    best = 0
    for index in sorted(cache_dir.glob("index*")):
        try:
            size = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 2**10, "M": MIB, "G": GIB}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def ram_buffer_bytes(available: int, llc_bytes: int) -> int:
    """Buffer for the bandwidth test: 8x the last-level cache within [256 MiB, 1 GiB], at most available/8."""
    want = min(max(256 * MIB, 8 * llc_bytes), GIB)
    return max(16 * MIB, min(want, available // 8)) // MIB * MIB


def _touch(chunk: np.ndarray) -> None:
    """Write every page (numpy releases the GIL): first touch from the reading thread places it near it."""
    chunk.fill(1.0)


def _read(chunk: np.ndarray, passes: int) -> float:
    """Read ``chunk`` ``passes`` times (a float64 sum streams memory and releases the GIL)."""
    total = 0.0
    for _ in range(passes):
        total += float(chunk.sum())
    return total


def _best_gbs(run: Callable[[int], object], nbytes: int, repeats: int, target_s: float = 0.03) -> float:
    """Best GB/s of ``run(passes)`` over ``repeats``; passes sized so one repeat lasts about ``target_s``."""
    t0 = time.perf_counter()
    run(1)  # warm-up, also calibrates the pass count
    passes = min(64, max(1, math.ceil(target_s / max(time.perf_counter() - t0, 1e-6))))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(passes)
        best = min(best, time.perf_counter() - t0)
    return nbytes * passes / best / 1e9


def ram_read_bandwidth(available: int, threads: int, repeats: int = 3) -> RamBandwidth:
    """Measure RAM read bandwidth with ``threads`` threads and with one.

    Args:
        available: bytes of RAM available now (the buffer is at most an eighth of it).
        threads: reader threads for the multi-threaded figure (usually every usable CPU).
        repeats: timed repetitions; the best counts (noise only ever slows a read down).

    Returns:
        GB/s (1e9 bytes/s) with ``threads`` threads and with one, and the buffer size used.
    """
    size = ram_buffer_bytes(available, last_level_cache_bytes())
    buf = np.empty(size // 8, dtype=np.float64)
    chunks = np.array_split(buf, threads)
    with ThreadPoolExecutor(threads, thread_name_prefix="probe-ram") as pool:
        list(pool.map(_touch, chunks))
        multi = _best_gbs(lambda passes: list(pool.map(_read, chunks, [passes] * threads)), size, repeats)
    single = _best_gbs(lambda passes: _read(buf, passes), size, repeats)
    log.info("probe: RAM read %.1f GB/s (%d threads), %.1f GB/s (1 thread), %d MiB buffer",
             multi, threads, single, size // MIB)
    return RamBandwidth(gbs=multi, gbs_1thread=single, threads=threads, buffer_bytes=size)


# -- storage -------------------------------------------------------------------------------------------
def _timed_read(fd: int, limit: int, chunk: int, time_limit_s: float) -> tuple[int, float]:
    """Read sequentially from offset 0 into a page-aligned buffer; (bytes, seconds)."""
    buf = mmap.mmap(-1, chunk)  # anonymous mmap: page-aligned, as O_DIRECT requires
    view = memoryview(buf)
    done = 0
    t0 = time.perf_counter()
    try:
        while done < limit and time.perf_counter() - t0 < time_limit_s:
            n = os.preadv(fd, [view], done)
            done += n
            if n < chunk:
                break  # end of file
    finally:
        elapsed = time.perf_counter() - t0
        view.release()
        buf.close()
    return done, elapsed


def _read_direct(path: Path, limit: int, chunk: int, time_limit_s: float) -> tuple[int, float] | None:
    """Read with O_DIRECT; None where the filesystem refuses it (tmpfs, some overlays)."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    try:
        return _timed_read(fd, limit, chunk, time_limit_s)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    finally:
        os.close(fd)


def _read_dropped(path: Path, limit: int, chunk: int, time_limit_s: float) -> tuple[int, float, str]:
    """Flush and drop the file's cached pages, then read through the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        method = "buffered (page cache not dropped)"
        if hasattr(os, "posix_fadvise"):
            try:
                os.fsync(fd)  # DONTNEED skips dirty pages: a freshly written model must reach the disk first
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            method = "fadvise_dontneed"
        done, elapsed = _timed_read(fd, limit, chunk, time_limit_s)
        return done, elapsed, method
    finally:
        os.close(fd)


def storage_read_speed(path: Path, limit: int = 512 * MIB, chunk: int = 8 * MIB,
                       time_limit_s: float = 2.0, direct: bool = True) -> StorageRead:
    """Measure sequential read throughput of the drive holding ``path``, bypassing the page cache.

    Args:
        path: the file to read (the model, so the figure is for the drive it will load from).
        limit: read at most this many bytes.
        chunk: bytes per read (a multiple of the page size).
        time_limit_s: stop after this long on a slow drive.
        direct: try O_DIRECT first; False goes straight to the fadvise fallback.

    Returns:
        GB/s, the method (``o_direct``, ``fadvise_dontneed`` or ``buffered ...``; a file under 64 MiB is
        flagged, its figure being dominated by latency) and the bytes read.
    """
    size = path.stat().st_size
    got = _read_direct(path, limit, chunk, time_limit_s) if direct else None
    if got is not None:
        done, elapsed, method = got[0], got[1], "o_direct"
    else:
        done, elapsed, method = _read_dropped(path, limit, chunk, time_limit_s)
    if size < SMALL_FILE_BYTES:
        method += f" (small file: {size / MIB:.1f} MiB)"
    gbs = done / max(elapsed, 1e-9) / 1e9
    log.info("probe: storage read %.2f GB/s (%s, %d MiB of %s)", gbs, method, done // MIB, path.name)
    return StorageRead(gbs=gbs, method=method, bytes_read=done)
