"""Server fixtures: an isolated Flux environment, a cheap real plan for tiny-moe, a real server subprocess.

`make_plan` builds a `Plan` for a tiny model with this machine's real fingerprint, driver, backend build
and model hash, CPU engine parameters, and an id that is the content id of its body, then stores it
(no planner run: the planner is tested elsewhere; here only what the server reads of a plan matters).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from support import ServeEnv, Server, serve_env, start_server, stop_server

from artifacts.config import Settings
from artifacts.filehash import model_hash
from artifacts.ids import content_id
from artifacts.store import Store
from artifacts.synth import synthesize
from engine_bridge.backend import backend_info
from engine_bridge.params import EngineParams
from tasks.models import (
    Candidate,
    MeasureSummary,
    Placement,
    Plan,
    PlanRequest,
    Prediction,
    ValidationResult,
)
from tasks.probe import hardware_fingerprint
from tasks.probe_gpu import nvml_inventory
from tasks.probe_host import cpu_info


def make_plan(settings: Settings, model: Path, *, n_ctx: int = 1024, n_seq_max: int = 4,
              **overrides: Any) -> Plan:
    """Store a plan for ``model`` valid on this machine (fields in ``overrides`` replace the real ones)."""
    nvml = nvml_inventory()
    fingerprint = hardware_fingerprint(cpu_info(), int(psutil.virtual_memory().total), nvml.gpus, nvml.driver)
    mh = model_hash([model], settings.cache_dir)
    build = backend_info(settings.cache_dir).build_id
    req = PlanRequest(model=str(model), ctx=n_ctx, concurrency=n_seq_max)
    params = EngineParams(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=256, n_ubatch=256, n_threads=1,
                          n_threads_batch=1)
    n_layer = 4
    cand = Candidate(id="cpu-test", family="cpu-grid", placement=Placement(layer_device=["CPU"] * n_layer),
                     params=params, weights_bytes={"CPU": model.stat().st_size}, kv_bytes={"CPU": 8 << 20},
                     compute_bytes={"CPU": 16 << 20})
    summary = MeasureSummary(candidate_id=cand.id, prefill_tps=500.0, decode_tps=50.0, workload_s=1.0, n_trials=3)
    body: dict[str, Any] = {
        "key": {"model_hash": mh, "hardware": fingerprint, "backend_build": build, "driver": nvml.driver,
                "flags": req.model_dump(exclude={"model"}), "settings": {}},
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model_path": str(model), "model_name": model.stem, "model_hash": mh,
        "hardware_fingerprint": fingerprint, "backend_build": build, "driver": nvml.driver,
        "request": req.model_dump(), "candidate": cand.model_dump(), "measured": summary.model_dump(),
        "predicted": Prediction(candidate_id=cand.id, prefill_tps=400.0, decode_tps=40.0, score_s=1.2).model_dump(),
        "validation": ValidationResult(candidate_id=cand.id, mean_kl=0.0, max_kl=0.0, top1_agreement=1.0,
                                       n_tokens=48, passed=True).model_dump(),
        "finalists": [summary.model_dump()], "predictions": [], "median_prediction_error": None,
        "roofline_decode_tps": None, "memory_budget": {"CPU": 8 << 30}, "trials_table": "none",
        "quality_profile": "reference", "workload_prefill_share": 0.5,
    }
    body.update(overrides)
    plan = Plan(id=content_id(body), **body)
    Store(settings.data_dir).put_json("plan", plan, key=plan.id)
    return plan



@pytest.fixture(scope="session")
def plan_maker() -> Callable[..., Plan]:
    """`make_plan` for tests that need a plan of their own."""
    return make_plan


@pytest.fixture(scope="session")
def senv(tmp_path_factory: pytest.TempPathFactory) -> ServeEnv:
    """One isolated environment for the server tests."""
    return serve_env(tmp_path_factory.mktemp("serve"))


@pytest.fixture(scope="session")
def plan(senv: ServeEnv, tiny_moe: Path) -> Plan:
    """A stored plan for tiny-moe: n_ctx 1024, 4 sequences."""
    return make_plan(senv.settings, tiny_moe)


@pytest.fixture(scope="session")
def server(senv: ServeEnv, plan: Plan) -> Iterator[Server]:
    """A real server of tiny-moe on a free port, shared by the tests that do not break it."""
    srv = start_server(senv, plan.id)
    yield srv
    stop_server(srv)


# A dense twin ~10x slower than tiny-moe (70 MB): a greedy 900-token reply lasts seconds, long enough to
# disconnect from it or kill its worker mid-way on a busy 2-core machine; its greedy text has no EOG early.
SLOW_SHAPE = {"n_embd": "1024", "n_ff": "4096", "n_layer": "8", "n_head": "8", "n_head_kv": "2", "head_dim": "128"}


@pytest.fixture(scope="session")
def slow_model(models_dir: Path) -> Path:
    """The slower dense twin."""
    path = models_dir / "slow-dense.gguf"
    if not path.exists():
        synthesize("tiny-dense", path, quant="Q4_0", overrides=SLOW_SHAPE)
    return path


@pytest.fixture(scope="session")
def slow_plan(senv: ServeEnv, slow_model: Path) -> Plan:
    """A stored plan for the slower twin: n_ctx 1024, 4 sequences."""
    return make_plan(senv.settings, slow_model)


@pytest.fixture(scope="module")
def slow_server(senv: ServeEnv, slow_plan: Plan) -> Iterator[Server]:
    """A real server of the slower twin for the module's tests."""
    srv = start_server(senv, slow_plan.id)
    yield srv
    stop_server(srv)


