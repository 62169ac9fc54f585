"""Server fixtures: an isolated Flux environment, a cheap real plan for tiny-moe, a real server subprocess.

`make_plan` builds a `Plan` for a tiny model with this machine's real fingerprint, driver, backend build
and model hash, CPU engine parameters, and an id that is the content id of its body, then stores it
(no planner run: the planner is tested elsewhere; here only what the server reads of a plan matters).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import ServeEnv, Server, serve_env, start_server, stop_server, with_chat_template

from artifacts.config import Settings
from artifacts.engine_params import EngineParams
from artifacts.records.plan import Plan
from artifacts.synth.presets import CHATML
from tasks.testing import stored_plan


def make_plan(settings: Settings, model: Path, *, n_ctx: int = 1024, n_seq_max: int = 4,
              **overrides: Any) -> Plan:
    """Store a plan for ``model`` valid on this machine (fields in ``overrides`` replace the real ones)."""
    params = EngineParams(n_ctx=n_ctx, n_seq_max=n_seq_max, n_batch=256, n_ubatch=256, n_threads=1,
                          n_threads_batch=1)
    return stored_plan(settings, model, params, **overrides)


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




@pytest.fixture(scope="session")
def tiny_moe_template() -> str:
    """The twins' chat template (Qwen3-style ChatML with tools)."""
    return CHATML


@pytest.fixture(scope="session")
def llama3_template() -> str:
    """Llama 3.1's chat template (JSON tool calls, an ipython turn for results)."""
    return (Path(__file__).parent / "data" / "llama3_1.jinja").read_text()


@pytest.fixture(scope="session")
def llama3_twin(tiny_moe: Path, llama3_template: str) -> Path:
    """tiny-moe's weights with Llama 3.1's chat template."""
    path = tiny_moe.with_name("tiny-moe-llama3-template.gguf")
    if not path.exists():
        with_chat_template(tiny_moe, path, llama3_template)
    return path
