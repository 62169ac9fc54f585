"""Measure: time the finalists on real prompts, each in a fresh, killable worker process.

Rounds pair the finalists: in each round every live finalist runs the same prompts once, in a random
order, so slow drift of a noisy machine hits all of them alike. A candidate that crashes the worker,
runs out of memory or times out becomes rows with an error, and the flow goes on. The stage stops
before a visit that its estimated time would push past the budget.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa

from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.errors import EngineError
from engine_bridge.gpumem import GpuMemoryMeter, over_budget
from tasks.plan_types import Candidate, MeasureSummary

log = logging.getLogger(__name__)
Progress = Callable[[str], None]
TRIAL_SCHEMA = pa.schema([
    ("candidate_id", pa.string()), ("round", pa.int32()), ("prompt_index", pa.int32()),
    ("prompt_tokens", pa.int32()), ("prompt_ms", pa.float64()), ("gen_tokens", pa.int32()),
    ("gen_ms", pa.float64()), ("prefill_tps", pa.float64()), ("decode_tps", pa.float64()),
    ("load_ms", pa.float64()), ("peak_rss_bytes", pa.int64()), ("gpu_bytes", pa.int64()), ("error", pa.string()),
])


def _peak_rss(pid: int | None) -> int | None:
    """VmHWM of a process (its peak resident set), from /proc."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _visit(cand: Candidate, model: Path, prompts: list[list[int]], n_gen: int, rnd: int, timeout_s: float,
           log_path: Path, env: Mapping[str, str], gpu_budgets: list[int] | None = None) -> list[dict[str, Any]]:
    """Load one finalist in a fresh worker, warm it up, run every prompt; errors become one row.

    After its prompts, the GPU memory the worker holds (its peak: llama.cpp reserves its buffers at load)
    is read through NVML; over a per-GPU budget, every row of the visit becomes an error, so the plan
    can never be a configuration whose measured VRAM breaks the budget.
    """
    rows: list[dict[str, Any]] = []
    meter = GpuMemoryMeter() if gpu_budgets else None
    w = WorkerClient(log_path=log_path, env={**cand.params.environment(), **env})
    load_ms: float | None = None
    try:
        w.start()
        load_ms = w.request(ops.LOAD, ops.LoadArgs(model=str(model), params=cand.params), timeout_s).load_ms
        w.request(ops.TIMED_RUN, ops.TimedRunArgs(prompt=prompts[0][:16], n_gen=2), timeout_s)  # first run after a load is slow
        for i, prompt in enumerate(prompts):
            t = w.request(ops.TIMED_RUN, ops.TimedRunArgs(prompt=prompt, n_gen=n_gen), timeout_s)
            rows.append({"candidate_id": cand.id, "round": rnd, "prompt_index": i, "prompt_tokens": t.prompt_tokens,
                         "prompt_ms": t.prompt_ms, "gen_tokens": t.gen_tokens, "gen_ms": t.gen_ms,
                         "prefill_tps": t.prefill_tps if t.prompt_ms else None,
                         "decode_tps": t.decode_tps if t.gen_ms else None,
                         "load_ms": load_ms, "peak_rss_bytes": _peak_rss(w.pid), "error": None})
        used = meter.used_by(w.pid) if meter else None
        why = over_budget(used, gpu_budgets)
        for r in rows:
            r["gpu_bytes"] = sum(used) if used else None
            r["error"] = why
        if why:
            log.warning("measure: %s in round %d: %s", cand.id, rnd, why)
    except EngineError as exc:
        log.warning("measure: %s failed in round %d: %s", cand.id, rnd, exc)
        rows.append({"candidate_id": cand.id, "round": rnd, "prompt_index": -1, "load_ms": load_ms,
                     "error": f"{exc.code}: {exc.message}"})
    finally:
        w.close(timeout=5)
    return rows


def measure(finalists: list[Candidate], model: Path, prompts: list[list[int]], n_gen: int, *, budget_s: float,
            repeats: int, timeout_s: float, log_path: Path, seed: int = 0, progress: Progress | None = None,
            worker_env: Mapping[str, Mapping[str, str]] | None = None,
            gpu_budgets: list[int] | None = None) -> tuple[list[MeasureSummary], pa.Table, float, bool]:
    """Time every finalist; return (summaries, trials table, seconds spent, stopped by budget).

    ``gpu_budgets`` (bytes per GPU) turns a finalist whose measured GPU memory exceeds them into an error.
    """
    rng = random.Random(seed)
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    failed: set[str] = set()
    visit_s: list[float] = []
    stopped = False
    total = repeats * len(finalists)
    done = 0
    for rnd in range(repeats):
        order = [c for c in finalists if c.id not in failed]
        rng.shuffle(order)
        for cand in order:
            spent = time.monotonic() - t0
            estimate = statistics.median(visit_s) if visit_s else 0.0
            if rnd > 0 and spent + estimate > budget_s:
                stopped = True
                break
            done += 1
            if progress:
                progress(f"measure: candidate {done}/{total} ({cand.id}, round {rnd + 1}); "
                         f"{max(0.0, budget_s - spent):.0f} s left in the budget")
            v0 = time.monotonic()
            got = _visit(cand, model, prompts, n_gen, rnd, timeout_s, log_path, (worker_env or {}).get(cand.id, {}),
                         gpu_budgets)
            visit_s.append(time.monotonic() - v0)
            rows.extend(got)
            if any(r.get("error") for r in got):
                failed.add(cand.id)
        if stopped:
            break
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in TRIAL_SCHEMA} for r in rows], schema=TRIAL_SCHEMA)
    return [summarize(c.id, rows) for c in finalists], table, time.monotonic() - t0, stopped


def _iqr(xs: list[float]) -> float | None:
    """Interquartile range; the full range for 2-3 samples; None for fewer."""
    if len(xs) < 2:
        return None
    if len(xs) < 4:
        return max(xs) - min(xs)
    q = statistics.quantiles(xs, n=4)
    return q[2] - q[0]


def summarize(cid: str, rows: list[dict[str, Any]]) -> MeasureSummary:
    """Medians over one candidate's rounds of its whole-round figures.

    Each round runs every prompt once; its prefill speed is all its prompt tokens over all its prompt time,
    its decode speed all generated tokens over all decode time, and its workload time the sum of both
    times, so the displayed speeds and the ranking metric describe the same work (a candidate slower on
    both speeds of a round takes longer on that round). Spreads are over rounds.
    """
    mine = [r for r in rows if r["candidate_id"] == cid]
    ok = [r for r in mine if not r.get("error")]
    err = next((r["error"] for r in mine if r.get("error")), None)
    gpu = max((r.get("gpu_bytes") or 0 for r in mine), default=0) or None
    if not ok:
        return MeasureSummary(candidate_id=cid, prefill_tps=None, decode_tps=None, workload_s=None, n_trials=0,
                              error=err or "not measured (budget)", gpu_bytes=gpu)
    by_round: dict[int, list[dict[str, Any]]] = {}
    for r in ok:
        by_round.setdefault(r["round"], []).append(r)
    pre, dec, work = [], [], []
    for rs in by_round.values():
        p_ms, g_ms = sum(r["prompt_ms"] for r in rs), sum(r["gen_ms"] for r in rs)
        if p_ms > 0:
            pre.append(sum(r["prompt_tokens"] for r in rs) / p_ms * 1e3)
        if g_ms > 0:
            dec.append(sum(r["gen_tokens"] for r in rs) / g_ms * 1e3)
        work.append((p_ms + g_ms) / 1e3)
    rss = max((r["peak_rss_bytes"] or 0) for r in ok) or None
    return MeasureSummary(candidate_id=cid, prefill_tps=statistics.median(pre) if pre else None,
                          decode_tps=statistics.median(dec) if dec else None, prefill_iqr=_iqr(pre),
                          decode_iqr=_iqr(dec), workload_s=statistics.median(work), workload_iqr=_iqr(work),
                          n_trials=len(ok), n_rounds=len(by_round), error=err, peak_rss_bytes=rss, gpu_bytes=gpu)
