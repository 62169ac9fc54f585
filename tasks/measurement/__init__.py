"""The measurement stage: the finalists timed in fresh workers within what the budget has left (``measure``).
The work itself lives in ``tasks.measure``; the workload's sizing in ``tasks.workload``."""
