"""The seed's model families end to end on the CPU: a tiny twin of each written by `flux synth`, planned by
`flux plan` (the Prefect flow and its store), served by the server of that plan and answered by the `openai`
client: a chat, a streamed chat and a forced tool call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from support import ServeEnv, serve_env, start_server, stop_server

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ["tiny-qwen3next", "tiny-qwen35moe", "tiny-minicpm"]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}]


def _flux(env: ServeEnv, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "flows", *args], env=env.env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("preset", FAMILIES)
def test_a_family_twin_is_planned_served_and_answered(preset: str, tmp_path: Path) -> None:
    env = serve_env(tmp_path / "env")
    model = tmp_path / f"{preset}.gguf"
    made = _flux(env, "synth", "--like", preset, "-o", str(model))
    assert made.returncode == 0, made.stderr
    planned = _flux(env, "plan", str(model), "--ctx", "1024", "--budget-s", "30")
    assert planned.returncode == 0, planned.stderr[-3000:]
    plan_id = planned.stdout.strip().splitlines()[-1]
    srv = start_server(env, plan_id)
    try:
        client = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="x", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        reply = client.chat.completions.create(model=model_id, messages=ask, max_tokens=16, temperature=0)  # type: ignore[arg-type]
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        assert reply.choices[0].finish_reason in ("stop", "length")
        streamed = [c for c in client.chat.completions.create(  # type: ignore[call-overload]
            model=model_id, messages=ask, max_tokens=16, temperature=0, stream=True)]
        text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
        assert text == (reply.choices[0].message.content or ""), "greedy: streamed and whole answers agree"
        forced = client.chat.completions.create(  # type: ignore[call-overload]
            model=model_id, messages=ask, tools=TOOLS, max_tokens=64, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        calls = forced.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_weather"
        if forced.choices[0].finish_reason == "tool_calls":
            assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Oslo")
    finally:
        stop_server(srv)
