"""One declaration per stored kind of record: its name in the store and its model (TVM's ``Database`` of typed
records; ``Records`` reads and writes them by these declarations).

A kind's name is a directory of the store (``objects/<name>/<id>.json``) and its catalog kind: renaming one
orphans every stored record of it. Table kinds (Parquet rows, not models) are named here too, so that no
module spells them twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

from artifacts.records.evidence import MeasureResults, ValidationReport
from artifacts.records.hardware import HardwareReport
from artifacts.records.plan import ModelPath, Plan
from artifacts.records.routing import RoutingProfile
from artifacts.records.search import Finalists, PlacementSpace

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class Kind(Generic[M]):
    """A stored kind of JSON record: the store's name for it, its model, and how a person lists what is stored."""

    name: str
    model: type[M]
    listed_by: str = ""

    def listing(self) -> str:
        """The command that lists the stored records of this kind."""
        return self.listed_by or f"`flux sql \"SELECT id FROM objects WHERE kind = '{self.name}'\"`"


KINDS: dict[str, Kind[Any]] = {}


def declare(name: str, model: type[M], listed_by: str = "") -> Kind[M]:
    """Declare a stored kind once (a second declaration of ``name`` is a programming error)."""
    if name in KINDS:
        raise ValueError(f"record kind {name!r} is declared twice")
    kind = Kind(name, model, listed_by)
    KINDS[name] = kind
    return kind


PLAN = declare("plan", Plan, "`flux plans`")
PROBE = declare("probe", HardwareReport)
ROUTING_PROFILE = declare("routing_profile", RoutingProfile)
SPACE = declare("space", PlacementSpace)
FINALISTS = declare("finalists", Finalists)
MEASURED = declare("measured", MeasureResults)
VALIDATION = declare("validation", ValidationReport)
MODEL_PATH = declare("model_path", ModelPath)  # where `flux plan` saw a model's bytes, newest last

# Table kinds: Parquet rows (pyarrow tables), each a view of its own in `flux sql`.
ROUTING_TABLE = "routing"  # a routing trace's counts (engine_bridge.routing_trace)
TRIALS_RAW_TABLE = "trials_raw"  # the measure stage's trials
TRIALS_TABLE = "trials"  # a plan's trials, keyed by the id its plan records (Plan.trials_table)
