"""The planning stages in the order ``plan-model`` starts them: probe → reference (beside the next three) → route
→ enumerate → prune → measure → validate → persist. Each is declared once, in its own module (:class:`tasks.stage.Stage`); a new
stage is a module with a ``STAGE``, listed here and composed in ``flows/plan_model.py``
(``tests/layout/test_layering.py`` checks that every stage listed is run by the flow, once)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from artifacts.code_id import ROOT
from artifacts.ids import content_id
from tasks.measurement.measure import STAGE as MEASURE
from tasks.probing.probe import STAGE as PROBE
from tasks.probing.route import STAGE as ROUTE
from tasks.recording.persist import STAGE as PERSIST
from tasks.recording.persist import existing_plan, remember_model_path
from tasks.search.enumerate import STAGE as ENUMERATE
from tasks.search.prune import STAGE as PRUNE
from tasks.stage import PlanContext, Stage
from tasks.validation.reference import STAGE as REFERENCE
from tasks.validation.validate import STAGE as VALIDATE

STAGES: tuple[Stage[Any], ...] = (PROBE, REFERENCE, ROUTE, ENUMERATE, PRUNE, MEASURE, VALIDATE, PERSIST)


def pipeline_code(root: Path = ROOT) -> str:
    """The plan key's code: every stage's (:meth:`tasks.stage.Stage.code`), so a plan is remade when any stage's
    sources change and kept when only what serves or shows plans does."""
    return content_id({s.name: s.code(root) for s in STAGES})

__all__ = ["ENUMERATE", "MEASURE", "PERSIST", "PROBE", "PRUNE", "REFERENCE", "ROUTE", "STAGES", "VALIDATE",
           "PlanContext", "Stage", "existing_plan", "pipeline_code",
           "remember_model_path"]
