"""GPU facts of the probe stage: the NVML inventory and measured host-to-device copy bandwidth.

NVML (nvidia-ml-py) gives names, memory, PCIe links, compute capability and the driver. A missing
library or driver means "no NVIDIA GPU", never an error.

Copy bandwidth is measured through the CUDA runtime (libcudart, by ctypes) in a child process
(``python -m tasks.probe_gpu BUS_ID...``): a CUDA context in the planning process would hold GPU
memory through the later stages and make forking unsafe, and a driver fault must not kill the flow.
The child maps NVML's PCI bus ids to CUDA device numbers, since CUDA_VISIBLE_DEVICES and CUDA's
device order can differ from NVML's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import json
import logging
import math
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tasks.plan_types import GpuInfo

log = logging.getLogger(__name__)

MIB = 2**20
REPO_ROOT = Path(__file__).resolve().parents[1]
CUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")
CUDA_DIRS = (Path("/usr/local/cuda/lib64"), Path("/usr/local/cuda/lib"), Path("/opt/cuda/lib64"))
H2D = 1  # cudaMemcpyHostToDevice
COPY_BYTES = 256 * MIB


class NvmlReport(NamedTuple):
    """What NVML says about the GPUs (empty without a driver)."""

    gpus: list[GpuInfo]
    driver: str | None
    bus_ids: list[str]
    cuda_driver: str | None = None


class CudaError(Exception):
    """A CUDA runtime call returned an error (only raised and caught inside the copy probe)."""

    def __init__(self, call: str, code: int, text: str) -> None:
        self.call, self.code, self.text = call, code, text
        super().__init__(f"{call} failed: {text} (cudaError {code})")


# -- NVML ----------------------------------------------------------------------------------------------
def _text(value: str | bytes) -> str:
    """NVML strings are bytes in old nvidia-ml-py, str in new ones."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _optional(nvml: Any, fn: str, *args: Any) -> Any:
    """One NVML query that a device may not support (None then)."""
    try:
        return getattr(nvml, fn)(*args)
    except (nvml.NVMLError, AttributeError):
        return None


def _nvml_gpu(nvml: Any, index: int) -> tuple[GpuInfo, str]:
    """One device: its GpuInfo (without copy bandwidth) and its PCI bus id."""
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _text(nvml.nvmlDeviceGetName(h))
    mem = nvml.nvmlDeviceGetMemoryInfo(h)
    cc = _optional(nvml, "nvmlDeviceGetCudaComputeCapability", h)
    gen = _optional(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", h)  # the link's best (device and slot)
    width = _optional(nvml, "nvmlDeviceGetMaxPcieLinkWidth", h)
    log.info("probe: GPU %d %s, %.1f/%.1f GiB free, PCIe gen %s x%s (now gen %s x%s)", index,
             name, mem.free / 2**30, mem.total / 2**30, gen, width,
             _optional(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", h),
             _optional(nvml, "nvmlDeviceGetCurrPcieLinkWidth", h))
    pci = _optional(nvml, "nvmlDeviceGetPciInfo", h)
    uuid = _optional(nvml, "nvmlDeviceGetUUID", h)
    info = GpuInfo(index=index, name=name, memory_total=int(mem.total),
                   memory_free=int(mem.free), pcie_gen=gen, pcie_width=width,
                   compute_capability=f"{cc[0]}.{cc[1]}" if cc else None, uuid=_text(uuid) if uuid else None)
    return info, _text(pci.busId) if pci is not None else ""


def nvml_inventory() -> NvmlReport:
    """List NVIDIA GPUs through NVML.

    Returns:
        The GPUs in NVML order, the driver version and each GPU's PCI bus id; no GPUs and driver
        None where nvidia-ml-py is not installed or NVML cannot start (no driver, no device).
    """
    try:
        import pynvml
    except ImportError:
        log.info("probe: nvidia-ml-py is not installed: no NVIDIA GPUs probed")
        return NvmlReport([], None, [])
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.info("probe: NVML unavailable (%s): no NVIDIA GPUs", exc)
        return NvmlReport([], None, [])
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = _optional(pynvml, "nvmlSystemGetCudaDriverVersion")
        pairs = [_nvml_gpu(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
    except pynvml.NVMLError as exc:
        log.warning("probe: NVML query failed (%s): no NVIDIA GPUs reported", exc)
        return NvmlReport([], None, [])
    finally:
        pynvml.nvmlShutdown()
    cuda_driver = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None
    return NvmlReport([g for g, _ in pairs], driver, [b for _, b in pairs], cuda_driver)


def normalize_bus_id(bus_id: str) -> str:
    """One spelling of a PCI address: NVML writes '00000000:3B:00.0', CUDA '0000:3b:00.0'."""
    try:
        *dom, bus, devfn = bus_id.strip().lower().split(":")
        dev, _, fn = devfn.partition(".")
        return f"{int(dom[0] if dom else '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn or '0', 16)}"
    except (ValueError, IndexError):
        return bus_id.strip().lower()


# -- libcudart -----------------------------------------------------------------------------------------
def _package_lib_dirs() -> Iterator[Path]:
    """Library folders of installed packages that may bundle libcudart (found without importing them)."""
    for pkg, sub in (("llama_cpp", "lib"), ("nvidia", "cuda_runtime/lib")):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or []) if spec else []:
            yield Path(loc) / sub


def cudart_candidates() -> list[str]:
    """Names and paths to try for libcudart, best first.

    The dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache) comes first, then the llama_cpp
    package's lib folder, the nvidia-cuda-runtime wheel, ``$CUDA_HOME``/``$CUDA_PATH`` and /usr/local/cuda.
    """
    found = ctypes.util.find_library("cudart")
    out = [*CUDART_NAMES, *([found] if found else [])]
    # CUDA_HOME is a library search path in the sense of LD_LIBRARY_PATH, which the loader reads itself.
    homes = [Path(v) for v in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if v]
    dirs = [*_package_lib_dirs(), *(h / sub for h in homes for sub in ("lib64", "lib")), *CUDA_DIRS]
    for d in dirs:
        out += [str(d / n) for n in CUDART_NAMES if (d / n).exists()]
    return list(dict.fromkeys(out))


def cuda_runtime_name() -> str | None:
    """The file name of the libcudart a CUDA build would load (its version), without loading it.

    The first candidate that exists as a file, resolved through its links (``libcudart.so.13.0.96``);
    None where no runtime is installed (a CPU machine).
    """
    for cand in cudart_candidates():
        path = Path(cand)
        if path.is_absolute() and path.exists():
            return path.resolve().name
    return None


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
        bus_ids: PCI bus ids from :func:`nvml_inventory`.
        timeout_s: kill the child after this long.

    Returns:
        {bus_id: (pinned_gbs, pageable_gbs)} for the GPUs measured; empty when none could be (no CUDA
        runtime, no driver, child failed or timed out: each is logged, none raises).
    """
    if not bus_ids:
        return {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run([sys.executable, "-m", "tasks.probe_gpu", *bus_ids], capture_output=True, text=True,
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
