"""Bench test support: a cheap stored plan for a tiny twin (no planner run) and settings for a data dir.

The plan comes from :func:`tasks.testing.stored_plan` (real model hash, backend build and fingerprint;
filler where only the planner would know), with CPU engine parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from artifacts.config import Settings, load_settings
from artifacts.engine_params import EngineParams
from artifacts.records.plan import Plan
from tasks.testing import stored_plan

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
    params = params or EngineParams(n_ctx=n_ctx, n_batch=256, n_ubatch=256, n_threads=2, n_threads_batch=2)
    return stored_plan(settings, model, params, finalists=finalists, **overrides)
