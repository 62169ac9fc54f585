"""How long each planning stage took, what of the budget it used, and what is left: the flow's clock.

``--budget-s B`` is the flow's wall time after probing: the routing trace and reference outputs a model's
first plan makes once, enumerating and pruning, reading reused results back, measuring and validating all
count inside it, so a further plan ends about B after its probe (a probe is reused after a machine's first plan).
The budget is wall time, not a sum of stage times: the reference runs beside the routing trace, enumeration
and pruning (it needs none of them), and the seconds they overlap count once.
Measuring keeps at least half of B whatever came before it, and a first plan's one-time stages take up to
FIRST_PLAN_GRACE_S of their seconds from outside B, as far as B + FIRST_PLAN_SLACK_S leaves room after the
command's start and the probe (:func:`tasks.workload.measure_budget`, :meth:`StageClock.outside_s`). Each
stage reports its time and an estimate of what is left; the plan records every stage's seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import psutil

# Rough seconds of the stages after measuring when nothing is known yet (persist, the flow's end).
TAIL_S = 2.0
OUTSIDE_BUDGET = ("probe",)
ONE_TIME = ("route", "reference")  # a model's first plan computes them; later plans reuse them


_COMMAND_START: list[float] = []  # wall time the `flux plan` process started, once the command marks it


def mark_command_start() -> None:
    """Count the time since this process started (interpreter, imports, the Prefect server) as the plan's: the
    `flux plan` command calls it; a flow run in another program's process counts from its clock alone."""
    try:
        _COMMAND_START[:] = [psutil.Process().create_time()]
    except psutil.Error:
        _COMMAND_START.clear()


def command_age_s() -> float:
    """Seconds since the `flux plan` process started, 0 when the command did not mark it."""
    return max(0.0, time.time() - _COMMAND_START[0]) if _COMMAND_START else 0.0


@dataclass
class StageTimer:
    """One stage's running record: set ``computed`` when its result was not reused from the store."""

    name: str
    computed: bool = True


@dataclass
class StageClock:
    """Seconds per stage, whether each computed or reused, and the budget they leave."""

    budget_s: float
    say: Callable[[str], None] | None = None
    t0: float = field(default_factory=time.monotonic)
    seconds: dict[str, float] = field(default_factory=dict)
    computed: dict[str, bool] = field(default_factory=dict)
    budget_t0: float | None = None  # when the budget began: the end of the probe
    ends: dict[str, float] = field(default_factory=dict)  # when each stage ended (monotonic)
    started_after_s: float = field(default_factory=command_age_s)  # the command's age when the clock began

    @contextmanager
    def stage(self, name: str) -> Iterator[StageTimer]:
        """Time one stage; log its time and what is left when it ends."""
        timer = StageTimer(name)
        start = time.monotonic()
        try:
            yield timer
        finally:
            self.ends[name] = time.monotonic()
            self.seconds[name] = round(self.ends[name] - start, 2)
            self.computed[name] = timer.computed
            if name in OUTSIDE_BUDGET:
                self.budget_t0 = time.monotonic()
            if self.say is not None:
                self.say(f"{name}: {self.seconds[name]:.0f} s ({'computed' if timer.computed else 'reused'}); "
                         f"{time.monotonic() - self.t0:.0f} s so far, about {self.left_s():.0f} s left")

    def in_budget_spent(self) -> float:
        """Seconds of the budget used so far: the wall time since the probe ended (since the clock started when
        no probe was timed), whatever ran in it, computed or reused, one stage or two at once."""
        return time.monotonic() - (self.budget_t0 if self.budget_t0 is not None else self.t0)

    def one_time_s(self) -> float:
        """Seconds of the budget spent while a model's one-time stages (routing trace, reference) were computed:
        the wall time from the probe's end to the last of them, 0 when every one was reused."""
        ends = [self.ends[n] for n in ONE_TIME if self.computed.get(n) and n in self.ends]
        start = self.budget_t0 if self.budget_t0 is not None else self.t0
        return max(ends) - start if ends else 0.0

    def outside_s(self) -> float:
        """Seconds of the command's wall time outside the budget: the process's start before the clock, the
        stages outside the budget (the probe), and the tail still to come."""
        return self.started_after_s + sum(self.seconds.get(n, 0.0) for n in OUTSIDE_BUDGET) + TAIL_S

    def command_s(self) -> float:
        """Seconds since the command started (the process's start before the clock included)."""
        return self.started_after_s + time.monotonic() - self.t0

    def left_s(self) -> float:
        """Estimated seconds until the plan is saved: what the budget has left, plus the tail."""
        return max(0.0, self.budget_s - self.in_budget_spent()) + TAIL_S if "validate" not in self.seconds else TAIL_S

    def record(self) -> dict[str, float]:
        """Seconds per stage and the total, for the plan."""
        return {**self.seconds, "total": round(time.monotonic() - self.t0, 2)}
