"""A plan across llama.cpp RPC servers on one machine: two real `flux rpc-server` processes on 127.0.0.1 (CPU
backends), a tiny twin whose weights exceed this machine's --host-mem-budget, `flux plan --rpc` (the Prefect
flow and its store) spanning the servers, `flux serve` of that plan answered by the `openai` client, `/health`
naming a server that went away; and the refusals (a server that does not answer, another build, an endpoint
twice, a budget for a server not given), each one line, exit 2, no plan saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support import ServeEnv, free_port, serve_env, start_server, stop_server

from artifacts.model_info import model_info
from artifacts.records.kinds import PLAN
from artifacts.records.store import Records
from engine_bridge import rpc
from engine_bridge.backend import backend_info
from tasks.gpu_memory import compute_bytes
from tasks.search.space import kv_at

REPO = Path(__file__).resolve().parents[2]
GIB = 2**30
RUNNING: dict[str, subprocess.Popen[str]] = {}


def _flux(env: ServeEnv, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows", *args], env=env.env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _start_rpc(env: ServeEnv, port: int, extra_env: dict[str, str] | None = None,
               raw: bool = False) -> subprocess.Popen[str]:
    """`flux rpc-server` (or, ``raw``, the binary itself, to fake another build) on 127.0.0.1:port."""
    from flows.commands.rpc import rpc_server_path

    cmd = ([str(rpc_server_path(env.settings.cache_dir)), "--port", str(port)] if raw else
           [sys.executable, "-m", "flows", "rpc-server", "--port", str(port), "--threads", "1"])
    proc = subprocess.Popen(cmd, env={**env.env, **(extra_env or {})}, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 30
    while not rpc.reachable(f"127.0.0.1:{port}"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"rpc-server on {port} did not start ({proc.poll()})")
        time.sleep(0.1)
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture()
def env(tmp_path: Path) -> ServeEnv:
    senv = serve_env(tmp_path / "env")
    # the backend (and its rpc-server) lives in the real cache: the isolated cache links to it
    real = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "flux" / "backend"
    if real.exists():
        (senv.settings.cache_dir).mkdir(parents=True, exist_ok=True)
        (senv.settings.cache_dir / "backend").symlink_to(real)
    return senv


@pytest.fixture()
def servers(env: ServeEnv) -> Iterator[list[str]]:
    """Two `flux rpc-server` endpoints (their processes in ``RUNNING``, by endpoint, so a test can stop one)."""
    pytest.importorskip("llama_cpp")
    try:
        from flows.commands.rpc import rpc_server_path

        rpc_server_path(env.settings.cache_dir)
    except Exception as exc:  # noqa: BLE001 - a build without rpc-server: nothing to test against
        pytest.skip(str(exc))
    ports = [free_port(), free_port()]
    RUNNING.update({f"127.0.0.1:{p}": _start_rpc(env, p) for p in ports})
    try:
        yield [f"127.0.0.1:{p}" for p in ports]
    finally:
        for p in RUNNING.values():
            _stop(p)
        RUNNING.clear()


def test_a_server_says_its_build_and_its_link_is_measured(env: ServeEnv, servers: list[str]) -> None:
    build = backend_info(env.settings.cache_dir).build_id
    s = rpc.identify(servers[0], build)
    assert s.build_id == build and s.devices and s.devices[0].memory_total > 0
    link = rpc.measure(s).link
    assert link is not None and 0 < link.rtt_ms < 50 and link.up_gbs > 0.01 and link.down_gbs > 0.01


def test_bad_rpc_input_is_one_line_exit_2_and_no_plan(env: ServeEnv, servers: list[str], tiny_moe: Path) -> None:
    other = free_port()
    impostor = _start_rpc(env, other, {"FLUX_BUILD_ID": "0123456789abcdef"}, raw=True)
    try:
        cases = {
            f"127.0.0.1:{free_port()}": "does not answer",
            f"127.0.0.1:{other}": "runs backend build 0123456789abcdef",
            f"{servers[0]},{servers[0]}": "is given twice",
            "localhost": "expected host:port",
        }
        for value, says in cases.items():
            out = _flux(env, "plan", str(tiny_moe), "--rpc", value, "--budget-s", "5")
            assert out.returncode == 2, (value, out.stderr[-2000:])
            assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
        out = _flux(env, "plan", str(tiny_moe), "--rpc", servers[0], "--rpc-mem-budget", "1,1", "--budget-s", "5")
        assert out.returncode == 2 and "2 budget(s) for 1 RPC server(s)" in out.stderr, out.stderr
    finally:
        _stop(impostor)
    assert not Records.at(env.settings.data_dir).all(PLAN), "a refused request saved a plan"


def test_a_twin_too_large_for_this_host_is_planned_across_two_servers_and_served(
        env: ServeEnv, servers: list[str], tiny_moe: Path) -> None:
    info = model_info(tiny_moe)
    weights = info.weight_bytes
    # room for the smallest compute buffer, the embeddings, the KV cache and half the weights: no local plan fits
    host = (compute_bytes(info, 128, 512, True) + info.bytes_by_role.get("embeddings", 0) + kv_at(info, 512)
            + weights // 2)
    planned = _flux(env, "plan", str(tiny_moe), "--ctx", "512", "--budget-s", "40", "--rpc", ",".join(servers),
                    "--host-mem-budget", f"{host / GIB:.6f}")
    assert planned.returncode == 0, planned.stderr[-4000:]
    plan_id = planned.stdout.strip().splitlines()[-1]
    shown = _flux(env, "show", plan_id[:12], "--json")
    plan = json.loads(shown.stdout)
    params = plan["candidate"]["params"]
    assert params["rpc_servers"] == servers
    devices = set(plan["candidate"]["placement"]["layer_device"])
    assert {d for d in devices if d.startswith("RPC")}, devices
    text = _flux(env, "show", plan_id[:12]).stdout
    assert "RPC servers:" in text and "round trip" in text, text
    srv = start_server(env, plan_id)
    try:
        client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="x", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=12, temperature=0)
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        health = httpx.get(f"{srv.base}/health", timeout=10).json()
        assert health["rpc_servers"] == {servers[0]: "up", servers[1]: "up"}
        # a server lost: the request ends with an error naming it, /health says which one is down
        _stop(RUNNING[servers[1]])
        with pytest.raises(openai.APIStatusError) as lost:
            client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Again"}],
                                           max_tokens=12, temperature=0)
        assert lost.value.status_code == 502 and f"RPC server {servers[1]} does not answer" in str(lost.value)
        down = httpx.get(f"{srv.base}/health", timeout=10)
        assert down.status_code == 503 and down.json()["rpc_servers"][servers[1]] == "down"
        # it comes back on its port: the restarted worker loads again and answers
        RUNNING[servers[1]] = _start_rpc(env, int(servers[1].rsplit(":", 1)[1]))
        deadline = time.monotonic() + 90
        while httpx.get(f"{srv.base}/health", timeout=10).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        again = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "Hello"}],
                                               max_tokens=12, temperature=0)
        assert again.choices[0].message.content == reply.choices[0].message.content
    finally:
        stop_server(srv)
