"""The plan under test: what every suite gets (:class:`BenchContext`) and how a plan is opened for a bench."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from artifacts.config import Settings
from artifacts.filehash import model_hash
from artifacts.model_info import shard_paths
from artifacts.records.kinds import PLAN
from artifacts.records.plan import Plan
from artifacts.records.store import Records
from artifacts.store import Store
from engine_bridge.backend import backend_info, llama_server_path
from engine_bridge.params import EngineParams
from tasks.bench.errors import BenchError

log = logging.getLogger(__name__)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchContext:
    """What a suite needs: settings, store, the plan, this machine's backend build, llama-server."""

    settings: Settings
    store: Store
    plan: Plan
    backend_build: str
    llama_server: Path | None

    @property
    def model(self) -> Path:
        """The plan's model file."""
        return Path(self.plan.model_path)

    @property
    def params(self) -> EngineParams:
        """The plan's engine parameters."""
        return self.plan.candidate.params

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
