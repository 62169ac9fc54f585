"""What a suite runs on: the plan under test (:class:`BenchContext`) and how a plan is opened for a bench, or,
for a suite whose subject is not a plan (``flux bench synth``), only the machine (:class:`BenchSite`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from artifacts.config import Settings
from artifacts.engine_params import EngineParams
from artifacts.filehash import model_hash
from artifacts.model_info import shard_paths
from artifacts.records.kinds import PLAN
from artifacts.records.plan import Plan
from artifacts.records.store import Records
from artifacts.store import Store
from engine_bridge.backend import BackendMissing, backend_info, llama_server_path
from tasks.bench.errors import BenchError

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchSite:
    """Where a suite runs: settings, store, this machine's backend build; all a suite without a plan gets."""

    settings: Settings
    store: Store
    backend_build: str

    @property
    def plan_id(self) -> str:
        """The plan under test's id; empty: no plan."""
        return ""

    @property
    def subject(self) -> str:
        """What the run measured, as its title says it."""
        return "no plan"


@dataclass(frozen=True)
class BenchContext(BenchSite):
    """What a suite of a plan needs: the site's parts, the plan, llama-server."""

    plan: Plan
    llama_server: Path | None

    @property
    def plan_id(self) -> str:
        """The plan under test's id."""
        return self.plan.id

    @property
    def subject(self) -> str:
        """The plan, by its short id."""
        return f"plan {self.plan.id[:12]}"

    @property
    def model(self) -> Path:
        """The plan's model file."""
        return Path(self.plan.model_path)

    @property
    def params(self) -> EngineParams:
        """The plan's engine parameters, with the sequences it serves (``-np`` of the llama-server it is raced
        against: the count --serving-p95-ms chose, at the same context per sequence)."""
        return self.plan.candidate.params.model_copy(update={"n_seq_max": self.plan.sequences})

    @property
    def worker_log(self) -> Path:
        """Where benchmark workers write their output."""
        return self.settings.logs_dir / "bench-worker.log"

    @property
    def server_log(self) -> Path:
        """Where benchmark llama-server processes write their output."""
        return self.settings.logs_dir / "bench-llama-server.log"

    @property
    def timeout_s(self) -> float:
        """Longest wait for one engine call."""
        return self.settings.plan.measure_timeout_s

    def need_llama_server(self) -> Path:
        """The llama-server binary, or a BenchError saying how to build it."""
        if self.llama_server is None:
            raise BenchError("llama-server is not built for this backend: run scripts/build-backend.sh")
        return self.llama_server


def open_bench(settings: Settings, plan_prefix: str, *, check_hash: bool = True) -> BenchContext:
    """Load a plan for benchmarking and check that its model file is still the one it was made for.

    Raises:
        NotFound: no plan id starts with ``plan_prefix`` (or several do).
        BenchError: the plan's model file is gone or changed.
    """
    store = Store(settings.data_dir)
    plan = Records(store).find_by_prefix(PLAN, plan_prefix)
    model = Path(plan.model_path)
    if not model.is_file():
        raise BenchError(f"plan {plan.id[:12]} was made for {model}, which is gone: restore the file, "
                         f"or plan the model again at its new path (`flux plan <model.gguf>`)")
    if check_hash and model_hash(shard_paths(model), settings.cache_dir) != plan.model_hash:
        raise BenchError(f"{model} changed since plan {plan.id[:12]} was made: plan it again "
                         f"(`flux plan {model} --replan`)")
    build = backend_info(settings.cache_dir).build_id
    if build != plan.backend_build:
        log.warning("plan %s was measured on backend %s; this is %s: results describe this build",
                    plan.id[:12], plan.backend_build, build)
    return BenchContext(settings=settings, store=store, plan=plan, backend_build=build,
                        llama_server=llama_server_path(settings.cache_dir))


def open_site(settings: Settings) -> BenchSite:
    """The machine alone, for a suite that needs no plan (its backend build, or ``none`` when none is built)."""
    try:
        build = backend_info(settings.cache_dir).build_id
    except BackendMissing:
        build = "none"
    return BenchSite(settings=settings, store=Store(settings.data_dir), backend_build=build)
