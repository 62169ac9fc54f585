"""Engines in the search, end to end on the CPU: `flux plan --engines native,llama-server` (the Prefect flow and
its store) measures every finalist's placement on both engines and scores llama-server against the reference;
`flux serve` of a plan won by llama-server (--prefer-engine: the twin's engines are too close to call) answers the
`openai` client through a real llama-server behind the worker protocol, ends a request whose engine dies with
worker_died and restarts it; and the refusals (an unknown engine, a template field other than {port}, {model},
{ctx}, a command that does not start, one that does not answer in its timeout, one whose stream lacks logprobs
and usage), each one line, exit 2, no plan saved."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from support import ServeEnv, serve_env, start_server, stop_server

from artifacts.records.kinds import PLAN
from artifacts.records.store import Records
from engine_bridge.backend import llama_server_path

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).parent / "data"
pytestmark = pytest.mark.skipif(llama_server_path(Path.home() / ".cache" / "flux") is None,
                                reason="llama-server is not built for this backend")


def _flux(env: ServeEnv, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows", *args], env=env.env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def _env(root: Path, engines_toml: str = "") -> ServeEnv:
    env = serve_env(root, "[serve]\nmin_reply = 16\nqueue_wait_s = 30.0\n" + engines_toml)
    backend = Path.home() / ".cache" / "flux" / "backend"
    (root / "cache" / "flux").mkdir(parents=True, exist_ok=True)
    if not (root / "cache" / "flux" / "backend").exists():
        (root / "cache" / "flux" / "backend").symlink_to(backend)
    return env


def test_a_plan_over_two_engines_is_served_through_llama_server(tmp_path: Path, tiny_moe: Path) -> None:
    env = _env(tmp_path)
    planned = _flux(env, "plan", str(tiny_moe), "--ctx", "512", "--engines", "native,llama-server",
                    "--prefer-engine", "llama-server", "--budget-s", "150")
    assert planned.returncode == 0, planned.stderr[-4000:]
    plan_id = planned.stdout.strip().splitlines()[-1]
    plan = json.loads(_flux(env, "show", plan_id[:12], "--json").stdout)
    why = (plan["notes"], [(s["candidate_id"], s["error"]) for s in plan["finalists"]])
    assert plan["engine"] and plan["engine"]["name"] == "llama-server", why
    assert plan["candidate"]["engine"] == "llama-server", why
    measured = {s["candidate_id"] for s in plan["finalists"] if s["workload_s"]}
    assert any("@llama-server" in c for c in measured) and any("@" not in c for c in measured), measured
    assert plan["validation"]["passed"] and plan["validation"]["n_tokens"] > 0
    assert any(n.startswith("engines on placement") for n in plan["notes"]), plan["notes"]
    passed_over = [n for n in plan["notes"] if "but was not chosen" in n and "@" not in n.split()[0]]
    assert all(n.endswith("--prefer-engine llama-server serves the plan on llama-server") for n in passed_over), \
        passed_over  # a faster native finalist was passed over for the engine asked for, not for its workload

    server = start_server(env, plan_id)
    try:
        client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="none")
        model = client.models.list().data[0].id
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content and chat.usage and chat.usage.completion_tokens > 0
        parts = [c.choices[0].text for c in client.completions.create(
            model=model, prompt="abc", max_tokens=6, temperature=0, stream=True) if c.choices]
        assert "".join(parts)
        shaped = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=12, temperature=0, response_format={"type": "json_object"})
        assert (shaped.choices[0].message.content or "").lstrip().startswith("{")
        stats = server.stats()["worker"]
        assert stats["serve_stats"]["engine"] == "llama-server" and stats["serve_stats"]["requests"] >= 3

        # the engine dies mid-request: that request ends with worker_died, the next one is answered again. The
        # engine is stopped first, so that it holds the request unanswered when it is killed (killed at its first
        # streamed token instead, the tiny twin had written all 400 tokens into the pipe already, now and then)
        engine_pid = stats["serve_stats"]["engine_pid"]
        os.kill(engine_pid, signal.SIGSTOP)
        killer = threading.Timer(1.0, os.kill, (engine_pid, signal.SIGKILL))
        killer.start()
        with httpx.Client(timeout=60) as http, http.stream(
                "POST", f"{server.base}/v1/completions", headers={"x-request-id": "dies-1"},
                json={"model": model, "prompt": "abc", "max_tokens": 400, "stream": True, "temperature": 0}) as r:
            seen = "".join(r.iter_lines())
        killer.join()
        assert "worker_died" in seen, seen[-500:]
        deadline = time.monotonic() + 60
        while not (server.stats()["worker"]["alive"] and server.stats()["worker"]["restarts"] >= 1):
            assert time.monotonic() < deadline, server.stats()
            time.sleep(0.5)
        again = client.completions.create(model=model, prompt="abc", max_tokens=4, temperature=0)
        assert again.choices[0].text
    finally:
        stop_server(server)


BAD = [
    ("--engines", "native,vllm", "", "engine vllm: not a known engine (known: native, llama-server); configure it as "
     "[engines.vllm] in flux.toml"),
    ("--engines", "native,odd", '[engines.odd]\ncommand = ["true", "--port", "{port}", "--gpu", "{gpu}"]\n',
     "unknown template field(s) {gpu}"),
    ("--engines", "native,gone", '[engines.gone]\ncommand = ["/nonexistent/engine", "--port", "{port}"]\n',
     "did not start"),
    ("--engines", "native,mute", '[engines.mute]\ncommand = ["sleep", "30", "{port}"]\nstart_timeout_s = 2.0\n',
     "did not answer /health or /v1/models"),
    ("--prefer-engine", "llama-server", "", "not one of --engines"),
]


@pytest.mark.parametrize(("flag", "value", "toml", "says"), BAD, ids=[b[1] + "-" + b[3][:12] for b in BAD])
def test_bad_engine_input_is_one_line_exit_2_and_no_plan(tmp_path: Path, tiny_moe: Path, flag: str, value: str,
                                                         toml: str, says: str) -> None:
    env = _env(tmp_path, toml)
    out = _flux(env, "plan", str(tiny_moe), flag, value, "--budget-s", "5", timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not Records.at(env.settings.data_dir).all(PLAN), "a refused request saved a plan"


def test_an_engine_without_logprobs_or_usage_is_refused(tmp_path: Path, tiny_moe: Path) -> None:
    fake = DATA / "no_logprobs_engine.py"
    toml = f'[engines.plain]\ncommand = ["{sys.executable}", "{fake}", "{{port}}"]\n'
    env = _env(tmp_path, toml)
    out = _flux(env, "plan", str(tiny_moe), "--engines", "native,plain", "--budget-s", "5", timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip()
    assert "engine plain" in line and "per-token logprobs" in line and "completion usage" in line, line
    assert len(line.splitlines()) == 1
    assert not Records.at(env.settings.data_dir).all(PLAN)
