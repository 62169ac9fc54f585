"""GPU figures of the probe stage: measured host-to-device copy bandwidth (the GPUs themselves, from NVML, are
:mod:`engine_bridge.gpu_inventory`'s).

Copy bandwidth is measured through the CUDA runtime (libcudart, by ctypes) in a child process
(``python -m tasks.probing.gpu BUS_ID...``): a CUDA context in the planning process would hold GPU
memory through the later stages and make forking unsafe, and a driver fault must not kill the flow.
The child maps NVML's PCI bus ids to CUDA device numbers, since CUDA_VISIBLE_DEVICES and CUDA's
device order can differ from NVML's.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engine_bridge.gpu_inventory import cudart_candidates

log = logging.getLogger(__name__)

MIB = 2**20
REPO_ROOT = Path(__file__).resolve().parents[1]
H2D = 1  # cudaMemcpyHostToDevice
COPY_BYTES = 256 * MIB


class CudaError(Exception):
    """A CUDA runtime call returned an error (only raised and caught inside the copy probe)."""

    def __init__(self, call: str, code: int, text: str) -> None:
        self.call, self.code, self.text = call, code, text
        super().__init__(f"{call} failed: {text} (cudaError {code})")


def normalize_bus_id(bus_id: str) -> str:
    """One spelling of a PCI address: NVML writes '00000000:3B:00.0', CUDA '0000:3b:00.0'."""
    try:
        *dom, bus, devfn = bus_id.strip().lower().split(":")
        dev, _, fn = devfn.partition(".")
        return f"{int(dom[0] if dom else '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn or '0', 16)}"
    except (ValueError, IndexError):
        return bus_id.strip().lower()


# -- libcudart -----------------------------------------------------------------------------------------
def _declare(rt: ctypes.CDLL) -> None:
    """Argument and result types of the runtime calls used here (all return cudaError_t)."""
    vp, pvp, sz, i = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int
    for name, args in (("cudaGetDeviceCount", [ctypes.POINTER(i)]), ("cudaSetDevice", [i]),
                       ("cudaDeviceGetPCIBusId", [ctypes.c_char_p, i, i]), ("cudaMalloc", [pvp, sz]),
                       ("cudaMallocHost", [pvp, sz]), ("cudaFree", [vp]), ("cudaFreeHost", [vp]),
                       ("cudaMemcpy", [vp, vp, sz, i]), ("cudaDeviceSynchronize", []),
                       ("cudaMemGetInfo", [ctypes.POINTER(sz), ctypes.POINTER(sz)]), ("cudaDeviceReset", [])):
        fn = getattr(rt, name)
        fn.restype, fn.argtypes = i, args
    rt.cudaGetErrorString.restype, rt.cudaGetErrorString.argtypes = ctypes.c_char_p, [i]


def _check(rt: ctypes.CDLL, call: str, code: int) -> None:
    """Raise CudaError for a nonzero cudaError_t."""
    if code != 0:
        raise CudaError(call, code, (rt.cudaGetErrorString(code) or b"?").decode(errors="replace"))


def load_cudart() -> ctypes.CDLL | None:
    """The first libcudart that loads AND sees a device (a runtime newer than the driver sees none).

    Returns:
        The library with its calls declared, or None (no library, no driver, no device).
    """
    for cand in cudart_candidates():
        try:
            rt = ctypes.CDLL(cand)
            _declare(rt)
        except (OSError, AttributeError):
            continue
        n = ctypes.c_int(0)
        code = rt.cudaGetDeviceCount(ctypes.byref(n))
        if code == 0 and n.value > 0:
            log.info("probe: %s sees %d CUDA device(s)", cand, n.value)
            return rt
        log.debug("probe: %s sees no CUDA device (cudaError %d: %s)", cand, code,
                  (rt.cudaGetErrorString(code) or b"?").decode(errors="replace"))
    log.info("probe: no CUDA runtime that sees a device: host-to-device bandwidth not measured")
    return None


# -- copy bandwidth ------------------------------------------------------------------------------------
def _best_copy_gbs(rt: ctypes.CDLL, dst: int, src: int, nbytes: int, repeats: int = 5) -> float:
    """Best GB/s of synchronous host-to-device copies of ``nbytes`` (after one warm-up copy)."""
    _check(rt, "cudaMemcpy", rt.cudaMemcpy(dst, src, nbytes, H2D))
    _check(rt, "cudaDeviceSynchronize", rt.cudaDeviceSynchronize())
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        _check(rt, "cudaMemcpy", rt.cudaMemcpy(dst, src, nbytes, H2D))
        _check(rt, "cudaDeviceSynchronize", rt.cudaDeviceSynchronize())
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _copy_size(rt: ctypes.CDLL, want: int) -> int:
    """``want`` bytes, or a quarter of the device's free memory when that is smaller (at least 16 MiB)."""
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _check(rt, "cudaMemGetInfo", rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)))
    return max(16 * MIB, min(want, free.value // 4)) // MIB * MIB


def measure_h2d(rt: ctypes.CDLL, device: int, nbytes: int = COPY_BYTES) -> tuple[float, float]:
    """Host-to-device GB/s of CUDA device ``device`` from pinned and from pageable host memory.

    Raises:
        CudaError: a runtime call failed (out of memory, device lost, ...).
    """
    _check(rt, "cudaSetDevice", rt.cudaSetDevice(device))
    try:
        nbytes = _copy_size(rt, nbytes)
        dev, pinned = ctypes.c_void_p(), ctypes.c_void_p()
        _check(rt, "cudaMalloc", rt.cudaMalloc(ctypes.byref(dev), nbytes))
        _check(rt, "cudaMallocHost", rt.cudaMallocHost(ctypes.byref(pinned), nbytes))
        ctypes.memset(pinned, 1, nbytes)  # touch: the first copy must not pay for page faults
        pinned_gbs = _best_copy_gbs(rt, int(dev.value or 0), int(pinned.value or 0), nbytes)
        _check(rt, "cudaFreeHost", rt.cudaFreeHost(pinned))
        host = np.ones(nbytes, dtype=np.uint8)  # ordinary (pageable) memory, touched
        pageable_gbs = _best_copy_gbs(rt, int(dev.value or 0), int(host.ctypes.data), nbytes)
        return pinned_gbs, pageable_gbs
    finally:
        rt.cudaDeviceReset()  # frees this device's allocations and its context


def measure_all(bus_ids: Sequence[str], nbytes: int = COPY_BYTES) -> dict[str, list[float]]:
    """Copy bandwidth of each GPU named by PCI bus id, as {bus_id: [pinned_gbs, pageable_gbs]}.

    GPUs CUDA cannot see (no runtime, CUDA_VISIBLE_DEVICES) or whose measurement fails are left out.
    """
    rt = load_cudart()
    if rt is None:
        return {}
    n = ctypes.c_int(0)
    _check(rt, "cudaGetDeviceCount", rt.cudaGetDeviceCount(ctypes.byref(n)))
    by_bus: dict[str, int] = {}
    for i in range(n.value):
        buf = ctypes.create_string_buffer(64)
        if rt.cudaDeviceGetPCIBusId(buf, 64, i) == 0:
            by_bus[normalize_bus_id(buf.value.decode())] = i
    out: dict[str, list[float]] = {}
    for bus in bus_ids:
        dev = by_bus.get(normalize_bus_id(bus))
        if dev is None:
            log.info("probe: GPU %s is not visible to CUDA: copy bandwidth not measured", bus)
            continue
        try:
            out[bus] = list(measure_h2d(rt, dev, nbytes))
        except CudaError as exc:
            log.warning("probe: host-to-device copy on GPU %s: %s", bus, exc)
    return out


def host_to_device_bandwidth(bus_ids: Sequence[str], timeout_s: float = 120.0) -> dict[str, tuple[float, float]]:
    """Measure host-to-device copy bandwidth of each GPU in a child process.

    Args:
        bus_ids: PCI bus ids from :func:`engine_bridge.gpu_inventory.nvml_inventory`.
        timeout_s: kill the child after this long.

    Returns:
        {bus_id: (pinned_gbs, pageable_gbs)} for the GPUs measured; empty when none could be (no CUDA
        runtime, no driver, child failed or timed out: each is logged, none raises).
    """
    if not bus_ids:
        return {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, "-m", "tasks.probing.gpu", *bus_ids], capture_output=True, text=True,
                              timeout=timeout_s, env=env, cwd=str(REPO_ROOT), check=False)
    except subprocess.TimeoutExpired:
        log.warning("probe: host-to-device copy probe took over %g s: killed, not measured", timeout_s)
        return {}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        log.warning("probe: host-to-device copy probe exited %d: %s", proc.returncode, tail[0])
        return {}
    return {bus: (float(v[0]), float(v[1])) for bus, v in json.loads(lines[-1]).items()}


def main(argv: Sequence[str]) -> int:
    """Child entry point: measure the GPUs named by bus id; one JSON line on stdout."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    sys.stdout.write(json.dumps(measure_all(list(argv))) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
