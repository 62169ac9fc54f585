"""GPU memory a worker process holds, read through NVML from outside the process.

NVML's per-process figure (``usedGpuMemory``) covers everything the process holds on a GPU: its CUDA
context, weights, KV cache and the compute buffers llama.cpp reserves for its worst-case batch. Some
containers hide per-process figures; then the device's use above a baseline taken before the worker
started stands in (exact when one worker runs at a time, as in the measure stage). Without NVML (no
GPU, no driver) every reading is ``None``: there is nothing to budget.
"""

from __future__ import annotations

from typing import Any


def _nvml() -> Any | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - no library, no driver, no GPU: the same answer
        return None


class GpuMemoryMeter:
    """Per-GPU memory held by one process, in NVML's device order."""

    def __init__(self) -> None:
        self._nv = _nvml()
        self._baseline: list[int] = self._device_used() or []

    @property
    def available(self) -> bool:
        """Whether NVML answers (a GPU and its driver are present)."""
        return self._nv is not None

    def _device_used(self) -> list[int] | None:
        nv = self._nv
        if nv is None:
            return None
        try:
            return [int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).used)
                    for i in range(nv.nvmlDeviceGetCount())]
        except Exception:  # noqa: BLE001 - a driver error reads as unknown
            return None

    def rebase(self) -> None:
        """Take the baseline now (call before starting the worker to be metered)."""
        self._baseline = self._device_used() or []

    def used_by(self, pid: int | None) -> list[int] | None:
        """Bytes ``pid`` holds on each GPU, or ``None`` when unknown."""
        nv = self._nv
        if nv is None or pid is None:
            return None
        try:
            per_proc: list[int] = []
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                per_proc.append(sum(int(p.usedGpuMemory or 0) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)
                                    if p.pid == pid))
        except Exception:  # noqa: BLE001 - a driver error reads as unknown
            return None
        if any(per_proc):
            return per_proc
        now = self._device_used()
        if now is None:
            return None
        base = self._baseline + [0] * (len(now) - len(self._baseline))
        return [max(0, u - b) for u, b in zip(now, base, strict=True)]


def over_budget(used: list[int] | None, budgets: list[int] | None) -> str | None:
    """Why a measured use breaks the per-GPU budgets, or ``None``.

    NVML numbers every GPU of the host while budgets follow the GPUs llama.cpp sees, so the check is
    order-free: the largest use on any GPU against the largest budget, and the total against their sum
    (exact for one GPU and for equal budgets).
    """
    if not used or not budgets:
        return None
    gib = 2**30
    if max(used) > max(budgets):
        return (f"over the GPU memory budget: measured {max(used) / gib:.2f} GiB on one GPU, "
                f"budget {max(budgets) / gib:.2f} GiB")
    if sum(used) > sum(budgets):
        return f"over the GPU memory budget: measured {sum(used) / gib:.2f} GiB in all, budget {sum(budgets) / gib:.2f} GiB"
    return None
