"""Moved: the nouns of planning are records now (:mod:`artifacts.records`: ``hardware``, ``search``,
``evidence``, ``plan``), shared with the server.

The names below are re-exported only for the modules that still import them from here (``tasks.reference``,
``tasks.bench``, ``scripts/bench_*.py``, ``flows/bench_report.py`` and the bench tests); import them from
``artifacts.records`` instead. This module goes when none does.
"""

from __future__ import annotations

from artifacts.records.hardware import HardwareReport
from artifacts.records.plan import Plan
from artifacts.records.search import Candidate, Finalists, Placement, PlacementSpace

__all__ = ["Candidate", "Finalists", "HardwareReport", "Placement", "PlacementSpace", "Plan"]
