#!/usr/bin/env python3
"""Qwen Code, headless, against `flux serve` of a twin: does a real coding agent's traffic go through?

1. synthesizes a tiny-moe twin whose trained context holds Qwen Code's first request (65,536 tokens: its
   system prompt and tools are ~24k tokens for Qwen's tokenizer, ~45k for the twin's simpler one);
2. plans it with `flux plan twin.gguf --ctx 65536 --budget-s 60` (``--quick-plan``: a stored plan, no
   measurement, as the tests make them);
3. serves it with `flux serve`, behind a recording proxy that writes each request Qwen Code sends (JSON
   body, headers without the key) and what came back (status, stream events, tool calls);
4. runs ``qwen --auth-type openai -p PROMPT`` (Qwen Code from npm, ``@qwen-code/qwen-code@0.24.4``, installed
   into ``--qwen-dir`` when missing) with OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL pointing at it;
5. prints and saves a report (``--out``): request shapes, statuses, tool calls; and, with ``--fixture``,
   the request bodies for the CI replay (tests/server/test_qwen_code_replay.py).

A random-weight twin writes gibberish, so success is: every request accepted (no 4xx/5xx but intended
ones), the tools rendered into the prompt, and replies that Qwen Code reads.

    python3 scripts/qwen_code_e2e.py --out /tmp/qwen-e2e [--quick-plan] [--fixture tests/server/data/...]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from artifacts.config import load_settings  # noqa: E402
from artifacts.synth import synthesize  # noqa: E402

QWEN_PACKAGE = "@qwen-code/qwen-code@0.24.4"
PROMPT = "List the Python files in this directory and tell me what tasks/bench/ttft.py measures."
KEY = "flux-e2e-key"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Recorder:
    """An ASGI reverse proxy to ``upstream`` that records every exchange."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.exchanges: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k.decode() not in ("host", "content-length")}
        rec: dict[str, Any] = {"t": time.time(), "method": scope["method"], "path": scope["path"],
                               "headers": {k: ("<redacted>" if k == "authorization" else v) for k, v in headers.items()}}
        try:
            rec["body"] = json.loads(body) if body else None
        except ValueError:
            rec["body_text"] = body.decode(errors="replace")[:2000]
        self.exchanges.append(rec)
        url = self.upstream + scope["path"] + (("?" + scope["query_string"].decode()) if scope["query_string"] else "")
        async with httpx.AsyncClient(timeout=None) as client, client.stream(
                scope["method"], url, headers=headers, content=body) as r:
            rec["status"] = r.status_code
            await send({"type": "http.response.start", "status": r.status_code,
                        "headers": [(k.encode(), v.encode()) for k, v in r.headers.items()
                                    if k.lower() not in ("content-length", "transfer-encoding", "connection")]})
            raw = b""
            async for chunk in r.aiter_raw():
                raw += chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        rec["response"] = summarize(raw, r.headers.get("content-type", ""))


def summarize(raw: bytes, content_type: str) -> dict[str, Any]:
    """What a response said: its error, or its text length, tool calls and finish reason."""
    text = raw.decode(errors="replace")
    if not content_type.startswith("text/event-stream"):
        try:
            body = json.loads(text)
        except ValueError:
            return {"raw": text[:500]}
        if "error" in body:
            return {"error": body["error"]}
        choice = (body.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        return {"content_chars": len(msg.get("content") or ""), "tool_calls": msg.get("tool_calls"),
                "finish_reason": choice.get("finish_reason"), "usage": body.get("usage")}
    content, calls, reason, usage, errors = "", [], None, None, []
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            errors.append(ev["error"])
            continue
        usage = ev.get("usage") or usage
        for ch in ev.get("choices") or []:
            content += ch.get("delta", {}).get("content") or ""
            calls += ch.get("delta", {}).get("tool_calls") or []
            reason = ch.get("finish_reason") or reason
    return {"stream": True, "content_chars": len(content), "tool_calls": calls or None, "finish_reason": reason,
            "usage": usage, "errors": errors or None}


def shape(body: dict[str, Any] | None) -> dict[str, Any]:
    """A request body's shape: its keys and the sizes that matter, not its text."""
    if not isinstance(body, dict):
        return {}
    msgs = body.get("messages") or []
    return {"keys": sorted(body), "stream": body.get("stream"), "stream_options": body.get("stream_options"),
            "max_tokens": body.get("max_tokens"), "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice"), "parallel_tool_calls": body.get("parallel_tool_calls"),
            "tools": [t.get("function", {}).get("name") for t in body.get("tools") or []],
            "messages": [{"role": m.get("role"), "content": type(m.get("content")).__name__,
                          "chars": len(json.dumps(m.get("content"))), "tool_calls": len(m.get("tool_calls") or [])}
                         for m in msgs]}


def ensure_qwen(qwen_dir: Path) -> Path:
    exe = qwen_dir / "node_modules" / ".bin" / "qwen"
    if not exe.exists():
        qwen_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error", QWEN_PACKAGE],
                       cwd=qwen_dir, check=True)
    return exe


def make_plan(model: Path, ctx: int, budget_s: float, quick: bool, env: dict[str, str]) -> str:
    if quick:
        from artifacts.engine_params import EngineParams
        from tasks.testing import stored_plan

        params = EngineParams(n_ctx=ctx, n_seq_max=1, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2)
        return stored_plan(load_settings(env), model, params, key_extra={"qwen_code_e2e": True}).id
    out = subprocess.run([sys.executable, "-m", "flows", "plan", str(model), "--ctx", str(ctx), "--budget-s",
                          str(budget_s)], env=env, cwd=REPO, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise SystemExit(f"flux plan failed ({out.returncode}): {out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1].strip()


def serve(plan_id: str, port: int, env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "server", plan_id[:12], "--port", str(port)],
                            env={**env, "FLUX_API_KEY": KEY}, cwd=REPO, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"flux serve exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("flux serve did not come up")


def run_proxy(recorder: Recorder, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(recorder, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


def run_qwen(exe: Path, prompt: str, proxy_port: int, model_id: str, out: Path, env: dict[str, str],
             timeout: float) -> tuple[int | None, str, str]:
    """Qwen Code headless in a scratch copy of scripts/: (exit code or None on timeout, stdout, stderr)."""
    work = Path(tempfile.mkdtemp(prefix="qwen-work-"))
    shutil.copytree(REPO / "scripts", work / "scripts")
    (out / "qwen-home").mkdir(exist_ok=True)
    qenv = {**env, "OPENAI_BASE_URL": f"http://127.0.0.1:{proxy_port}/v1", "OPENAI_API_KEY": KEY,
            "OPENAI_MODEL": model_id, "HOME": str(out / "qwen-home"), "NO_COLOR": "1"}
    try:
        q = subprocess.run([str(exe), "--auth-type", "openai", "-p", prompt], env=qenv, cwd=work,
                           capture_output=True, text=True, timeout=timeout)
        return q.returncode, q.stdout, q.stderr
    except subprocess.TimeoutExpired as exc:
        return None, str(exc.stdout or ""), str(exc.stderr or "")


def write_report(out: Path, report: dict[str, Any], exchanges: list[dict[str, Any]], fixture: Path | None) -> None:
    """report.json, every exchange as JSON lines, the request bodies as a fixture; one line per request."""
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "requests.jsonl").write_text("".join(json.dumps(e) + "\n" for e in exchanges))
    if fixture:
        bodies = [{"path": e["path"], "user_agent": e["headers"].get("user-agent"), "body": e["body"]}
                  for e in exchanges if e["method"] == "POST" and isinstance(e.get("body"), dict)]
        fixture.write_text("".join(json.dumps(b, ensure_ascii=False) + "\n" for b in bodies))
    for r in report["requests"]:
        s, resp = r["shape"], r["response"] or {}
        print(f"{r['path']} -> {r['status']}: stream={s.get('stream')} max_tokens={s.get('max_tokens')} "
              f"tools={len(s.get('tools') or [])} messages={[m['role'] for m in s.get('messages') or []]} "
              f"tool_choice={s.get('tool_choice')} | finish={resp.get('finish_reason')} "
              f"calls={len(resp.get('tool_calls') or [])} error={(resp.get('error') or {}).get('code')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for the report, logs and captured requests")
    ap.add_argument("--qwen-dir", type=Path, default=Path.home() / ".cache" / "flux" / "qwen-code")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--ctx", type=int, default=65536, help="the twin's tokenizer needs ~45k tokens for Qwen Code's first request")
    ap.add_argument("--budget-s", type=float, default=60)
    ap.add_argument("--quick-plan", action="store_true", help="a stored plan instead of running `flux plan`")
    ap.add_argument("--timeout", type=float, default=900, help="seconds Qwen Code may run")
    ap.add_argument("--fixture", type=Path, help="write the captured request bodies here (JSON lines)")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "FLUX_API_KEY"}
    env.update({"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    model = out / "qwen-e2e-twin.gguf"
    if not model.exists():
        synthesize("tiny-moe", model, overrides={"n_ctx_train": str(args.ctx)})
    t0 = time.monotonic()
    plan_id = make_plan(model, args.ctx, args.budget_s, args.quick_plan, env)
    plan_s = time.monotonic() - t0
    flux_port, proxy_port = free_port(), free_port()
    srv = serve(plan_id, flux_port, env, out / "flux-serve.log")
    recorder = Recorder(f"http://127.0.0.1:{flux_port}")
    proxy = run_proxy(recorder, proxy_port)
    model_id = httpx.get(f"http://127.0.0.1:{flux_port}/v1/models", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=30).json()["data"][0]["id"]
    t1 = time.monotonic()
    rc, stdout, stderr = run_qwen(ensure_qwen(args.qwen_dir), args.prompt, proxy_port, model_id, out, env,
                                  args.timeout)
    qwen_s = time.monotonic() - t1
    proxy.should_exit = True
    srv.terminate()
    srv.wait(30)
    report = {"plan_id": plan_id, "plan_s": round(plan_s, 1), "model": model_id, "qwen_rc": rc,
              "qwen_s": round(qwen_s, 1), "qwen_stdout_tail": stdout[-1500:], "qwen_stderr_tail": stderr[-1500:],
              "requests": [{"path": e["path"], "status": e.get("status"), "shape": shape(e.get("body")),
                            "response": e.get("response")} for e in recorder.exchanges]}
    write_report(out, report, recorder.exchanges, args.fixture)
    print(f"plan {plan_id[:12]} ({plan_s:.0f} s), Qwen Code exit {rc} after {qwen_s:.0f} s; report: {out / 'report.json'}")
    bad = [r for r in report["requests"] if (r["status"] or 0) >= 400]
    return 1 if bad or rc is None else 0


if __name__ == "__main__":
    sys.exit(main())
