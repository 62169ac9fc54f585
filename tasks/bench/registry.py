"""The bench suite registry: each suite module declares one :class:`Suite`; ``flux bench`` is built from them.

A suite's flags are its options model's fields, named ``--field-name`` unless ``rename`` says otherwise, typed
and documented by the model (a bool that defaults to true becomes ``--no-field-name``; a ``Literal`` becomes a
choice; tuples and lists take comma-separated values). Adding a suite is adding a module with ``SUITE`` in this
package (and its name in :data:`ORDER`, where ``flux bench --help`` and ``flux bench matrix`` list it; a
suite left out comes after those, by name).

A suite measures a saved plan (``flux bench SUITE PLAN``: its run function gets a :class:`BenchContext`), or,
where ``subject`` says so, something a plan is not needed for: ``"preset"``, a synth preset named on the command
line (``flux bench synth tiny-moe``), given to the options model as its ``preset`` field, or ``"pairs"``, the GPU
record's ``MODEL:BUDGET`` pairs (``flux bench record qwen3-30b-a3b/skewed:12 --out DIR``), given as its ``pairs``
field and optional (the field's default); its run function gets the machine alone (a
:class:`~tasks.bench.context.BenchSite`) and its rows are stored with no plan id. A run function returns None
where it measured nothing, only filed earlier results (``flux bench record --import``): nothing is stored.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel

from tasks.bench.context import Progress
from tasks.bench.record import BenchRun

# The one order of the suites: ``flux bench --help``, its subcommands and the matrix's columns.
ORDER: tuple[str, ...] = ("run", "quality", "conformance", "soak", "arrivals", "ablate", "oracle", "serve", "ttft",
                          "synth", "record")
Subject = Literal["plan", "preset", "pairs"]
# (a BenchContext, or a BenchSite for a suite whose subject is not a plan; its options; progress) -> the run
# (None: nothing measured, nothing to store)
RunFn = Callable[[Any, Any, Progress | None], BenchRun | None]


@dataclass(frozen=True)
class Suite:
    """One ``flux bench`` suite.

    Attributes:
        flags: the option fields offered as flags, in the order ``--help`` lists them.
        rename: field -> flag name where it differs from ``--field-name`` (e.g. ``n_tokens`` -> ``--tokens``).
        parsers: field -> parser of the flag's text, where the field's type alone does not say.
        help_text: field -> help where the field's description is not what a user needs.
        subject: what the suite measures: a saved plan, a synth preset or the GPU record's pairs (see the module's
            docstring).
    """

    name: str
    help: str
    description: str
    options: type[BaseModel]
    run: RunFn
    flags: tuple[str, ...]
    rename: Mapping[str, str] = field(default_factory=dict)
    parsers: Mapping[str, Callable[[str], Any]] = field(default_factory=dict)
    help_text: Mapping[str, str] = field(default_factory=dict)
    subject: Subject = "plan"

    def flag(self, name: str) -> str:
        """The command-line flag of option field ``name``."""
        return self.rename.get(name) or "--" + name.replace("_", "-")


def suites() -> dict[str, Suite]:
    """Every suite this package declares, by name, in :data:`ORDER` (then by name)."""
    import tasks.bench as package

    out: dict[str, Suite] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        suite = getattr(importlib.import_module(f"tasks.bench.{info.name}"), "SUITE", None)
        if isinstance(suite, Suite):
            out[suite.name] = suite
    return dict(sorted(out.items(), key=lambda kv: (ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER), kv[0])))


def csv(text: str) -> tuple[str, ...]:
    """Comma-separated values."""
    return tuple(x.strip() for x in text.split(",") if x.strip())
