"""What GPUs and CUDA runtime this machine has, read without a CUDA context (GPU memory *use* is
:mod:`engine_bridge.gpumem`).

NVML (nvidia-ml-py) gives names, memory, PCIe links, compute capability and the driver; a missing library or
driver means "no NVIDIA GPU", never an error. The CUDA runtime a CUDA build would load is found by file name,
without loading it. The probe, the machine facts plans are keyed by and ``flux serve``'s free-memory check all
read them here.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from artifacts.records.hardware import GpuInfo

log = logging.getLogger(__name__)

CUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")
CUDA_DIRS = (Path("/usr/local/cuda/lib64"), Path("/usr/local/cuda/lib"), Path("/opt/cuda/lib64"))


class NvmlReport(NamedTuple):
    """What NVML says about the GPUs (empty without a driver)."""

    gpus: list[GpuInfo]
    driver: str | None
    bus_ids: list[str]
    cuda_driver: str | None = None


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


_SAID: set[str] = set()


def _say_once(message: str) -> None:
    """Log a machine fact that does not change while the process runs once, not at every probe."""
    if message not in _SAID:
        _SAID.add(message)
        log.info("%s", message)


def nvml_inventory() -> NvmlReport:
    """List NVIDIA GPUs through NVML.

    Returns:
        The GPUs in NVML order, the driver version and each GPU's PCI bus id; no GPUs and driver
        None where nvidia-ml-py is not installed or NVML cannot start (no driver, no device).
    """
    try:
        import pynvml
    except ImportError:
        _say_once("probe: nvidia-ml-py is not installed: no NVIDIA GPUs probed")
        return NvmlReport([], None, [])
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        _say_once(f"probe: NVML unavailable ({exc}): no NVIDIA GPUs")
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
