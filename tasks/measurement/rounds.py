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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from artifacts.engine_spec import NATIVE, EngineSpec
from artifacts.records.evidence import MeasureSummary
from artifacts.records.search import Candidate
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.engines.process import peak_rss
from engine_bridge.errors import EngineError
from engine_bridge.gpumem import OVER_BUDGET, GpuMemoryMeter, over_budget
from tasks.engines import engine_visit, spec_of
from tasks.measurement.speculation import base_id
from tasks.validation.gate import score_loaded, scored_path

log = logging.getLogger(__name__)
MIN_VISIT_TIMEOUT_S = 30.0
# A visit's requests may wait this many times its estimate (its prediction, or the visits so far): a loaded machine
# slows a finalist, and a slow finalist is a slower plan, never a timed-out one (on the 2-core machine beside other
# work a finalist hit the former fixed 30 s and its plan kept one round).
VISIT_TIMEOUT_FACTOR = 4.0
# The finalists every plan measures MIN_ROUNDS times however long it takes (a race needs two, each with a spread).
PROTECTED = 2
PROTECTED_ROUNDS = 2
Progress = Callable[[str], None]
TRIAL_SCHEMA = pa.schema([
    ("candidate_id", pa.string()), ("round", pa.int32()), ("prompt_index", pa.int32()),
    ("prompt_tokens", pa.int32()), ("prompt_ms", pa.float64()), ("gen_tokens", pa.int32()),
    ("gen_ms", pa.float64()), ("prefill_tps", pa.float64()), ("decode_tps", pa.float64()),
    ("load_ms", pa.float64()), ("peak_rss_bytes", pa.int64()), ("gpu_bytes", pa.int64()), ("gpu_method", pa.string()),
    ("error", pa.string()),
])


@dataclass(frozen=True)
class Scoring:
    """What a finalist's first visit scores while it is loaded, for validation (tasks.validation.gate.score_loaded)."""

    seqs: list[tuple[list[int], list[int]]]
    held_out: list[list[int]]
    directory: Path
    n_vocab: int = 0  # the width of a scored row (an engine's scores are built from its top alternatives)


def _visit(cand: Candidate, model: Path, prompts: list[list[int]], n_gen: int, rnd: int, timeout_s: float,
           log_path: Path, env: Mapping[str, str], gpu_budgets: list[int] | None = None,
           scoring: Scoring | None = None) -> list[dict[str, Any]]:
    """Load one finalist in a fresh worker, warm it up, run every prompt; errors become one row.

    With ``scoring`` (a finalist's first visit), the loaded worker then scores the reference's continuations
    for the quality gate, after the timed prompts so that it does not disturb them.

    After its prompts, the GPU memory the worker holds (its peak: llama.cpp reserves its buffers at load)
    is read through NVML; over a per-GPU budget, every row of the visit becomes an error, so the plan
    can never be a configuration whose measured VRAM breaks the budget.
    """
    rows: list[dict[str, Any]] = []
    meter = GpuMemoryMeter()
    w = WorkerClient(log_path=log_path, env={**cand.params.environment(), **env})
    load_ms: float | None = None
    phases = VisitPhases()
    try:
        w.start()
        phases.mark("start")
        load_ms = w.request(ops.LOAD, ops.LoadArgs(model=str(model), params=cand.params), timeout_s).load_ms
        phases.mark("load")
        _timed(w, cand, prompts[0][:16], 2, timeout_s)  # first run after a load is slow (a draft loads in it)
        phases.mark("warm-up")
        for i, prompt in enumerate(prompts):
            t, drafted = _timed(w, cand, prompt, n_gen, timeout_s)
            rows.append({"candidate_id": cand.id, "round": rnd, "prompt_index": i, "prompt_tokens": t.prompt_tokens,
                         "prompt_ms": t.prompt_ms, "gen_tokens": t.gen_tokens, "gen_ms": t.gen_ms,
                         "prefill_tps": t.prefill_tps if t.prompt_ms else None,
                         "decode_tps": t.decode_tps if t.gen_ms else None,
                         "load_ms": load_ms, "peak_rss_bytes": peak_rss(w.pid), "error": None, **drafted})
        phases.mark("prompts")
        reading = meter.read(w.pid)
        if scoring is not None and not over_budget(reading.per_gpu if reading else None, gpu_budgets):
            score_loaded(w, cand.id, scoring.seqs, scoring.held_out, scoring.directory, timeout_s)
            phases.mark("scoring")
        why = over_budget(reading.per_gpu if reading else None, gpu_budgets)
        for r in rows:
            r["gpu_bytes"] = reading.total if reading else None
            r["gpu_method"] = reading.method if reading else None
            r["error"] = why
        if why:
            log.warning("measure: %s in round %d: %s", cand.id, rnd, why)
    except EngineError as exc:
        log.warning("measure: %s failed in round %d: %s", cand.id, rnd, exc)
        rows.append({"candidate_id": cand.id, "round": rnd, "prompt_index": -1, "load_ms": load_ms,
                     "error": f"{exc.code}: {exc.message}"})
    finally:
        w.close(timeout=5)
        phases.mark("exit")
        log.info("measure: %s visit %d took %s", cand.id, rnd + 1, phases)
    return rows


class VisitPhases:
    """Where a visit's wall time went (start the worker, load, warm up, the timed prompts, scoring, exit): a
    big model's visit is mostly its load, and the visit's prediction (:func:`tasks.workload.visit_seconds`) is
    checked against these."""

    def __init__(self) -> None:
        self.t0 = self.last = time.monotonic()
        self.spans: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        """The phase that just ended."""
        now = time.monotonic()
        self.spans.append((phase, now - self.last))
        self.last = now

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {s:.1f}" for name, s in self.spans)
        return f"{self.last - self.t0:.1f} s ({parts})"


def _timed(w: WorkerClient, cand: Candidate, prompt: list[int], n_gen: int,
           timeout_s: float) -> tuple[ops.Timing, dict[str, int]]:
    """One timed prompt: prefill, then ``n_gen`` greedy tokens, drafted as the candidate drafts (the tokens
    it proposed and the model kept beside the timing)."""
    d = cand.draft
    if d is None:
        return w.request(ops.TIMED_RUN, ops.TimedRunArgs(prompt=prompt, n_gen=n_gen), timeout_s), {}
    # n_gen + 1: the prefill's token, then n_gen more, as a timed run decodes
    got = w.request(ops.SPEC_GREEDY, ops.SpecGreedyArgs(
        prompt=prompt, n_gen=n_gen + 1, draft_model=d.model if d.kind == "model" else None,
        ngram=d.ngram if d.kind == "ngram" else 0, n_draft=d.n_draft), timeout_s)
    return (ops.Timing(prompt_tokens=len(prompt), prompt_ms=got.prompt_ms, gen_tokens=len(got.tokens) - 1,
                       gen_ms=got.gen_ms), {"drafted": got.drafted, "accepted": got.accepted})


def measure(finalists: list[Candidate], model: Path, prompts: list[list[int]], n_gen: int, *, budget_s: float,
            repeats: int, timeout_s: float, log_path: Path, seed: int = 0, progress: Progress | None = None,
            worker_env: Mapping[str, Mapping[str, str]] | None = None,
            gpu_budgets: list[int] | None = None, predicted_gpu: Mapping[str, int] | None = None,
            scoring: Scoring | None = None, engines: Sequence[EngineSpec] = (),
            predicted_visit_s: Mapping[str, float] | None = None,
            reserves: Sequence[Candidate] = ()) -> tuple[list[MeasureSummary], pa.Table, float, bool]:
    """Time every finalist; return (summaries, trials table, seconds spent, stopped by budget).

    A finalist on an engine other than the worker (``engine``, one of ``engines``) is visited through that
    engine (:func:`tasks.engines.engine_visit`), in the same rounds and under the same budget.

    ``gpu_budgets`` (bytes per GPU) turns a finalist whose measured GPU memory exceeds them into an error;
    ``predicted_gpu`` (bytes on every GPU, by candidate id) is recorded beside the measured bytes. The budget
    is a deadline: no visit starts that its estimate (the median visit so far, else ``predicted_visit_s``)
    would end past it, in any round, except the PROTECTED fastest finalists' first PROTECTED_ROUNDS visits,
    which always run (a plan's race has two finalists measured twice each, at worst later than the budget).
    After the first round, the finalists whose second visits (each as long as its first) do not all fit what
    is left are cut, slowest first, so that every finalist kept gets a second round (a spread); a cut one is
    an error row ("measured once"), never the plan. A visit's requests wait VISIT_TIMEOUT_FACTOR times its
    estimate at least, so a loaded machine slows a finalist rather than timing it out.

    ``reserves`` are finalists left out for the budget, best first: in the first round, a finalist that fails
    (over the memory budget, a crash) hands its visit to the next reserve, so that a plan whose best-predicted
    finalists all measure over the budget still measures the others (H200 run 15: both mapped splits of the
    qwen35moe twin read 12.08 GiB of 12 and the four left out were never tried). A finalist over the memory
    budget also takes with it the unvisited ones predicted to hold as much at the same micro-batch (their
    visits would end the same way), and each of those visits goes to a reserve too. Reserves never visited
    are in no summary.
    """
    rng = random.Random(seed)
    finalists = list(finalists)
    spare = list(reserves)
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    failed: set[str] = set()
    visit_s: list[float] = []
    first_visit: dict[str, float] = {}
    stopped = False
    total = repeats * len(finalists)
    done = 0
    protected: set[str] = set()
    for rnd in range(repeats):
        if rnd == 1:
            protected = set(_fastest(rows, first_visit, failed, PROTECTED))
            for cid in _cut_for_second_round(rows, first_visit, failed, budget_s - (time.monotonic() - t0)):
                failed.add(cid)
                rows.append({"candidate_id": cid, "round": 1, "prompt_index": -1,
                             "error": "measured once: the budget left no second round (no spread)"})
                if progress:
                    progress(f"measure: {cid} cut after one round: the budget left no second round for it")
        order = [c for c in finalists if c.id not in failed]
        rng.shuffle(order)
        for cand in order:
            if cand.id in failed:  # dropped while this round ran
                continue
            spent = time.monotonic() - t0
            estimate = statistics.median(visit_s) if visit_s else (predicted_visit_s or {}).get(cand.id, 0.0)
            estimate = max(estimate, first_visit.get(cand.id, 0.0))
            must = done < PROTECTED or (rnd < PROTECTED_ROUNDS and cand.id in protected)
            if not must and spent + estimate > budget_s:
                stopped = True
                continue  # a protected finalist later in this round's order still gets its visit
            done += 1
            if progress:
                progress(f"measure: candidate {done}/{total} ({cand.id}, round {rnd + 1}); "
                         f"{max(0.0, budget_s - spent):.0f} s left in the budget")
            v0 = time.monotonic()
            # no request of a visit may wait past the budget's end (at least MIN_VISIT_TIMEOUT_S): a finalist
            # that hangs or crawls becomes a timeout row instead of holding the plan for measure_timeout_s
            wait_s = min(timeout_s, max(MIN_VISIT_TIMEOUT_S, VISIT_TIMEOUT_FACTOR * estimate, budget_s - spent))
            if cand.engine != NATIVE:
                score = scoring if rnd == 0 and cand.draft is None else None  # a draft's placement scores
                got = engine_visit(cand, spec_of(engines, cand.engine), model, prompts, n_gen, rnd, wait_s, log_path,
                                   (score.seqs, score.held_out, score.n_vocab, scored_path(score.directory, cand.id))
                                   if score else None)
            else:
                # a drafting candidate's placement is scored once, in its own finalist's visit
                got = _visit(cand, model, prompts, n_gen, rnd, wait_s, log_path,
                             (worker_env or {}).get(cand.id, {}), gpu_budgets,
                             scoring if rnd == 0 and cand.draft is None else None)
            visit_s.append(time.monotonic() - v0)
            first_visit.setdefault(cand.id, visit_s[-1])
            rows.extend(got)
            if any(r.get("error") for r in got):
                failed.add(cand.id)
                if rnd == 0:
                    unvisited = [c for c in order if c.id not in first_visit]  # a measured one keeps its rows
                    like = _like_over_budget(cand, got, unvisited, failed, predicted_gpu or {})
                    like += _its_drafting(cand, unvisited, failed | {cid for cid, _ in like}, "failed")
                    for cid, why in like:
                        failed.add(cid)
                        rows.append({"candidate_id": cid, "round": 0, "prompt_index": -1, "error": why})
                        if progress:
                            progress(f"measure: {cid} dropped: {why}")
                    gone = {cid for cid, _ in _like_over_budget(cand, got, spare, failed, predicted_gpu or {})}
                    spare = [c for c in spare if c.id not in gone]
                    for _ in range(min(len(spare), 1 + len(like))):  # a reserve for every visit freed
                        finalists.append(spare.pop(0))
                        order.append(finalists[-1])
                        total += repeats
                        if progress:
                            progress(f"measure: {cand.id} failed; a visit goes to {finalists[-1].id}, left out for "
                                     "the budget")
            if rnd == 0 and predicted_visit_s:
                left = budget_s - (time.monotonic() - t0)
                for cid, why in _drop_unvisited(finalists, first_visit, predicted_visit_s, failed, left):
                    failed.add(cid)
                    rows.append({"candidate_id": cid, "round": 0, "prompt_index": -1, "error": why})
                    if progress:
                        progress(f"measure: {cid} dropped: {why}")
        if stopped and rnd + 1 >= PROTECTED_ROUNDS:
            break
    rows += _measured_once(rows, failed)
    table = pa.Table.from_pylist([{f.name: r.get(f.name) for f in TRIAL_SCHEMA} for r in rows], schema=TRIAL_SCHEMA)
    pred = predicted_gpu or {}
    summaries = [summarize(c.id, rows).model_copy(update={"predicted_gpu_bytes": pred.get(c.id)}) for c in finalists]
    return summaries, table, time.monotonic() - t0, stopped


def _like_over_budget(cand: Candidate, got: list[dict[str, Any]], others: Sequence[Candidate], failed: set[str],
                      predicted: Mapping[str, int]) -> list[tuple[str, str]]:
    """(id, reason) of the unvisited ``others`` that would measure over the memory budget as ``cand`` just did:
    predicted to hold at least as much at the same micro-batch (nothing when ``cand`` failed otherwise)."""
    why = next((r["error"] for r in got if r.get("error")), "")
    mine = predicted.get(cand.id)
    if not why.startswith(OVER_BUDGET) or mine is None:
        return []
    return [(c.id, f"not measured: predicted {predicted[c.id] / 2**30:.2f} GiB at micro-batch {c.params.n_ubatch}, "
                   f"no less than {cand.id}, {why}")
            for c in others if c.id not in failed and c.id != cand.id and predicted.get(c.id, -1) >= mine
            and c.params.n_ubatch == cand.params.n_ubatch]


def _drop_unvisited(finalists: list[Candidate], first_visit: Mapping[str, float], predicted: Mapping[str, float],
                    failed: set[str], left_s: float) -> list[tuple[str, str]]:
    """(id, reason) of finalists not yet visited to drop, prune's last-ranked first, until what is left of the
    first round and a whole second round fit ``left_s``, with visits priced by how the ones so far compared
    with their predictions (on the H200 they took twice as long): finalists a budget cannot measure twice
    are better left out than measured once. Two finalists at least stay, and two placements where there are: a
    drafting candidate (``--speculation``) goes before the second placement would (H200 run 22 dropped c209 and
    raced c208 against its own prompt lookup alone)."""
    ratios = [first_visit[c] / predicted[c] for c in first_visit if predicted.get(c)]
    if not ratios:
        return []
    scale = max(1.0, statistics.median(ratios))
    by_id = {c.id: c for c in finalists}
    drafting = {c.id for c in finalists if c.draft is not None}
    live = [c.id for c in finalists if c.id not in failed]
    est = {c: first_visit.get(c, predicted.get(c, 0.0) * scale) for c in live}
    unvisited = [c for c in live if c not in first_visit]
    out: list[tuple[str, str]] = []
    while unvisited and len(live) > 2 and sum(est[c] for c in unvisited) + sum(est[c] for c in live) > left_s:
        cid = unvisited[-1]
        if cid not in drafting and sum(c not in drafting for c in live) <= 2:
            cid = next((c for c in reversed(unvisited) if c in drafting), "")
            if not cid:
                break
        unvisited.remove(cid)
        live.remove(cid)
        out.append((cid, f"not measured: visits took {scale:.1f}x their predicted time, and the budget left no room "
                         "for two rounds of it"))
        for did, why in _its_drafting(by_id[cid], [by_id[c] for c in unvisited], set(), "was dropped"):
            unvisited.remove(did)
            live.remove(did)
            out.append((did, why))
    return out


def _its_drafting(cand: Candidate, unvisited: Sequence[Candidate], failed: set[str],
                  what: str) -> list[tuple[str, str]]:
    """(id, reason) of the unvisited drafting candidates on placement ``cand``, which failed or was dropped: with
    no placement to race against, their visits would measure nothing."""
    if cand.draft is not None:
        return []
    return [(c.id, f"not measured: its placement {cand.id} {what}") for c in unvisited
            if c.draft is not None and base_id(c.id) == cand.id and c.id not in failed]


def _measured_once(rows: list[dict[str, Any]], failed: set[str]) -> list[dict[str, Any]]:
    """Error rows for live finalists left with one round while others got more: their one reading has no
    spread to set against the others' medians, so they are shown, never ranked."""
    rounds: dict[str, set[int]] = {}
    for r in rows:
        if not r.get("error"):
            rounds.setdefault(r["candidate_id"], set()).add(r["round"])
    if not any(len(v) >= 2 for v in rounds.values()):
        return []  # nobody got a spread: the plan says so (persist's note), and the fastest single reading stands
    return [{"candidate_id": cid, "round": 1, "prompt_index": -1,
             "error": "measured once: the budget ran out before its second round (no spread)"}
            for cid, v in rounds.items() if len(v) < 2 and cid not in failed]


def _cut_for_second_round(rows: list[dict[str, Any]], first_visit: Mapping[str, float], failed: set[str],
                          left_s: float) -> list[str]:
    """Finalists to cut so that the rest get a second visit within ``left_s``: the slowest by their first
    round's workload time go first (the fastest are the ones a plan can be)."""
    keep = _fastest(rows, first_visit, failed, len(first_visit))
    cut: list[str] = []
    while len(keep) > PROTECTED and sum(first_visit[c] for c in keep) > left_s:
        cut.append(keep.pop())
    return cut


def _fastest(rows: list[dict[str, Any]], first_visit: Mapping[str, float], failed: set[str], n: int) -> list[str]:
    """The ``n`` visited, live finalists with the least first-round workload time, fastest first."""
    live = [cid for cid in first_visit if cid not in failed]
    work = {cid: sum((r.get("prompt_ms") or 0) + (r.get("gen_ms") or 0) for r in rows if r["candidate_id"] == cid)
            for cid in live}
    return sorted(live, key=lambda cid: work[cid])[:n]


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
    method = next((r.get("gpu_method") for r in mine if r.get("gpu_method")), None)
    if not ok:
        return MeasureSummary(candidate_id=cid, prefill_tps=None, decode_tps=None, workload_s=None, n_trials=0,
                              error=err or "not measured (budget)", gpu_bytes=gpu, gpu_method=method)
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
    once = bool(err and err.startswith("measured once"))  # speeds shown, never ranked: no spread behind them
    drafted = [r for r in ok if r.get("drafted") is not None]
    return MeasureSummary(candidate_id=cid, prefill_tps=statistics.median(pre) if pre else None,
                          decode_tps=statistics.median(dec) if dec else None, prefill_iqr=_iqr(pre),
                          decode_iqr=_iqr(dec), workload_s=None if once else statistics.median(work),
                          workload_iqr=_iqr(work),
                          n_trials=len(ok), n_rounds=len(by_round), error=err, peak_rss_bytes=rss, gpu_bytes=gpu,
                          gpu_method=method, drafted=sum(r["drafted"] for r in drafted) if drafted else None,
                          accepted=sum(r["accepted"] for r in drafted) if drafted else None)
