"""Shared fixtures: tiny synthetic models (written once per session) and an isolated Flux environment."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from artifacts.synth import synthesize

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A session directory holding the tiny twins."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_moe(models_dir: Path) -> Path:
    """A tiny qwen3moe twin (< 10 MB)."""
    path = models_dir / "tiny-moe.gguf"
    if not path.exists():
        synthesize("tiny-moe", path, quant="Q4_0")
    return path


@pytest.fixture(scope="session")
def tiny_dense(models_dir: Path) -> Path:
    """A tiny llama twin (< 10 MB)."""
    path = models_dir / "tiny-dense.gguf"
    if not path.exists():
        synthesize("tiny-dense", path, quant="Q4_0")
    return path


@pytest.fixture()
def flux_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Environment for a `flux` subprocess with its own config, data and cache dirs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_", "XDG_"))}
    env.update({
        "HOME": str(tmp_path / "home"),
        "XDG_DATA_HOME": str(tmp_path / "data"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "PYTHONPATH": str(REPO),
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    })
    # The backend's llama-server lives in the real cache; point the test cache's backend dir at it.
    real_backend = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flux" / "backend"
    if real_backend.exists():
        (tmp_path / "cache" / "flux").mkdir(parents=True)
        (tmp_path / "cache" / "flux" / "backend").symlink_to(real_backend)
    yield env


FluxRunner = Callable[..., "subprocess.CompletedProcess[str]"]


@pytest.fixture()
def flux(flux_env: dict[str, str]) -> FluxRunner:
    """Run the real `flux` CLI in a subprocess with the isolated environment."""

    def run(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flows", *args], env={**flux_env, **(env or {})}, cwd=REPO,
                              capture_output=True, text=True, timeout=timeout)

    return run
