"""Bench test support: a cheap stored plan for a tiny twin (no planner run) and settings for a data dir.

The plan has the real model hash and backend build (``open_bench`` checks both) and CPU engine
parameters; everything only the planner would know (fingerprint, predictions) is filler. Its id is the
content id of its body, as a real plan's.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from artifacts.config import Settings, load_settings
from artifacts.filehash import model_hash
from artifacts.ids import content_id
from artifacts.store import Store
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

# Short settings: the suites' own defaults are for real models.
BENCH_TOML = """
[plan]
validate_tokens = 8
measure_timeout_s = 120.0
"""


def bench_settings(root: Path, cache_root: Path | None = None) -> tuple[Settings, dict[str, str]]:
    """Settings of an isolated Flux under ``root`` (config, data, cache), and the environment that selects it.

    The cache links the real backend directory, where llama-server is built (like the ``flux_env`` fixture).
    Tests of one session share ``cache_root`` (see :func:`session_cache`) so the backend's libraries and the
    tiny models are hashed once.
    """
    import os

    (root / "home").mkdir(parents=True, exist_ok=True)
    config = root / "flux.toml"
    config.write_text(BENCH_TOML)
    real_backend = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flux" / "backend"
    cache_root = cache_root or root / "cache"
    cache = cache_root / "flux"
    if real_backend.exists() and not (cache / "backend").exists():
        cache.mkdir(parents=True, exist_ok=True)
        (cache / "backend").symlink_to(real_backend)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_", "XDG_"))}
    env.update({"HOME": str(root / "home"), "XDG_DATA_HOME": str(root / "data"),
                "XDG_CACHE_HOME": str(cache_root), "XDG_CONFIG_HOME": str(root / "config"),
                "FLUX_CONFIG": str(config), "FLUX_LOG": "warning", "DO_NOT_TRACK": "1",
                "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    return load_settings(env), env


def session_cache(factory: pytest.TempPathFactory) -> Path:
    """A cache directory shared by every bench test of this pytest session."""
    return factory.getbasetemp() / "bench-cache"


def make_plan(settings: Settings, model: Path, *, n_ctx: int = 512, params: EngineParams | None = None,
              finalists: int = 3, **overrides: Any) -> Plan:
    """Store and return a plan for ``model`` with CPU parameters (``params`` replaces them)."""
    mh = model_hash([model], settings.cache_dir)
    build = backend_info(settings.cache_dir).build_id
    params = params or EngineParams(n_ctx=n_ctx, n_batch=256, n_ubatch=256, n_threads=2, n_threads_batch=2)
    req = PlanRequest(model=str(model), ctx=params.n_ctx, concurrency=params.n_seq_max)
    cand = Candidate(id="c000", family="cpu-grid", placement=Placement(layer_device=["CPU"] * 4), params=params,
                     weights_bytes={"CPU": model.stat().st_size}, kv_bytes={"CPU": 8 << 20},
                     compute_bytes={"CPU": 16 << 20})
    summaries = [MeasureSummary(candidate_id=f"c{i:03d}", prefill_tps=500.0 - 50 * i, decode_tps=50.0 - 5 * i,
                                workload_s=1.0 + i, n_trials=3) for i in range(finalists)]
    body: dict[str, Any] = {
        "key": {"model_hash": mh, "backend_build": build, "flags": req.model_dump(exclude={"model"}), "test": True},
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model_path": str(model), "model_name": model.stem, "model_hash": mh, "hardware_fingerprint": "test",
        "backend_build": build, "driver": None, "request": req.model_dump(), "candidate": cand.model_dump(),
        "measured": summaries[0].model_dump(),
        "predicted": Prediction(candidate_id=cand.id, prefill_tps=400.0, decode_tps=40.0, score_s=1.2).model_dump(),
        "validation": ValidationResult(candidate_id=cand.id, mean_kl=0.0, max_kl=0.0, top1_agreement=1.0,
                                       n_tokens=48, passed=True).model_dump(),
        "finalists": [s.model_dump() for s in summaries], "predictions": [], "median_prediction_error": None,
        "roofline_decode_tps": None, "memory_budget": {"CPU": 8 << 30}, "trials_table": "none",
        "quality_profile": "reference", "workload_prefill_share": 0.5,
    }
    body.update(overrides)
    plan = Plan(id=content_id(body), **body)
    Store(settings.data_dir).put_json("plan", plan, key=plan.id)
    return plan
