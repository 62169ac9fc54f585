"""The route stage on a GPU machine's report: a real trace through a real worker, and a trace whose worker
dies (as one did on the H200's CUDA build) leaving the plan to whole expert tensors instead of failing it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
from bench_support import bench_settings, session_cache

from artifacts.records.plan import PlanRequest
from artifacts.records.routing import RoutingProfile
from flows import stages
from tasks.cores import CoreShare
from tasks.pipeline import REFERENCE, ROUTE, PlanContext
from tasks.probing.route import traces_routing
from tasks.testing import h200_report


@pytest.fixture(autouse=True)
def _outside_a_flow_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage's store lookups log through Prefect's run logger; outside a run, Prefect gives a null logger
    when its run loggers are disabled (the stage itself is called directly, without a flow)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        monkeypatch.setattr(logging.getLogger(name), "disabled", True)


def _ctx(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> PlanContext:
    st, _ = bench_settings(tmp_path_factory.mktemp("route"), session_cache(tmp_path_factory))
    return stages.context(PlanRequest(model=str(tiny_moe)), st)


def test_a_trace_is_recorded_and_stored(tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path) -> None:
    ctx = _ctx(tmp_path_factory, tiny_moe)
    prof, message, computed = stages.compute(ROUTE, ctx, logging.getLogger("test"), h200_report())
    assert isinstance(prof, RoutingProfile) and prof.n_tokens > 0 and computed and "stored" in str(message)
    assert ctx.store.has("routing", prof.trace_id), "the trace is a table in the store"


def test_a_trace_whose_worker_dies_plans_without_per_expert_placement(
        tmp_path_factory: pytest.TempPathFactory, tiny_moe: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    ctx = _ctx(tmp_path_factory, tiny_moe)
    monkeypatch.setenv("FLUX_WORKER_FAULT", "abort-on-trace")  # the tracing worker aborts like a native crash
    with caplog.at_level(logging.WARNING):
        got, _, _ = stages.compute(ROUTE, ctx, logging.getLogger("test"), h200_report())
    assert got is None
    assert "the routing trace failed" in caplog.text and "planning without per-expert placement" in caplog.text


def test_an_architecture_the_split_does_not_support_is_not_traced(tmp_path_factory: pytest.TempPathFactory,
                                                                  tiny_moe: Path) -> None:
    """A deepseek2 model (its MoE block is not the plain gate/up/down path the split patch builds) gets no routing
    trace, so no per-expert candidate that the patched llama.cpp would refuse at load; qwen3next and qwen35moe
    (a gated shared expert beside the routed ones) are traced."""
    ctx = _ctx(tmp_path_factory, tiny_moe)
    assert traces_routing(ctx, h200_report())
    other = PlanContext(**{**vars(ctx), "info": ctx.info.model_copy(update={"architecture": "deepseek2"})})
    assert not traces_routing(other, h200_report())
    for arch in ("qwen3next", "qwen35moe"):
        hybrid = PlanContext(**{**vars(ctx), "info": ctx.info.model_copy(update={"architecture": arch})})
        assert traces_routing(hybrid, h200_report()), arch
    assert not traces_routing(ctx, h200_report(n_gpus=0)), "no GPU: no per-expert placement"


def test_the_trace_and_the_reference_share_the_cores_while_both_run(tmp_path_factory: pytest.TempPathFactory,
                                                                     tiny_moe: Path) -> None:
    """A first plan's trace and reference (its CPU noise floor) run at once, as the flow starts them: each follows
    the share of the report's cores that the context's CoreShare writes (half while both run), and the file is
    gone once both are done."""
    ctx = _ctx(tmp_path_factory, tiny_moe)
    seen: list[str] = []
    real_busy = ctx.cores.busy

    @contextmanager
    def watched(name: str, cores: int) -> Iterator[CoreShare]:
        with real_busy(name, cores) as share:
            seen.append(f"{name}:{share.path.read_text()}")
            yield share

    ctx.cores.busy = watched  # type: ignore[method-assign]
    log = logging.getLogger("test")
    with ThreadPoolExecutor(2) as pool:
        ref = pool.submit(stages.compute, REFERENCE, ctx, log, h200_report())
        time.sleep(0.2)
        route = pool.submit(stages.compute, ROUTE, ctx, log, h200_report())
        out, (prof, _, _) = ref.result()[0], route.result()
    assert isinstance(prof, RoutingProfile) and out.floor and out.computed
    n = h200_report().cpu.physical_cores
    assert seen == [f"reference:{n}", f"route:{n // 2}"], seen
    assert not ctx.cores.path.exists()
