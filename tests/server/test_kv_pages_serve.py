"""KV pages as the admission ledger of a real `flux serve` (real worker, the slow dense twin), its host pool made
three pages small with `serve.kv_host_bytes` so the page limit is reachable below the context (1,024 tokens).

Admission refuses exactly at the page limit; a running sequence completes while another request is refused; pages
come back after a completion, a cancel and the worker's death; `/flux/stats`, `/metrics`, `/v1/models` and
`flux show` show the pools.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import REPO, SERVE_TOML, ServeEnv, Server, serve_env, sse_events, start_server, stop_server

from artifacts.model_info import model_info
from artifacts.records.plan import Plan
from server.kv_pages import PAGE_TOKENS, kv_page_bytes

PAGES = 3  # the host pool: 768 tokens, below the 1,024-token context
LONG = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 1000, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def page_bytes(slow_model: Path) -> int:
    """Bytes of one page of the slow twin's f16 KV cache."""
    return kv_page_bytes(model_info(slow_model), "f16", "f16")


@pytest.fixture(scope="module")
def penv(tmp_path_factory: pytest.TempPathFactory, page_bytes: int) -> ServeEnv:
    """An environment whose host pool holds PAGES pages."""
    return serve_env(tmp_path_factory.mktemp("kv-pages"), SERVE_TOML + f"kv_host_bytes = {PAGES * page_bytes}\n")


@pytest.fixture(scope="module")
def pplan(penv: ServeEnv, slow_model: Path, plan_maker: Callable[..., Plan]) -> Plan:
    """The slow twin, 1,024 tokens x 2 sequences, its KV on the host."""
    return plan_maker(penv.settings, slow_model, n_ctx=1024, n_seq_max=2)


@pytest.fixture(scope="module")
def psrv(penv: ServeEnv, pplan: Plan) -> Iterator[Server]:
    """The server of the module's tests."""
    srv = start_server(penv, pplan.id)
    yield srv
    stop_server(srv)


def _ids(n: int) -> list[int]:
    return [100 + i % 200 for i in range(n)]


def _complete(srv: Server, n_prompt: int, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{srv.base}/v1/completions", json={"prompt": _ids(n_prompt), "max_tokens": max_tokens,
                                                          "temperature": 0}, timeout=300)


def _pool(srv: Server) -> dict[str, Any]:
    (pool,) = srv.stats()["kv_pages"]["pools"]
    out: dict[str, Any] = pool
    return out


def _refused(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error"
    assert "KV pages" in err["message"]
    return err


def _stream_until_first_token(client: httpx.Client, srv: Server, rid: str,
                              then: Callable[[], None]) -> list[tuple[int | None, str]]:
    """Stream LONG under ``rid``, call ``then`` once its first token arrived, and read it to its end."""
    lines: list[str] = []
    called = False
    with client.stream("POST", f"{srv.base}/v1/chat/completions", json=LONG, headers={"x-request-id": rid}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
            if not called and any('"content"' in d for _, d in sse_events(lines)):
                called = True
                then()
    assert called
    return sse_events(lines)


def test_stats_metrics_and_models_show_the_pools(psrv: Server, page_bytes: int) -> None:
    pages = psrv.stats()["kv_pages"]
    assert pages["page_tokens"] == PAGE_TOKENS and pages["host_kv_bytes"] == PAGES * page_bytes
    assert pages["pools"] == [{"name": "host", "role": "window", "page_tokens": PAGE_TOKENS, "page_bytes": page_bytes,
                               "pages_total": PAGES, "pages_used": 0, "pages_free": PAGES, "ram_pages": PAGES}]
    metrics = httpx.get(f"{psrv.base}/metrics", timeout=30).text
    assert f'flux_kv_pages{{pool="host",state="total"}} {PAGES}.0' in metrics
    assert f'flux_kv_pages{{pool="host",state="free"}} {PAGES}.0' in metrics
    meta = httpx.get(f"{psrv.base}/v1/models", timeout=30).json()["data"][0]["meta"]
    assert meta["page_budgets"]["kv_pages"] == {"host": PAGES} and meta["page_budgets"]["page_tokens"] == PAGE_TOKENS


def test_admission_refuses_exactly_at_the_page_limit(psrv: Server) -> None:
    limit = PAGES * PAGE_TOKENS  # 768 tokens, below n_ctx: the context alone would take 769
    ok = _complete(psrv, limit - 64, 64)  # prompt + min(max_tokens, min_reply) = exactly the free pages
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == limit - 64
    err = _refused(_complete(psrv, limit - 63, 64))  # one token more
    assert err["param"] == "prompt" and f"free pages hold {limit} tokens" in err["message"]
    assert _complete(psrv, limit - 1, 1).status_code == 200
    _refused(_complete(psrv, limit, 1))
    assert _pool(psrv)["pages_used"] == 0


def test_a_running_sequence_completes_while_another_is_refused(psrv: Server) -> None:
    refusals: list[httpx.Response] = []

    def second() -> None:  # needs one page: the first holds all three
        assert _pool(psrv)["pages_used"] == PAGES
        refusals.append(httpx.post(f"{psrv.base}/v1/chat/completions", timeout=60,
                                   json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}))

    with httpx.Client(timeout=300) as c:
        events = _stream_until_first_token(c, psrv, "kvp-running", second)
    err = _refused(refusals[0])
    assert err["param"] == "messages" and "free pages hold 0 tokens" in err["message"]
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    assert not any("error" in ch for ch in chunks)
    finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch.get("choices")]
    usage = chunks[-1]["usage"]
    # max_tokens 1000 fits the context but not the pages: the reply ends where its pages do
    assert finish[-1] == "length"
    assert usage["prompt_tokens"] + usage["completion_tokens"] == PAGES * PAGE_TOKENS
    assert _pool(psrv)["pages_used"] == 0  # completed: its pages are back


def test_pages_return_after_a_cancel(psrv: Server) -> None:
    def cancel() -> None:
        r = httpx.delete(f"{psrv.base}/v1/requests/kvp-cancel", timeout=30)
        assert r.status_code == 200 and r.json()["cancelled"] is True

    with httpx.Client(timeout=300) as c:
        events = _stream_until_first_token(c, psrv, "kvp-cancel", cancel)
    chunks = [json.loads(d) for _, d in events if d != "[DONE]"]
    ends = [ch["choices"][0] for ch in chunks if ch.get("choices") and ch["choices"][0].get("finish_reason")]
    assert ends[-1]["finish_reason"] == "length" and ends[-1]["flux"]["finish_reason"] == "cancelled"
    assert _pool(psrv)["pages_used"] == 0
    assert _complete(psrv, PAGES * PAGE_TOKENS - 64, 64).status_code == 200  # all of them free again


def test_pages_return_after_the_worker_dies(psrv: Server) -> None:
    pid = psrv.worker_pid()
    with httpx.Client(timeout=300) as c:
        events = _stream_until_first_token(c, psrv, "kvp-killed", lambda: os.kill(pid, signal.SIGKILL))
    assert json.loads(events[-2][1])["error"]["code"] == "worker_died"
    assert _pool(psrv)["pages_used"] == 0


def test_flux_show_prints_the_page_budgets(penv: ServeEnv, pplan: Plan, page_bytes: int) -> None:
    out = subprocess.run([sys.executable, "-m", "flows", "show", pplan.id[:12]], env=penv.env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("KV pages"))
    assert line.startswith(f"KV pages of {PAGE_TOKENS} tokens for 1024 tokens x 2 sequence(s): host {PAGES} pages x "
                           f"{page_bytes / 1024:,.1f} KiB")
    assert f"serve.kv_host_bytes = {PAGES * page_bytes:,}" in line
