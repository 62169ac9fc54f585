"""Probing stages: what this machine is (``probe``) and how the model's routers pick experts on the workload
(``route``). Each module declares one :class:`tasks.stage.Stage`; the work itself lives in ``tasks.probing.machine*`` and
``tasks.probing.trace``."""
