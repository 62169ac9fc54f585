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
    (tmp_path / "home").mkdir(exist_ok=True)  # Prefect keeps its database under $HOME/.prefect
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
