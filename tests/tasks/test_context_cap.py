"""`flux plan` gives a model its trained context and caps it only where RAM cannot hold the trained context's KV
cache, saying so in one line (tasks/search/context.py: resolve_context, context_cap_line)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from test_hybrid_sizing import header_only_twin

from artifacts.model_info import ModelInfo, kv_cache_bytes, model_info
from artifacts.records.plan import PlanRequest
from tasks.search.context import context_cap_line, resolve_context
from tasks.search.space import enumerate_placements
from tasks.testing import h200_report

GIB = 2**30


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def cap_lines() -> Iterator[list[str]]:
    """The planner's warnings, caught at its own logger: a Prefect run earlier in the session may have set the
    loggers above it not to propagate or disabled them (its logging config), so a capture at the root could miss
    them."""
    lg, handler = logging.getLogger("tasks.search.space"), _Lines()
    was = lg.level, lg.disabled
    lg.setLevel(logging.WARNING)
    lg.disabled = False
    lg.addHandler(handler)
    try:
        yield handler.lines
    finally:
        lg.removeHandler(handler)
        lg.setLevel(was[0])
        lg.disabled = was[1]


@pytest.fixture(scope="module")
def info(tmp_path_factory: pytest.TempPathFactory) -> ModelInfo:
    """The 80B twin's header (262,144 trained tokens, 42 GiB of weights) on a sparse file."""
    return model_info(header_only_twin("qwen3-next-80b-a3b", tmp_path_factory.mktemp("cap") / "q3n-80b.gguf"))


def test_the_trained_context_when_ram_holds_it_capped_with_one_line_when_not(
        info: ModelInfo, cap_lines: list[str]) -> None:
    roomy = h200_report(n_gpus=0)
    req = PlanRequest(model="m")
    assert resolve_context(info, roomy, req, 10) == (262144, False)
    space = enumerate_placements(info, roomy, req, 10)
    assert space.n_ctx == 262144 and not space.ctx_capped_by_ram and not cap_lines

    small = roomy.model_copy(update={"ram_total": 60 * GIB, "ram_available": 56 * GIB})
    four = PlanRequest(model="m", concurrency=4)  # four sequences' KV (24 GiB) do not fit beside 42 GiB of weights
    n_ctx, capped = resolve_context(info, small, four, 5)
    assert capped and 0 < n_ctx < 262144 and n_ctx % 256 == 0
    assert kv_cache_bytes(info, "f16", n_ctx, 4) <= 56 * GIB - info.weight_bytes
    space = enumerate_placements(info, small, four, 5)
    assert space.ctx_capped_by_ram and space.n_ctx == n_ctx
    (line,) = cap_lines
    assert line == context_cap_line(info, small, four, 5, n_ctx) and "\n" not in line
    assert line.startswith(f"context capped at {n_ctx} tokens per sequence, not the trained 262144: its f16 KV "
                           "cache for 4 sequence(s) needs 24.00 GiB")
    assert resolve_context(info, small, PlanRequest(model="m", ctx=4096, concurrency=4), 5) == (4096, False)
