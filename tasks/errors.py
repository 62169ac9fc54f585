"""Typed errors of the planning pipeline; each says what to change."""

from __future__ import annotations

from artifacts.errors import FluxError


class ImpossiblePlan(FluxError):
    """No candidate can satisfy the request on this machine."""

    def __init__(self, problem: str, fix: str) -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(f"cannot plan: {problem}; {fix}")


class NoMeasurement(FluxError):
    """Every finalist failed or the budget allowed no trial."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"no finalist could be measured ({detail}): raise --budget-s or see the worker log")
