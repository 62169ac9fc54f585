"""What the machine was doing while a suite ran: load averages recorded with every run, and the warning that
timings taken under foreign load are noisy."""

from __future__ import annotations

import os
from collections.abc import Sequence


def load_avg() -> list[float]:
    """The machine's 1/5/15-minute load averages (recorded with every run: a busy machine skews timings)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def busy_warning(loads: Sequence[float], cpu_count: int | None = None) -> str | None:
    """A warning when the 1-minute load average during a timed run shows foreign load.

    The engine under test keeps up to one runnable thread per CPU itself, so only a load above the CPU
    count plus half of it (3 on 2 CPUs) is taken as someone else's work.
    """
    cpus, worst = cpu_count or os.cpu_count() or 1, max(loads, default=0.0)
    return None if worst <= cpus + max(1, cpus // 2) else (f"machine busy during the run (load average up to {worst:.1f} on {cpus} "
                                       "CPUs): timings are noisy, rerun on an idle machine")
