"""`flux serve` / `python -m server` before and at startup: one line and exit 2 for what a person can fix (bad
flags, a busy port, an empty key), checked before the worker loads; the API key from an environment
variable or a file; the plan's model served from another path when its content is the same."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from support import REPO, ServeEnv, serve_env, start_server, stop_server

from artifacts.records.plan import Plan

MakePlan = Callable[..., Plan]


def _serve(senv: ServeEnv, *args: str, env: dict[str, str] | None = None,
           timeout: float = 60) -> subprocess.CompletedProcess[str]:
    # a port of the system's choosing unless the test names one: a server on the default port (8090) of the
    # machine running the tests must not turn the refusal under test into "address in use"
    port = [] if "--port" in args else ["--port", "0"]
    return subprocess.run([sys.executable, "-m", "server", *args, *port], env={**senv.env, **(env or {})}, cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def _one_line(out: subprocess.CompletedProcess[str], *words: str) -> str:
    assert out.returncode == 2, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("flags", "words"), [
    (["--port", "99999"], ["--port", "0-65535"]),
    (["--port", "http"], ["--port", "not a port"]),
    (["--nonsense"], ["unrecognized arguments"]),
])
def test_bad_flags_are_one_line(senv: ServeEnv, plan: Plan, flags: list[str], words: list[str]) -> None:
    _one_line(_serve(senv, plan.id[:12], *flags), *words)


def test_a_busy_port_is_refused_before_the_worker_loads(tmp_path: Path, plan_maker: MakePlan, tiny_moe: Path) -> None:
    senv = serve_env(tmp_path)  # its own logs: no other server writes a worker log there
    plan = plan_maker(senv.settings, tiny_moe, n_ctx=512, n_seq_max=1)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        out = _serve(senv, plan.id[:12], "--port", str(port))
        took = time.monotonic() - t0
    _one_line(out, f"127.0.0.1:{port}", "in use")
    log = senv.settings.logs_dir / "serve-worker.log"
    assert took < 15 and not log.exists(), "no worker was started"


@pytest.mark.parametrize("how", ["env", "flag", "file"])
def test_an_empty_api_key_is_refused(senv: ServeEnv, plan: Plan, tmp_path: Path, how: str) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("\n")
    args, env = {"env": ([], {"FLUX_API_KEY": ""}), "flag": (["--api-key", ""], {}),
                 "file": (["--api-key-file", str(key_file)], {})}[how]
    _one_line(_serve(senv, plan.id[:12], *args, env=env), "empty API key")


def test_an_unreadable_key_file_is_one_line(senv: ServeEnv, plan: Plan, tmp_path: Path) -> None:
    _one_line(_serve(senv, plan.id[:12], "--api-key-file", str(tmp_path / "missing")), "--api-key-file",
              "cannot read")


@pytest.mark.parametrize("how", ["env", "file"])
def test_api_key_from_env_or_file(senv: ServeEnv, plan: Plan, tmp_path: Path, how: str) -> None:
    key = "sk-from-" + how
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    keyed = ServeEnv(env={**senv.env, "FLUX_API_KEY": key}, settings=senv.settings, root=senv.root) \
        if how == "env" else senv
    srv = start_server(keyed, plan.id, *(["--api-key-file", str(key_file)] if how == "file" else []))
    try:
        for path in ("/v1/models", "/flux/stats", "/metrics"):
            assert httpx.get(f"{srv.base}{path}", timeout=30).status_code == 401
            assert httpx.get(f"{srv.base}{path}", headers={"Authorization": "Bearer"}, timeout=30).status_code == 401
            ok = httpx.get(f"{srv.base}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=30)
            assert ok.status_code == 200, path
        r = httpx.post(f"{srv.base}/flux/admission", json={"host_reserve_percent": 93}, timeout=30)
        assert r.status_code == 401, "the admission override needs the key too"
        assert key not in srv.log.read_text(), "the key is never logged"
    finally:
        stop_server(srv)


def test_the_same_model_at_another_path_is_served(senv: ServeEnv, plan_maker: MakePlan, tiny_moe: Path,
                                                  tmp_path: Path) -> None:
    original = tmp_path / "original.gguf"
    shutil.copyfile(tiny_moe, original)
    plan = plan_maker(senv.settings, original, n_ctx=512, n_seq_max=1)
    moved = tmp_path / "elsewhere" / "renamed-twin.gguf"
    moved.parent.mkdir()
    original.rename(moved)
    _one_line(_serve(senv, plan.id[:12]), "model_hash differs", "--model PATH")
    srv = start_server(senv, plan.id, "--model", str(moved))
    try:
        card = httpx.get(f"{srv.base}/v1/models", timeout=30).json()["data"][0]
        assert card["meta"]["model_path"] == str(moved) and card["meta"]["plan_id"] == plan.id
        r = httpx.post(f"{srv.base}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "max_tokens": 2, "model": "renamed-twin"}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        stop_server(srv)


def test_another_model_at_model_path_is_refused(senv: ServeEnv, plan: Plan, tiny_dense: Path) -> None:
    _one_line(_serve(senv, plan.id[:12], "--model", str(tiny_dense)), "model_hash differs",
              f"--model {tiny_dense} holds another model")
