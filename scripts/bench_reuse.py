#!/usr/bin/env python3
"""How long a saved plan takes to come back, through the real CLI as a user runs it.

1. ``flux plan MODEL --budget-s B --ctx C`` once, so that a plan is saved (its time is printed, not the point);
2. the same ``flux plan`` again, ``--runs`` times: each must print the same id and say it reused the saved plan;
   its wall time, from the process's start to its exit, is the reuse;
3. ``flux serve PLAN --port P``, ``--runs`` times: from the process's start to the first answered
   ``POST /v1/completions`` (one token), then the server is stopped (SIGINT) before the next; the model's load
   (the worker's "loaded in N ms" line on stderr) is printed beside it, and what is left once it is taken off.

Each is printed as min / median / max seconds. ``flux --help`` (the interpreter and every command's imports, nothing
run) is timed the same way. With ``--against DIR`` (another checkout of Flux, e.g. ``git worktree add /tmp/base
HEAD~3``) every measurement is taken from both trees in turn, run after run, so that a machine busy with other work
weighs on both alike, and the ratio of the medians is printed. Everything runs in a throwaway home per tree (data,
config and Prefect's under a temporary directory; the native backend and its cache are the user's), on a tiny MoE
twin unless ``--model`` names one.

    python3 scripts/bench_reuse.py [--model m.gguf] [--budget-s 30] [--ctx 512] [--runs 5] [--against DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOADED = re.compile(r"loaded in (\d+(?:\.\d+)?) ms")
MEASURES = ("flux --help", "flux plan, saved plan reused", "flux serve to its first answer", "  of which the model load",
            "  serve without the load")


@dataclass
class Tree:
    """One checkout of Flux, its throwaway home and what was measured with it."""

    name: str
    repo: Path
    env: dict[str, str]
    plan_id: str = ""
    times: dict[str, list[float]] = field(default_factory=dict)

    def flux(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "flows", *args]

    def add(self, what: str, seconds: float) -> None:
        self.times.setdefault(what, []).append(seconds)


def make_tree(name: str, repo: Path, home: Path) -> Tree:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLUX_", "XDG_DATA", "XDG_CONFIG", "PREFECT_"))}
    env.update({"XDG_DATA_HOME": str(home / "data"), "XDG_CONFIG_HOME": str(home / "config"),
                "PREFECT_HOME": str(home / "prefect"), "PYTHONPATH": str(repo)})
    return Tree(name, repo, env)


def timed(tree: Tree, args: list[str], timeout: float) -> tuple[float, subprocess.CompletedProcess[str]]:
    """Wall seconds of a ``flux`` command run to its exit, and what it said."""
    t0 = time.perf_counter()
    out = subprocess.run(tree.flux(*args), env=tree.env, cwd=tree.repo, capture_output=True, text=True,
                         timeout=timeout)
    return time.perf_counter() - t0, out


def first_answer(port: int, deadline: float) -> float:
    """Poll until ``POST /v1/completions`` answers 200; returns the perf_counter time it did."""
    body = json.dumps({"prompt": "Hello", "max_tokens": 1, "temperature": 0}).encode()
    while time.perf_counter() < deadline:
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.read()
                if resp.status == 200:
                    return time.perf_counter()
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.02)  # not listening yet: uvicorn listens once the model is loaded
    raise TimeoutError(f"flux serve answered nothing on port {port}")


def serve_once(tree: Tree, port: int, timeout: float) -> None:
    """Time ``flux serve`` from its start to its first answer, and the model's load if it said."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(tree.flux("serve", tree.plan_id[:12], "--port", str(port)), env=tree.env, cwd=tree.repo,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        took = first_answer(port, t0 + timeout) - t0
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    tree.add(MEASURES[2], took)
    if m := LOADED.search(err or ""):
        tree.add(MEASURES[3], float(m.group(1)) / 1e3)
        tree.add(MEASURES[4], took - float(m.group(1)) / 1e3)


def reuse_once(tree: Tree, plan_args: list[str]) -> None:
    took, out = timed(tree, plan_args, timeout=600)
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines or lines[-1] != tree.plan_id or "reusing saved plan" not in out.stderr:
        raise SystemExit(f"{tree.name}: `flux plan` did not reuse plan {tree.plan_id[:12]}:\n{out.stderr[-3000:]}")
    tree.add(MEASURES[1], took)


def spread(xs: list[float]) -> str:
    return f"{min(xs):7.2f} {statistics.median(xs):7.2f} {max(xs):7.2f}"


def report(trees: list[Tree], runs: int) -> None:
    print(f"{runs} runs each, seconds (min / median / max), on {os.cpu_count()} cores"
          + (", the trees taking turns" if len(trees) > 1 else ""))
    for what in MEASURES:
        cells = [(t, t.times[what]) for t in trees if t.times.get(what)]
        for t, xs in cells:
            print(f"  {what:34s} {t.name:8s} {spread(xs)}")
        if len(cells) == 2 and statistics.median(cells[0][1]) > 0:
            ratio = statistics.median(cells[1][1]) / statistics.median(cells[0][1])
            print(f"  {'':34s} {cells[1][0].name} / {cells[0][0].name}: {ratio:.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="the .gguf to plan (default: a tiny MoE twin, synthesized)")
    ap.add_argument("--budget-s", type=float, default=30, help="the first plan's --budget-s")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--port", type=int, default=8097)
    ap.add_argument("--against", type=Path, metavar="DIR", help="another checkout of Flux, measured in turn")
    ap.add_argument("--serve-timeout-s", type=float, default=600)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="flux-bench-reuse-"))
    trees = [make_tree("this", REPO, tmp / "this")]
    if args.against is not None:
        trees.append(make_tree("against", args.against.resolve(), tmp / "against"))
    model = args.model
    if model is None:
        model = tmp / "tiny-moe.gguf"
        took, made = timed(trees[0], ["synth", "--like", "tiny-moe", "-o", str(model)], timeout=300)
        if made.returncode:
            sys.stderr.write(made.stderr)
            return 1
    plan_args = ["plan", str(model), "--budget-s", f"{args.budget_s:g}", "--ctx", str(args.ctx)]
    for tree in trees:
        took, out = timed(tree, plan_args, timeout=args.budget_s + 900)
        if out.returncode:
            sys.stderr.write(f"{tree.name}: {out.stderr[-4000:]}")
            return 1
        tree.plan_id = out.stdout.strip().splitlines()[-1]
        print(f"{tree.name} ({tree.repo}): first `flux plan` of {model.name}: {took:.1f} s -> {tree.plan_id[:12]}",
              flush=True)

    for _ in range(args.runs):
        for tree in trees:
            tree.add(MEASURES[0], timed(tree, ["--help"], timeout=120)[0])
            reuse_once(tree, plan_args)
            serve_once(tree, args.port, args.serve_timeout_s)
    report(trees, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
