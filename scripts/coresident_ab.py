"""What a resident `flux serve` does to a baseline timed beside it (a diagnosis, not a benchmark: the race itself
visits one contender at a time; docs/benchmarks/race.md, "Why").

    python3 scripts/coresident_ab.py PLAN --baseline "-c 16384 -np 1 -t 16 -fa on -ngl 999 --n-cpu-moe 30" \
        [--runs 3] [--tokens 128] [--out DIR]

The plan's model, served by the llama-server of the installed backend with the baseline's flags, is timed three
ways, each by llama-server's own decode timing (``timings.predicted_per_second`` of a greedy ``/completion``):

1. ``alone``: nothing else of Flux's running;
2. ``beside-idle``: with `flux serve PLAN` resident (loaded, answered one request, idle);
3. ``alone-again``: the plan's server stopped, to see the host unchanged.

Beside each, the CPU share of the resident server's process tree (while idle, and while the baseline decodes)
and of the baseline's own tree while idle, with their busiest threads (scripts/idle_cpu.py), so a resident
that spins is named. One JSON object on stdout (and in OUT/coresident.json).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from idle_cpu import tree_cpu  # noqa: E402


def _start_server(exe: Path, model: Path, flags: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    from engine_bridge.llama_server import free_port

    port = free_port()
    proc = subprocess.Popen([str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *flags],
                            stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 600:
        if proc.poll() is not None:
            raise SystemExit(f"coresident_ab: llama-server exited (see {log})")
        try:
            if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"coresident_ab: llama-server not healthy in 600 s (see {log})")


def _decode(base: str, tokens: int) -> float:
    r = httpx.post(f"{base}/completion", json={"prompt": "Write a long story about a lighthouse keeper.",
                                               "n_predict": tokens, "temperature": 0.0, "ignore_eos": True,
                                               "cache_prompt": False}, timeout=600.0)
    r.raise_for_status()
    return float(r.json()["timings"]["predicted_per_second"])


def _baseline(exe: Path, model: Path, flags: list[str], runs: int, tokens: int, log: Path,
              watch_pid: int | None) -> dict[str, Any]:
    proc, base = _start_server(exe, model, flags, log)
    try:
        _decode(base, 16)  # warm
        watched: dict[str, Any] = {}
        if watch_pid is not None:  # the resident's CPU while this baseline decodes
            def watch() -> None:
                watched.update(tree_cpu(watch_pid, 5.0))
            th = threading.Thread(target=watch)
            th.start()
        speeds = [_decode(base, tokens) for _ in range(runs)]
        if watch_pid is not None:
            th.join()
        idle = tree_cpu(proc.pid, 5.0)
        return {"tok_s": [round(s, 2) for s in speeds], "median": round(sorted(speeds)[len(speeds) // 2], 2),
                "baseline_idle_cpu": idle, **({"resident_cpu_during_decode": watched} if watched else {})}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan")
    ap.add_argument("--baseline", required=True, help="llama-server flags of the baseline, one string")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from artifacts.config import load_settings
    from engine_bridge.backend import llama_server_path
    from tasks.bench.context import open_bench
    from tasks.bench.http import FluxServe

    settings = load_settings()
    ctx = open_bench(settings, args.plan, check_hash=False)
    exe = llama_server_path(settings.cache_dir)
    if exe is None:
        raise SystemExit("coresident_ab: no llama-server of the installed backend (scripts/build-backend.sh)")
    out = args.out or Path(tempfile.mkdtemp(prefix="flux-coresident-"))
    out.mkdir(parents=True, exist_ok=True)
    flags = shlex.split(args.baseline)
    model = Path(ctx.plan.model_path)
    report: dict[str, Any] = {"plan": ctx.plan.id[:12], "baseline": args.baseline}
    report["alone"] = _baseline(exe, model, flags, args.runs, args.tokens, out / "baseline.log", None)
    srv = FluxServe(settings, ctx.plan.id, log_path=out / "serve.log",
                    start_timeout_s=settings.serve.worker_timeouts.load_s)
    srv.start()
    try:
        httpx.post(f"{srv.base}/v1/completions", json={"prompt": "warm", "max_tokens": 16, "temperature": 0.0},
                   timeout=300.0).raise_for_status()
        time.sleep(1.0)
        pid = srv.proc.pid if srv.proc is not None else 0
        report["resident_idle_cpu"] = tree_cpu(pid, 10.0)
        report["beside-idle"] = _baseline(exe, model, flags, args.runs, args.tokens, out / "baseline.log", pid)
    finally:
        srv.stop()
    report["alone-again"] = _baseline(exe, model, flags, args.runs, args.tokens, out / "baseline.log", None)
    a = (report["alone"]["median"] + report["alone-again"]["median"]) / 2
    report["slowdown_beside_resident"] = round(1.0 - report["beside-idle"]["median"] / a, 4) if a else None
    text = json.dumps(report, indent=1)
    (out / "coresident.json").write_text(text + "\n")
    print(text)  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
