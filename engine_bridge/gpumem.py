"""GPU memory a process tree holds, read through NVML from outside the processes.

NVML's per-process figure (``usedGpuMemory``) covers everything a process holds on a GPU: its CUDA
context, weights, KV cache and the compute buffers llama.cpp reserves for its worst-case batch. A tree
(``flux serve`` and its engine worker) is the sum of its processes' figures.

Some containers hide per-process figures (the list is empty, or every figure is 0). Then the device's use
above a baseline taken before the tree started stands in, **once for the whole tree**: it is one delta of
the device, not one per process (counting it per process doubled ``flux serve``'s reading, which holds a
server and a worker). That method is exact when only the metered tree started since the baseline, as in
the measure stage and the served race (each contender is started and read before the next one starts).
Every reading says which method made it. Without NVML (no GPU, no driver) every reading is ``None``.
"""

from __future__ import annotations

from typing import Any, Literal

import psutil
from pydantic import BaseModel, ConfigDict

GIB = 2**30
Method = Literal["per-process", "device-delta"]


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: the same answer
        return None


class GpuReading(BaseModel):
    """Bytes a process tree holds on each GPU (NVML's device order) and how they were read."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    per_gpu: tuple[int, ...]
    method: Method

    @property
    def total(self) -> int:
        """Bytes on every GPU together."""
        return sum(self.per_gpu)


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every descendant still alive (``flux serve``'s worker is a child process)."""
    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return [pid]


class GpuMemoryMeter:
    """Per-GPU memory held by process trees; ``nvml`` is the pynvml module (or a stand-in with its calls:
    :class:`engine_bridge.testing.FakeNvml`), found and initialised when not given."""

    def __init__(self, nvml: Any | None = None) -> None:
        self._nv = nvml if nvml is not None else _nvml()
        self._baseline: list[int] = self.device_used() or []

    @property
    def available(self) -> bool:
        """Whether NVML answers (a GPU and its driver are present)."""
        return self._nv is not None

    def _handles(self) -> list[Any]:
        nv = self._nv
        if nv is None:
            return []
        return [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]

    def device_used(self) -> list[int] | None:
        """Bytes in use on each GPU (every process's), or ``None`` when unknown."""
        nv = self._nv
        if nv is None:
            return None
        try:
            return [int(nv.nvmlDeviceGetMemoryInfo(h).used) for h in self._handles()]
        except Exception:  # noqa: BLE001 - a driver error reads as unknown
            return None

    def device_free(self) -> list[int]:
        """Bytes free on each GPU now, [] without NVML."""
        nv = self._nv
        if nv is None:
            return []
        try:
            return [int(nv.nvmlDeviceGetMemoryInfo(h).free) for h in self._handles()]
        except Exception:  # noqa: BLE001 - a driver error reads as nothing known
            return []

    def rebase(self) -> None:
        """Take the baseline now (call right before starting the tree to be metered)."""
        self._baseline = self.device_used() or []

    def read(self, pid: int | None) -> GpuReading | None:
        """What ``pid`` and its descendants hold on each GPU, or ``None`` when unknown."""
        nv = self._nv
        if nv is None or pid is None:
            return None
        pids = set(tree_pids(pid))
        try:
            per_proc = [sum(int(p.usedGpuMemory or 0) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)
                            if p.pid in pids) for h in self._handles()]
        except Exception:  # noqa: BLE001 - a driver error reads as unknown
            return None
        if any(per_proc):
            return GpuReading(per_gpu=tuple(per_proc), method="per-process")
        now = self.device_used()
        if now is None:
            return None
        base = self._baseline + [0] * (len(now) - len(self._baseline))
        return GpuReading(per_gpu=tuple(max(0, u - b) for u, b in zip(now, base, strict=True)), method="device-delta")


OVER_BUDGET = "over the GPU memory budget"


def over_budget(used: list[int] | tuple[int, ...] | None, budgets: list[int] | None) -> str | None:
    """Why a measured use breaks the per-GPU budgets, or ``None``.

    NVML numbers every GPU of the host while budgets follow the GPUs llama.cpp sees, so the check is
    order-free: the largest use on any GPU against the largest budget, and the total against their sum
    (exact for one GPU and for equal budgets).
    """
    if not used or not budgets:
        return None
    if max(used) > max(budgets):
        return (f"{OVER_BUDGET}: measured {max(used) / GIB:.2f} GiB on one GPU, "
                f"budget {max(budgets) / GIB:.2f} GiB")
    if sum(used) > sum(budgets):
        return f"{OVER_BUDGET}: measured {sum(used) / GIB:.2f} GiB in all, budget {sum(budgets) / GIB:.2f} GiB"
    return None
