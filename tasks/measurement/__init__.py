"""The measurement stage: the finalists timed in fresh workers within what the budget has left (``measure``).
The work itself lives in ``tasks.measurement.rounds``; the workload's sizing in ``tasks.workload``."""
