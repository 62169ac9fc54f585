"""The deployment path against a real `prefect server start`: run, fail, retry from the store."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture()
def prefect_server(flux_env: dict[str, str], tmp_path: Path) -> Iterator[dict[str, str]]:
    port = free_port()
    env = {**flux_env, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
           "PREFECT_SERVER_EPHEMERAL_ENABLED": "false", "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    log = (tmp_path / "server.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port)], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail("prefect server did not become healthy: " + (tmp_path / "server.log").read_text()[-2000:])
            time.sleep(1)
        yield env
    finally:
        os.killpg(proc.pid, 9)
        proc.wait()


def prefect(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "prefect", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_deployment_runs_fails_and_retries_from_the_store(prefect_server: dict[str, str], tiny_moe: Path,
                                                          tmp_path: Path) -> None:
    marker = tmp_path / "failed-once"
    env = {**prefect_server, "FLUX_FAULT_INJECT": f"fail-once:validation:{marker}"}
    deploy_log = (tmp_path / "deploy.log").open("wb")
    deploy = subprocess.Popen([sys.executable, "-m", "flows", "deploy"], env=env, cwd=REPO, stdout=deploy_log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "plan-model/default" not in prefect(env, "deployment", "ls").stdout:
            assert deploy.poll() is None, (tmp_path / "deploy.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the deployment never appeared"
            time.sleep(2)
        params = ["--param", f"model={tiny_moe}", "--param", "budget_s=20", "--param", "ctx=512"]
        first = prefect(env, "deployment", "run", "plan-model/default", *params, "--watch", "--watch-timeout", "400",
                        timeout=450)
        assert first.returncode == 1, first.stdout + first.stderr  # the injected validation failure
        assert marker.exists(), (tmp_path / "deploy.log").read_text()[-4000:]
        run_id = re.search(r"UUID:\s*([0-9a-f-]{36})", first.stdout)
        assert run_id, first.stdout
        retry = prefect(env, "flow-run", "retry", run_id.group(1))
        assert retry.returncode == 0, retry.stdout + retry.stderr
        deadline = time.monotonic() + 300
        while True:
            info = prefect(env, "flow-run", "inspect", run_id.group(1), "--output", "json")
            state = json.loads(info.stdout)["state"]["type"] if info.returncode == 0 else ""
            if state in ("COMPLETED", "FAILED", "CRASHED"):
                break
            assert time.monotonic() < deadline, "the retried run did not finish"
            time.sleep(2)
        assert state == "COMPLETED", info.stdout[-2000:]
        logs = prefect(env, "flow-run", "logs", run_id.group(1)).stdout
        for stage in ("probe", "space", "finalists", "measured"):
            assert re.search(rf"{stage} [0-9a-f]{{12}} reused from the store", logs), (stage, logs[-4000:])
    finally:
        os.killpg(deploy.pid, 9)
        deploy.wait()
