"""Typed errors of the records package. Each message says what to do."""

from __future__ import annotations

from artifacts.errors import FluxError
from artifacts.records.plan import Plan

GIB = 2**30


class SplitShortfall(FluxError):
    """A device has less free memory than the plan needs, and its cached experts cannot make up the difference."""

    def __init__(self, plan: Plan, device: str, free: int, need: int, cached: int) -> None:
        self.device, self.free, self.need, self.cached = device, free, need, cached
        what = (f"dropping all its cached experts frees only {cached / GIB:.2f} GiB" if cached
                else "the plan caches no experts there to drop")
        super().__init__(f"{device} has {free / GIB:.2f} GiB free; plan {plan.id[:12]} needs {need / GIB:.2f} GiB there "
                         f"and {what}: free the memory, or run `flux plan {plan.model_path} --replan`")
