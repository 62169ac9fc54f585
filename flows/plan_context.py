"""The facts a plan is keyed by, gathered for a plan request: the model's header and hash, the backend build, the
machine, the engines and drafting asked for (:class:`tasks.stage.PlanContext`).

Kept apart from :mod:`flows.stages` (which runs stages as Prefect tasks) so that ``flux plan`` of a model whose plan
is saved finds it without importing Prefect or starting anything: the model's header, its remembered hash and a
look-up of the store. The checks that start processes (llama.cpp's loader on the model's tensors, each configured
engine's preflight) are asked for only on the way to planning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError

from artifacts.config import Settings
from artifacts.engine_spec import EngineSpec
from artifacts.filehash import HashIndexEntry, index_path, model_hash
from artifacts.model_info import ModelInfo
from artifacts.records.plan import PlanRequest
from artifacts.store import Store
from engine_bridge import rpc
from engine_bridge.backend import backend_info
from engine_bridge.machine_facts import machine_facts
from flows.request import check_draft, engine_specs
from tasks.clock import StageClock
from tasks.measurement.speculation import drafting_for
from tasks.pipeline import PlanContext, pipeline_code

EngineCheck = Callable[[Sequence[EngineSpec]], None]


def read_model(req: PlanRequest, settings: Settings) -> ModelInfo:
    """The model's header, read as ``flux inspect`` reads it (no weight, no process): a file that is not a
    model is one line before anything starts.

    Raises:
        ModelFileError: not a regular file, not a GGUF, truncated, an architecture llama.cpp does not implement.
    """
    from flows.commands.models import inspect_model

    return inspect_model(Path(req.model), settings.cache_dir, with_hash=False)


def check_loader(info: ModelInfo, settings: Settings) -> None:
    """llama.cpp's loader's check of the model's tensors and fields (a worker process, seconds), as ``flux
    inspect`` does it; a plan saved for these bytes was loaded, so a look-up of one goes without it.

    Raises:
        ModelFileError: a tensor or field llama.cpp refuses, named.
    """
    from engine_bridge.structure import check_structure

    check_structure(Path(info.shards[0]), settings.logs_dir / "inspect-worker.log")


def preflight_engines(engines: Sequence[EngineSpec], model: Path, n_ctx_train: int | None,
                      settings: Settings) -> None:
    """Start every engine other than the worker once: it must answer and stream logprobs and usage.

    Raises:
        EngineRefused: an engine that did not start, answer or stream what Flux needs.
    """
    from artifacts.engine_params import EngineParams
    from engine_bridge.engines.preflight import preflight

    for spec in engines:
        preflight(spec, model, EngineParams(n_ctx=min(n_ctx_train or 512, 512)), settings.logs_dir / "engines.log")


def hashes_remembered(info: ModelInfo, cache_dir: Path) -> bool:
    """Whether every file of the model has its hash remembered for its path, size and mtime (the hash is a stat
    away), i.e. whether a look-up of a saved plan costs no read of the model."""
    for shard in info.shards:
        real = Path(shard).resolve()
        try:
            entry = HashIndexEntry.model_validate_json(index_path(real, cache_dir).read_bytes())
            st = real.stat()
        except (OSError, ValidationError):
            return False
        if (entry.path, entry.size, entry.mtime_ns) != (str(real), st.st_size, st.st_mtime_ns):
            return False
    return True


def plan_context(req: PlanRequest, settings: Settings, info: ModelInfo, *, reprobe: bool = False,
                 run_id: str = "no-run", check_engines: EngineCheck | None = None) -> PlanContext:
    """The context of a plan of ``req``'s model, whose header ``info`` was read: the backend build, this machine
    and its RPC servers, the engines and drafting asked for and the model's content hash (remembered by path,
    size and mtime: read once).

    Args:
        req: the checked request.
        settings: the process's settings.
        info: the model's header (:func:`read_model`).
        reprobe: measure the machine again (``--reprobe``).
        run_id: the flow run's id (measure and validate are per run).
        check_engines: called with the resolved engines before anything is hashed (the preflights, on the way
            to planning); a look-up of a saved plan goes without it.

    Raises:
        RpcError: an RPC server that does not answer or runs another build.
        BadPlanFlag: an engine, draft model or heads the request cannot take.
    """
    build = backend_info(settings.cache_dir).build_id
    # RPC servers are asked who they are before anything is hashed or measured: one that does not answer or
    # runs another build ends the run here, in one line
    facts = machine_facts().model_copy(update={"rpc": [rpc.identify(e, build) for e in req.rpc or []]})
    engines = engine_specs(settings, req)
    if check_engines is not None:
        check_engines(engines)
    # the draft model and grafted heads must share the model's vocabulary (and the heads its shape)
    check_draft(req)
    drafting = drafting_for(req, model_hash([Path(req.draft_model)], settings.cache_dir) if req.draft_model else None,
                            info.n_nextn_layers, model_hash([Path(req.heads)], settings.cache_dir) if req.heads else None)
    mh = model_hash([Path(s) for s in info.shards], settings.cache_dir)
    return PlanContext(req=req, settings=settings, store=Store(settings.data_dir),
                       info=info.model_copy(update={"content_hash": mh}), model_hash=mh, backend_build=build,
                       facts=facts, code=pipeline_code(), clock=StageClock(req.budget_s), run_id=run_id, reprobe=reprobe,
                       engines=tuple(engines), drafting=drafting)
