"""Serve-time shortfall, through a real `python -m server` on the CPU: a device reported short of what the
plan needs there (``serve.device_free_bytes``) drops the plan's least-routed cached experts with a warning
and serves; a shortfall the cached experts cannot cover is one line, exit 2, before anything loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
from support import REPO, SERVE_TOML, ServeEnv, serve_env, start_server, stop_server

from artifacts.engine_params import EngineParams, ExpertSplit
from artifacts.model_info import expert_bytes, model_info
from artifacts.records.fit import device_need
from artifacts.records.plan import Plan
from artifacts.records.search import Candidate, Placement
from tasks.testing import stored_plan

HOT = {0: [0, 1, 2], 1: [3, 4], 2: [5], 3: [6, 7]}


def split_plan(senv: ServeEnv, model: Path) -> Plan:
    """A plan whose experts are split between two host buffers (a CPU build's 'device' for the copies)."""
    info = model_info(model)
    params = EngineParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1,
                          expert_split=ExpertSplit.on("CPU", HOT))
    per = expert_bytes(info)
    cand = Candidate(id="c000", family="experts-hot", placement=Placement(layer_device=["CPU"] * info.n_layer),
                     params=params, weights_bytes={"CPU": info.weight_bytes + sum(per[i] * len(e) for i, e in HOT.items())},
                     kv_bytes={"CPU": 1 << 20}, compute_bytes={"CPU": 1 << 20}, hot_share=[0.6, 0.4, 0.2, 0.5])
    return stored_plan(senv.settings, model, params, candidate=cand.model_dump())


def env_with_free(tmp: Path, model: Path, free_of: int) -> tuple[ServeEnv, Plan]:
    base = serve_env(tmp / "plan")
    plan = split_plan(base, model)
    free = device_need(plan, "CPU") - free_of
    senv = serve_env(tmp / "plan", SERVE_TOML + f"\n[serve.device_free_bytes]\nCPU = {free}\n")
    return senv, plan


def test_a_short_device_drops_the_least_routed_copies_and_serves(tmp_path: Path, tiny_moe: Path) -> None:
    per = expert_bytes(model_info(tiny_moe))
    senv, plan = env_with_free(tmp_path, tiny_moe, per[0] + 1)  # two copies' worth short
    srv = start_server(senv, plan.id)
    try:
        r = httpx.post(f"{srv.base}/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        stop_server(srv)
    log = next(senv.root.glob("server-*.log")).read_text()
    assert "dropped 2 of 8 cached experts" in log and "the least routed" in log, log[-2000:]


def test_a_shortfall_beyond_the_copies_is_refused_before_loading(tmp_path: Path, tiny_moe: Path) -> None:
    info = model_info(tiny_moe)
    senv, plan = env_with_free(tmp_path, tiny_moe, info.weight_bytes)
    out = subprocess.run([sys.executable, "-m", "server", plan.id[:12], "--port", "0"], env=senv.env, cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "dropping all its cached experts frees only" in lines[0] and "--replan" in lines[0]
    assert not (senv.settings.logs_dir / "serve-worker.log").exists(), "nothing was loaded"
