"""GPU memory of a process tree, read through NVML (a stand-in NVML: this machine has no GPU) in both of
NVML's modes: per-process figures, and hidden ones where the device's use above a baseline stands in."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from engine_bridge.gpumem import GpuMemoryMeter, over_budget, tree_pids
from engine_bridge.testing import GIB, FakeNvml

# A real two-process tree, like `flux serve` (the server) and its engine worker (a child process).
TREE = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(c.pid, flush=True); time.sleep(60)")


@pytest.fixture()
def tree() -> Iterator[tuple[int, int]]:
    """(server pid, worker pid) of a live process tree."""
    p = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    child = int(p.stdout.readline())
    try:
        yield p.pid, child
    finally:
        subprocess.run(["kill", str(child)], check=False)
        p.kill()
        p.wait()


def test_the_tree_is_the_server_and_its_worker(tree: tuple[int, int]) -> None:
    server, worker = tree
    assert set(tree_pids(server)) == {server, worker}


def test_per_process_figures_add_up_over_the_tree(tree: tuple[int, int]) -> None:
    server, worker = tree
    nv = FakeNvml(totals=[140 * GIB], base=[GIB // 2])
    meter = GpuMemoryMeter(nv)
    nv.start(server, [GIB // 4])       # the server's CUDA context (none in Flux's, but counted if there)
    nv.start(worker, [13 * GIB])       # the worker: weights, KV, buffers
    nv.start(424242, [5 * GIB])        # someone else's process on the same GPU
    r = meter.read(server)
    assert r is not None and r.method == "per-process"
    assert r.total == 13 * GIB + GIB // 4


def test_hidden_figures_count_the_device_delta_once_for_the_tree(tree: tuple[int, int]) -> None:
    """Where NVML lists no per-process figures (a container), the device delta is the tree's, once: the
    H200 read 27.28 GiB for a 13.62 GiB plan by adding it once per process of `flux serve`."""
    server, worker = tree
    nv = FakeNvml(totals=[140 * GIB], base=[GIB // 2], hide_processes=True)
    meter = GpuMemoryMeter(nv)
    meter.rebase()                      # right before the tree starts
    nv.start(worker, [int(13.62 * GIB)])
    r = meter.read(server)
    assert r is not None and r.method == "device-delta"
    assert r.total == int(13.62 * GIB)
    assert meter.read(worker) == r      # the worker alone reads the same: one delta, however it is asked


def test_no_gpu_reads_nothing() -> None:
    """This machine's real NVML (no driver, or no library): nothing to read, nothing to budget."""
    meter = GpuMemoryMeter()
    if meter.available:
        pytest.skip("this machine has a GPU")
    assert meter.read(1) is None and meter.device_free() == [] and meter.device_used() is None


def test_over_budget_names_the_gpu_and_the_total() -> None:
    assert over_budget([int(14.39 * GIB)], [14 * GIB]) == (
        "over the GPU memory budget: measured 14.39 GiB on one GPU, budget 14.00 GiB")
    assert over_budget([13 * GIB], [14 * GIB]) is None
    assert "in all" in (over_budget([10 * GIB, 10 * GIB], [11 * GIB, 8 * GIB]) or "")
