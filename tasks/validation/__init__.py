"""Validation stages: the reference outputs and noise floor (``reference``) and the quality gate on the fastest
finalists (``validate``). Each module declares one :class:`tasks.stage.Stage`; the work itself lives in
``tasks.validation.outputs``, ``tasks.validation.gate`` and ``tasks.quality_gate``."""
