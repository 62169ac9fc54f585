"""Typed errors of the planning pipeline; each says what to change."""

from __future__ import annotations

from typing import TYPE_CHECKING

from artifacts.errors import FluxError

if TYPE_CHECKING:
    from artifacts.records.plan import StorageStreaming


class ImpossiblePlan(FluxError):
    """No candidate can satisfy the request on this machine."""

    def __init__(self, problem: str, fix: str) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"cannot plan: {problem}; {fix}")


class NeedsStorageStreaming(ImpossiblePlan):
    """The weights exceed the host memory Flux may use and the request does not allow reading the rest from the
    drive; ``streaming`` holds the decode limit that reading would set."""

    def __init__(self, weights_bytes: int, host_bytes: int, streaming: StorageStreaming) -> None:
        self.weights_bytes, self.host_bytes, self.streaming = weights_bytes, host_bytes, streaming
        limit = streaming.decode_limit_tps
        super().__init__(
            f"the weights ({weights_bytes / 2**30:.2f} GiB) do not fit in usable RAM ({host_bytes / 2**30:.2f} GiB) "
            f"beside the KV cache and compute buffers; read "
            f"from the drive, {streaming.drive_bytes_per_token / 1e6:,.1f} MB per token at "
            f"{streaming.drive_gbs:.2f} GB/s would bound decode to {limit or 0:,.2f} tok/s",
            "pass --allow-storage-streaming to plan with that, or use a smaller quant, lower host_reserve_percent "
            "or raise --host-mem-budget")


class NoMeasurement(FluxError):
    """Every finalist failed or the budget allowed no trial."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"no finalist could be measured ({detail}): raise --budget-s or see the worker log")
