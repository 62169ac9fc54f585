"""Stand-ins for parts that cannot run on a machine without a GPU, shipped with the package so they stay
honest: each implements exactly the calls Flux makes of the real part, with the real part's semantics.

:class:`FakeNvml` answers the pynvml calls :mod:`engine_bridge.gpumem` makes. Processes are started and
stopped on it by the test (``start``/``stop``); with ``hide_processes`` it lists no per-process figures, as
NVML does in some containers, and only the device's totals move.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

GIB = 2**30


@dataclass
class FakeNvml:
    """A host's GPUs as NVML reports them: ``totals`` bytes each, ``base`` bytes used by nobody we meter."""

    totals: list[int]
    base: list[int] = field(default_factory=list)
    hide_processes: bool = False
    procs: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.base = self.base or [0] * len(self.totals)

    def start(self, pid: int, per_gpu: list[int]) -> None:
        """Process ``pid`` now holds ``per_gpu`` bytes (added to what it held)."""
        held = self.procs.setdefault(pid, [0] * len(self.totals))
        self.procs[pid] = [a + b for a, b in zip(held, per_gpu, strict=True)]

    def stop(self, pid: int) -> None:
        """Process ``pid`` exited and freed its memory."""
        self.procs.pop(pid, None)

    # -- the pynvml calls ------------------------------------------------------------------------------
    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - pynvml's name
        return len(self.totals)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetMemoryInfo(self, i: int) -> Any:  # noqa: N802
        used = self.base[i] + sum(p[i] for p in self.procs.values())
        return SimpleNamespace(total=self.totals[i], used=used, free=self.totals[i] - used)

    def nvmlDeviceGetComputeRunningProcesses(self, i: int) -> list[Any]:  # noqa: N802
        if self.hide_processes:
            return []
        return [SimpleNamespace(pid=pid, usedGpuMemory=b[i]) for pid, b in self.procs.items() if b[i]]
