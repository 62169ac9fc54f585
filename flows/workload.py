"""Moved: the planning workload's sizing is :mod:`tasks.workload`. This name stays only for
``scripts/quality_floor.py``, which still imports ``validation_prompts`` from here; it goes when that script
imports from ``tasks.workload``."""

from __future__ import annotations

from tasks.workload import validation_prompts

__all__ = ["validation_prompts"]
