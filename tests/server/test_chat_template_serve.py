"""`flux serve`'s chat template end to end: a twin without one is served with its family's, `--chat-template NAME`
and `--chat-template-file PATH` replace the GGUF's, `/v1/models` names the one used, and a bad flag is one line and
exit 2 before the model loads.

What a chat renders is checked by its tokens: a chat and a text completion of the text the template should render
must have the same prompt (as many tokens, the same greedy reply).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gguf_edit import edited_gguf
from support import REPO, ServeEnv, Server, start_server, stop_server

from artifacts.records.plan import Plan
from artifacts.synth import synthesize

HELLO = [{"role": "user", "content": "Hello"}]
GEMMA = "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
LLAMA3 = "<|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
CHATML = "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"max_tokens": 6, "temperature": 0, "seed": 1}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def gemma_plan(senv: ServeEnv, plan_maker: Callable[..., Plan], tmp_path_factory: pytest.TempPathFactory) -> Plan:
    """A plan of a tiny-gemma3 twin whose GGUF has no chat template."""
    d = tmp_path_factory.mktemp("gemma")
    twin = d / "tiny-gemma3.gguf"
    synthesize("tiny-gemma3", twin, quant="Q4_0")
    return plan_maker(senv.settings, edited_gguf(twin, d / "tiny-gemma3-no-template.gguf",
                                                 drop=("tokenizer.chat_template",)))


@pytest.fixture()
def serve(senv: ServeEnv) -> Iterator[Callable[..., Server]]:
    """Start servers; stop them at the end."""
    started: list[Server] = []

    def start(plan: Plan, *flags: str) -> Server:
        started.append(start_server(senv, plan.id, *flags))
        return started[-1]

    yield start
    for srv in started:
        stop_server(srv)


def _post(srv: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{srv.base}/v1/{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _renders(srv: Server, text: str) -> bool:
    """Whether a chat of HELLO has the prompt ``text`` (same token count, same greedy reply)."""
    chat = _post(srv, "chat/completions", {"messages": HELLO, **GREEDY})
    comp = _post(srv, "completions", {"prompt": text, **GREEDY})
    same_count = chat["usage"]["prompt_tokens"] == comp["usage"]["prompt_tokens"]
    return same_count and chat["choices"][0]["message"]["content"] == comp["choices"][0]["text"]


def _meta(srv: Server) -> dict[str, Any]:
    card: dict[str, Any] = httpx.get(f"{srv.base}/v1/models", timeout=30).json()["data"][0]
    one: dict[str, Any] = httpx.get(f"{srv.base}/v1/models/{card['id']}", timeout=30).json()
    assert one["meta"]["chat_template"] == card["meta"]["chat_template"]
    meta: dict[str, Any] = card["meta"]
    return meta


def test_a_gguf_without_a_template_is_served_with_its_family_s(gemma_plan: Plan, serve: Callable[..., Server]) -> None:
    srv = serve(gemma_plan)
    meta = _meta(srv)
    assert (meta["chat_template"], meta["chat_template_origin"]) == ("gemma", "architecture")
    assert _renders(srv, GEMMA), "Gemma's turns, not ChatML's"
    assert not _renders(srv, CHATML), "the comparison tells templates apart"
    assert "built-in 'gemma' template, the gemma3 architecture's" in " ".join(srv.log.read_text().split())
    # the built-in renders no tools: they go in its system turn, merged into the user's as Gemma has none
    called = _post(srv, "chat/completions", {"messages": HELLO, "tools": TOOLS, "tool_choice": "required", **GREEDY,
                                             "max_tokens": 40})
    calls = called["choices"][0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather", called


def test_chat_template_names_a_builtin_that_replaces_the_gguf_s(plan: Plan, serve: Callable[..., Server]) -> None:
    srv = serve(plan, "--chat-template", "llama3")
    meta = _meta(srv)
    assert (meta["chat_template"], meta["chat_template_origin"]) == ("llama3", "--chat-template")
    assert _renders(srv, LLAMA3) and not _renders(srv, CHATML)


def test_chat_template_file_replaces_the_gguf_s(gemma_plan: Plan, serve: Callable[..., Server], tmp_path: Path) -> None:
    f = tmp_path / "turns.jinja"
    f.write_text("{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}### assistant:")
    srv = serve(gemma_plan, "--chat-template-file", str(f))
    meta = _meta(srv)
    assert (meta["chat_template"], meta["chat_template_origin"]) == (str(f), "--chat-template-file")
    assert _renders(srv, "### user: Hello\n### assistant:")


@pytest.mark.parametrize(("flags", "says"), [
    (("--chat-template", "llama-3"), "unknown chat template 'llama-3': llama.cpp's built-ins are chatml, llama2,"),
    (("--chat-template-file", "/nonexistent/t.jinja"), "--chat-template-file /nonexistent/t.jinja: cannot read it"),
    (("--chat-template-file", "{bad}"), "not a Jinja template: line 1"),
    (("--chat-template-file", "{silent}"), "renders a user message without its text"),
    (("--chat-template", "llama3", "--chat-template-file", "x.jinja"), "not allowed with argument"),
])
def test_a_bad_template_flag_is_one_line_and_exit_2_before_the_load(senv: ServeEnv, plan: Plan, tmp_path: Path,
                                                                     flags: tuple[str, ...], says: str) -> None:
    (tmp_path / "bad.jinja").write_text("{% if %}")
    (tmp_path / "silent.jinja").write_text("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    args = [a.format(bad=tmp_path / "bad.jinja", silent=tmp_path / "silent.jinja") for a in flags]
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "server", plan.id[:12], "--port", "1", *args], env=senv.env,
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], out.stderr
    assert time.monotonic() - t0 < 30, "refused before the plan's model is loaded"
