"""The route stage on a domain mix (``flux plan --domains TRACE[:MEASURE]``): the trace is taken on TRACE and
keyed by it, through a real worker on the domain twin (a GPU machine's report: the stage runs on the CPU)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from bench_support import bench_settings, session_cache

from artifacts.engine_params import ExpertSplit
from artifacts.records.plan import PlanRequest
from artifacts.records.routing import RoutingProfile
from artifacts.synth import synthesize
from flows import stages
from tasks import workload as wl
from tasks.pipeline import ROUTE, PlanContext
from tasks.probing.route import route_key
from tasks.testing import h200_report

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")

WIDE = {"n_layer": "2", "n_expert": "128", "n_expert_used": "8", "n_ff_exp": "32", "routing": "domains"}


@pytest.fixture(autouse=True)
def _outside_a_flow_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stage's store lookups log through Prefect's run logger; outside a run it is disabled (as
    test_route_stage.py does)."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        monkeypatch.setattr(logging.getLogger(name), "disabled", True)


def _ctx(root: Path, cache: Path, model: Path, domains: str | None) -> PlanContext:
    st, _ = bench_settings(root, cache)
    return stages.context(PlanRequest(model=str(model), domains=domains), st)


def test_the_trace_is_taken_on_the_trace_domains_and_keyed_by_them(tmp_path_factory: pytest.TempPathFactory) -> None:
    model = synthesize("tiny-moe", tmp_path_factory.mktemp("twin") / "domains.gguf", overrides=WIDE).path
    root, cache = tmp_path_factory.mktemp("route"), session_cache(tmp_path_factory)
    hw = h200_report()
    plain = _ctx(root, cache, model, None)
    assert "domains" not in route_key(plain, hw)  # plans traced before --domains keep their keys
    profiles = {}
    for mix in ("prose:chat", "chat"):
        ctx = _ctx(root, cache, model, mix)
        assert route_key(ctx, hw)["domains"] == list(wl.parse_domains(mix).trace)
        prof, _, computed = stages.compute(ROUTE, ctx, logging.getLogger("test"), hw)
        assert isinstance(prof, RoutingProfile) and computed
        profiles[mix] = prof
    # the same measured traffic, another trace: each trace's hot quarter is its own domain's
    prose, chat = (np.asarray(profiles[m].counts) for m in ("prose:chat", "chat"))
    hot_prose, hot_chat = wl.hot_sets(prose, 0.25), wl.hot_sets(chat, 0.25)
    for a, b in zip(hot_prose, hot_chat, strict=True):
        assert len(set(a) & set(b)) / len(set(a) | set(b)) <= 0.3, (a, b)
    assert wl.hot_share(chat, hot_prose) <= wl.hot_share(chat, hot_chat) - 0.2
    # a shifted mix also traces the measured rounds' traffic: what a split chosen on the trace serves there
    assert profiles["chat"].measured is None
    shifted = profiles["prose:chat"]
    split = ExpertSplit.on("CPU", dict(enumerate(wl.hot_sets(shifted.array(), 0.25))))
    share = wl.split_shift(shifted.array(), shifted.measured_array(), split)
    assert share is not None and share.trace >= 0.8 and share.measured <= share.trace - 0.2, share
    assert wl.split_shift(shifted.array(), shifted.measured_array(), None) is None
