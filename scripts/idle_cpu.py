"""How much CPU a server's process tree burns while idle (a diagnosis for the served race: a resident contender
that spins slows the one being timed beside it; docs/benchmarks/race.md).

    python3 scripts/idle_cpu.py PLAN [--seconds 10]     # `flux serve PLAN`: one request, then idle
    python3 scripts/idle_cpu.py --pid PID [--seconds 10] # any running process tree (llama-server, ...)

Prints one JSON object: the tree's CPU time over the idle window as a share of one core (``cores``), each
process's share, and the busiest threads (name from /proc, share of a core), so a thread that polls is named.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]


def _thread_name(pid: int, tid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/task/{tid}/comm")).read_text().strip()
    except OSError:
        return "?"


def _times(procs: list[psutil.Process]) -> dict[tuple[int, int], tuple[float, str]]:
    """(pid, tid) -> (user + system seconds, thread name); tid 0 is the whole process."""
    out: dict[tuple[int, int], tuple[float, str]] = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[(p.pid, 0)] = (t.user + t.system, p.name())
            for th in p.threads():
                out[(p.pid, th.id)] = (th.user_time + th.system_time, _thread_name(p.pid, th.id))
        except psutil.Error:
            continue
    return out


def tree_cpu(pid: int, seconds: float = 10.0) -> dict[str, Any]:
    """CPU used by ``pid`` and its descendants over ``seconds`` of wall time, as shares of one core."""
    root = psutil.Process(pid)
    procs = [root, *root.children(recursive=True)]
    before, t0 = _times(procs), time.monotonic()
    time.sleep(seconds)
    after, wall = _times(procs), time.monotonic() - t0
    used = {k: (after[k][0] - v[0]) / wall for k, v in before.items() if k in after}
    threads = sorted(((share, k) for k, share in used.items() if k[1]), reverse=True)[:8]
    return {"seconds": round(wall, 2), "cores": round(sum(v for k, v in used.items() if not k[1]), 4),
            "by_process": {f"{k[0]} {before[k][1]}": round(v, 4) for k, v in used.items() if not k[1]},
            "busiest_threads": [{"pid": k[0], "tid": k[1], "name": before[k][1], "cores": round(s, 4)}
                                for s, k in threads]}


def serve_idle(settings: Any, plan_id: str, seconds: float = 10.0, settle_s: float = 1.0) -> dict[str, Any]:
    """Start ``flux serve`` of the plan, send it one completion, let it settle, then measure its idle tree."""
    import httpx

    from tasks.bench.http import FluxServe

    with tempfile.TemporaryDirectory(prefix="flux-idle-") as tmp:
        srv = FluxServe(settings, plan_id, log_path=Path(tmp) / "serve.log",
                        start_timeout_s=settings.serve.worker_timeouts.load_s)
        srv.start()
        try:
            r = httpx.post(f"{srv.base}/v1/completions", json={"prompt": "The idle test", "max_tokens": 16,
                                                               "temperature": 0.0}, timeout=300.0)
            r.raise_for_status()
            time.sleep(settle_s)
            pid = srv.proc.pid if srv.proc is not None else 0  # start() succeeded: there is a process
            return {"server": "flux serve " + plan_id[:12], **tree_cpu(pid, seconds)}
        finally:
            srv.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan", nargs="?", help="a plan id (prefix): measure `flux serve` of it")
    ap.add_argument("--pid", type=int, help="measure this running process tree instead")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    if args.pid:
        print(json.dumps({"pid": args.pid, **tree_cpu(args.pid, args.seconds)}, indent=1))  # noqa: T201
        return 0
    if not args.plan:
        ap.error("give a plan or --pid")
    sys.path.insert(0, str(REPO))
    from artifacts.config import load_settings
    from tasks.bench.context import open_bench

    settings = load_settings()
    plan_id = open_bench(settings, args.plan, check_hash=False).plan.id
    print(json.dumps(serve_idle(settings, plan_id, args.seconds), indent=1))  # noqa: T201
    return 0


if __name__ == "__main__":
    sys.exit(main())
