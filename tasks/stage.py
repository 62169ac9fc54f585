"""A planning stage, declared once: its name, version, key, run, typed result and the tables it stores.

Each stage's module (under ``tasks/probing``, ``tasks/search``, ``tasks/measurement``, ``tasks/validation``,
``tasks/recording``) holds one :class:`Stage`; :mod:`tasks.pipeline` lists them in the order the flow runs them.
The flow (``flows/plan_model.py``) only composes the declarations and ``flows/stages.py`` runs any of them the
same way: the stored result when the store holds one under the stage's key, else ``run`` (its result stored
under the key), timed on the flow's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from artifacts.code_id import ROOT, sources_id
from artifacts.config import Settings
from artifacts.drafting import Drafting
from artifacts.engine_spec import NATIVE_SPEC, EngineSpec
from artifacts.model_info import ModelInfo
from artifacts.records.hardware import MachineFacts
from artifacts.records.kinds import Kind
from artifacts.records.plan import PlanRequest
from artifacts.records.store import Records
from artifacts.store import Store
from tasks.clock import StageClock
from tasks.cores import CoreShare

R = TypeVar("R")
# The worker modules a stage runs in a worker process (it names them: it does not import them), for
# Stage.sources: the protocol loop, and the ops that load a model and time, score or trace it.
WORKER = ("engine_bridge.worker.process", "engine_bridge.worker.handlers", "engine_bridge.worker.state",
          "engine_bridge.worker.load", "engine_bridge.worker.threads")
NATIVE_OPS = (*WORKER, "engine_bridge.worker.native")


@dataclass(frozen=True)
class PlanContext:
    """What every stage needs: request, settings, store, model facts, backend build."""

    req: PlanRequest
    settings: Settings
    store: Store
    info: ModelInfo
    model_hash: str
    backend_build: str
    facts: MachineFacts
    code: str = ""  # the plan key's code: every stage's (tasks.pipeline.pipeline_code)
    clock: StageClock = field(default_factory=lambda: StageClock(0.0))
    run_id: str = "no-run"  # the flow run's id: measure and validate are per run (a retry of the run reuses them)
    reprobe: bool = False
    engines: tuple[EngineSpec, ...] = (NATIVE_SPEC,)  # the engines the finalists are measured on (--engines)
    drafting: tuple[Drafting, ...] = ()  # the ways drafting is measured (--speculation)
    cores: CoreShare = field(default_factory=CoreShare)  # the CPU shared by the trace and the noise floor

    @property
    def model(self) -> Path:
        """The model file."""
        return Path(self.req.model)

    @property
    def records(self) -> Records:
        """The store's records, typed by kind."""
        return Records(self.store)

    @property
    def worker_log(self) -> Path:
        """Where planning workers write their output."""
        return self.settings.logs_dir / "plan-worker.log"

    def settings_view(self) -> dict[str, Any]:
        """The settings that shape a plan (part of its key): with a configured engine among ``--engines``, its
        ``[engines.NAME]`` template too, so a changed command makes a new plan (without one, plans saved before
        engines were configurable still match)."""
        view = {"host_reserve_percent": self.settings.host_reserve_percent,
                **self.settings.plan.model_dump(exclude={"tuning_budget_s"})}
        configured = [e.model_dump(mode="json") for e in self.engines if e.kind == "command"]
        return {**view, "engines": configured} if configured else view


@dataclass(frozen=True)
class Artifact:
    """What a stage shows a person in the Prefect UI: a table of rows or a markdown page."""

    key: str
    description: str
    table: list[dict[str, Any]] | None = None
    markdown: str | None = None


@dataclass(frozen=True)
class Stage(Generic[R]):
    """One planning stage.

    ``run(ctx, log, *inputs) -> R`` computes the result; with a ``kind`` and a ``key(ctx, *inputs)``, the result
    is a record of that kind stored under ``content_id(key)`` and reused whenever the key matches (``force``
    recomputes it). A stage without a key keeps its own cache (``computed`` says whether it computed) or, with a
    ``kind``, stores its record itself (persist: the plan). ``inputs`` names what the key is made of, for people (docs/architecture.md's stage table).

    A stage at ``version`` 1 is keyed by its key alone; bumping ``version`` (a stored result whose meaning
    changed) adds it to the key, so older results are no longer found. Its key carries :meth:`code`: the hash of
    the module declaring it and all it imports, and of the worker modules it runs (``sources``).
    """

    name: str
    version: int
    result: type[Any]
    run: Callable[..., R]
    inputs: tuple[str, ...] = ()
    kind: Kind[Any] | None = None
    key: Callable[..., dict[str, Any]] | None = None
    tables: tuple[str, ...] = ()
    when: Callable[..., bool] | None = None  # (ctx, log, *inputs): False skips the stage (its result is None)
    recovers: tuple[type[Exception], ...] = ()  # failures that leave the result None instead of failing the plan
    recovery: str = ""  # the log's warning when one of ``recovers`` happens ("{error}": the failure)
    force: Callable[[PlanContext], bool] | None = None
    computed: Callable[[Any], bool] | None = None  # for a stage that keeps its own cache
    report: Callable[..., None] | None = None  # (ctx, log, result, *inputs), computed or reused
    artifact: Callable[[Any], Artifact] | None = None
    faults: bool = False  # FLUX_FAULT_INJECT may fail it (retries are tested on it)
    clocked: bool = True  # False: the stage runs after the clock closes (persist records the clock)
    sources: tuple[str, ...] = ()  # worker modules whose ops it runs (WORKER, NATIVE_OPS, ...): not imported

    def code(self, root: Path = ROOT) -> str:
        """The hash of the sources this stage's result depends on (:func:`artifacts.code_id.sources_id`)."""
        return sources_id((self.run.__module__, *self.sources), root)

    def key_of(self, ctx: PlanContext, *inputs: Any) -> dict[str, Any]:
        """The stage's store key for these inputs."""
        if self.key is None:
            raise TypeError(f"stage {self.name} keeps no record in the store")
        key = self.key(ctx, *inputs)
        return key if self.version == 1 else {**key, "stage_version": self.version}
