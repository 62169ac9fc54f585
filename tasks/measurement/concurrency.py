"""``flux plan --serving-p95-ms MS``: the serving curve of the fastest native finalist, and the sequence count kept.

One worker loads the finalist's placement with ``n_seq_max`` = ``--concurrency`` (the most sequences the plan was
enumerated for, so every count fits its memory) and serves, for each count N of 1, 2, 4, ... up to it, N streams
of the workload's prompts started together: the worker batches them continuously in one context, as ``flux serve``
does. Each N records the aggregate tokens per second (every stream's completion tokens over the wall time to the
last token) and the p50/p95 of the gaps between a stream's successive tokens (a decode step shared with N-1 others
and with their prompts' chunks: the latency a client sees per token). Every count runs once a round, in a new
seeded order each round (as measure pairs its finalists), up to ROUNDS rounds while the budget the race left
holds another (the first round is always run: a plan asked for a curve has one): its tok/s is the median round's,
its percentiles pool every round's gaps. The plan keeps the N with the most aggregate
tokens per second whose p95 is within MS; when none is, the N with the lowest p95, and its note names the best p95
reached and the flag value that would meet it.

Each stream's prompt has a token of its own in place of its second, so no stream reuses another's (or an earlier
count's) cached prefix: every count prefills what it serves, and the prompt keeps its length.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from artifacts.records.evidence import MeasureSummary
from artifacts.records.search import Candidate
from artifacts.records.serving import ServingChoice, ServingPoint
from engine_bridge import ops
from engine_bridge.aclient import AsyncWorkerClient
from engine_bridge.errors import EngineError
from engine_bridge.sampling import GREEDY

log = logging.getLogger(__name__)
Progress = Callable[[str], None]
ROUNDS = 3  # each count's rounds: its p95 pools their gaps, its tok/s is their median


def sequence_counts(most: int) -> list[int]:
    """1, 2, 4, ... below ``most``, then ``most``."""
    out, n = [], 1
    while n < most:
        out.append(n)
        n *= 2
    return [*out, most]


def _salted(prompt: list[int], salt: int, n_vocab: int) -> list[int]:
    """The prompt with a token of its own in place of its second (no cached prefix of another stream fits it)."""
    return [prompt[0], 1 + salt % max(1, n_vocab - 1), *prompt[2:]] if len(prompt) > 1 else list(prompt)


def _percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


async def _stream(w: AsyncWorkerClient, rid: str, prompt: list[int], n_gen: int, timeout_s: float) -> list[float]:
    """The arrival time of each token of one greedy stream."""
    times: list[float] = []
    args = ops.GenerateArgs.model_construct(rid=rid, prompt=prompt, max_tokens=n_gen, sampling=GREEDY)
    async for msg in w.generate(args, timeout=timeout_s):
        if msg["type"] == "token":
            times.append(time.perf_counter())
    return times


@dataclass
class _Runs:
    """One count's rounds so far: each round's aggregate tok/s and wall seconds, every gap, every token."""

    tps: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None

    def point(self, n: int) -> ServingPoint:
        """The count's point: the median round's tok/s, the percentiles of every round's gaps pooled."""
        ok = self.error is None and bool(self.gaps) and bool(self.tps)
        return ServingPoint(sequences=n, aggregate_tps=statistics.median(self.tps) if ok else None,
                            p95_token_ms=_percentile(self.gaps, 0.95) if ok else None,
                            p50_token_ms=statistics.median(self.gaps) if ok else None, tokens=self.tokens,
                            seconds=sum(self.seconds), rounds=len(self.tps),
                            error=self.error or (None if self.gaps else "no two tokens streamed: no per-token latency"))


async def _round(w: AsyncWorkerClient, n: int, prompts: Sequence[list[int]], n_gen: int, salt: int, n_vocab: int,
                 timeout_s: float, runs: _Runs) -> None:
    """``n`` streams started together, their tokens' times added to ``runs``."""
    t0 = time.perf_counter()
    got = await asyncio.gather(*(_stream(w, f"c{salt}-{i}", _salted(prompts[i % len(prompts)], salt + i, n_vocab),
                                         n_gen, timeout_s) for i in range(n)))
    tokens = sum(len(t) for t in got)
    wall = max((t[-1] for t in got if t), default=time.perf_counter()) - t0
    runs.gaps += [(b - a) * 1e3 for t in got for a, b in zip(t, t[1:], strict=False)]
    runs.tokens += tokens
    runs.seconds.append(wall)
    if tokens and wall > 0:
        runs.tps.append(tokens / wall)


async def _curve(cand: Candidate, model: Path, prompts: Sequence[list[int]], n_gen: int, counts: Sequence[int],
                 rounds: int, budget_s: float, seed: int, timeout_s: float,
                 log_path: Path | None) -> list[ServingPoint]:
    params = cand.params.model_copy(update={"n_seq_max": max(counts)})
    w = AsyncWorkerClient(log_path, env=params.environment())
    runs = {n: _Runs() for n in counts}
    rng, salt = random.Random(seed), 1
    try:
        await w.start()
        info = await w.request(ops.SERVE_LOAD, ops.ServeLoadArgs(model=str(model), params=params), timeout=timeout_s)
        t0 = time.perf_counter()
        for r in range(rounds):  # every count once a round, in a new order: a drifting machine hits them alike
            spent = time.perf_counter() - t0
            if r and spent / r + spent > budget_s:  # another round like the last ones would overrun the budget
                break
            for n in rng.sample(list(counts), len(counts)):
                if runs[n].error is None:
                    try:
                        await _round(w, n, prompts, n_gen, salt, info.n_vocab, timeout_s, runs[n])
                    except (EngineError, TimeoutError) as e:  # the count's row says so; the flow goes on
                        runs[n].error = str(e) or type(e).__name__
                        if not w.alive:
                            raise
                    salt += n
    except (EngineError, TimeoutError) as e:
        for left in runs.values():
            left.error = left.error or f"worker: {e or type(e).__name__}"
    finally:
        await w.close()
    return [runs[n].point(n) for n in counts]


def serving_curve(cand: Candidate, model: Path, prompts: Sequence[list[int]], n_gen: int, counts: Sequence[int], *,
                  rounds: int = ROUNDS, budget_s: float = math.inf, seed: int = 0, timeout_s: float,
                  log_path: Path | None = None) -> list[ServingPoint]:
    """Time ``cand`` serving each of ``counts`` streams at once, ``rounds`` times each while ``budget_s`` holds
    another round (module docstring); one point per count, a count that failed a point with its error."""
    # a loop of its own on a thread of its own: the caller (a Prefect task) may already be running one
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, _curve(cand, model, prompts, n_gen, counts, rounds, budget_s, seed, timeout_s,
                                               log_path)).result()


def choose(candidate_id: str, curve: list[ServingPoint], p95_ms: float) -> ServingChoice:
    """The count with the most aggregate tok/s whose p95 is within ``p95_ms``; else the lowest p95, with the note
    of what it reached and the ``--serving-p95-ms`` that would meet it."""
    timed = [p for p in curve if p.error is None and p.aggregate_tps and p.p95_token_ms is not None]
    within = [p for p in timed if (p.p95_token_ms or 0.0) <= p95_ms]
    if within:
        best = max(within, key=lambda p: p.aggregate_tps or 0.0)
        return ServingChoice(candidate_id=candidate_id, p95_ms=p95_ms, curve=curve, sequences=best.sequences,
                             met=True, note=(
                                 f"--serving-p95-ms {p95_ms:g}: {best.sequences} sequence(s) at once serve "
                                 f"{best.aggregate_tps or 0:.1f} tok/s with p95 {best.p95_token_ms or 0:.1f} ms per "
                                 f"token, the most of the {len(timed)} count(s) timed within {p95_ms:g} ms"))
    if not timed:
        why = next((p.error for p in curve if p.error), "nothing timed")
        return ServingChoice(candidate_id=candidate_id, p95_ms=p95_ms, curve=curve, sequences=None, met=False,
                             note=f"--serving-p95-ms {p95_ms:g}: no sequence count could be timed ({why})")
    low = min(timed, key=lambda p: (p.p95_token_ms or 0.0, -(p.aggregate_tps or 0.0)))
    need = math.ceil(low.p95_token_ms or 0.0)
    return ServingChoice(candidate_id=candidate_id, p95_ms=p95_ms, curve=curve, sequences=low.sequences, met=False,
                         note=(f"no sequence count met --serving-p95-ms {p95_ms:g}: the best p95 per-token latency "
                               f"reached was {low.p95_token_ms or 0:.1f} ms ({low.sequences} sequence(s), "
                               f"{low.aggregate_tps or 0:.1f} tok/s); --serving-p95-ms {need} would meet it; the plan "
                               f"serves {low.sequences} sequence(s)"))


def swept_candidate(finalists: Sequence[Candidate], summaries: Sequence[MeasureSummary]) -> Candidate | None:
    """The native finalist with the least measured workload time (the worker is what batches the streams)."""
    by_id = {c.id: c for c in finalists if c.engine == "native"}
    ranked = sorted((s for s in summaries if s.candidate_id in by_id and s.workload_s and not s.error),
                    key=lambda s: s.workload_s or 0.0)
    return by_id[ranked[0].candidate_id] if ranked else None


def serving_choice(finalists: Sequence[Candidate], summaries: Sequence[MeasureSummary], model: Path,
                   prompts: Sequence[list[int]], n_gen: int, *, most: int, p95_ms: float, timeout_s: float,
                   log_path: Path | None, budget_s: float = math.inf, seed: int = 0,
                   progress: Progress = log.info) -> ServingChoice | None:
    """The curve of the fastest native finalist and the count kept; None when no native finalist was measured."""
    cand = swept_candidate(finalists, summaries)
    if cand is None:
        return None
    t0 = time.perf_counter()
    curve = serving_curve(cand, model, prompts, n_gen, sequence_counts(most), budget_s=budget_s, seed=seed,
                          timeout_s=timeout_s, log_path=log_path)
    for p in curve:
        progress(f"serving curve {cand.id}: {p.sequences} at once: " + (f"error: {p.error}" if p.error else
                 f"{p.aggregate_tps or 0:.1f} tok/s, p95 {p.p95_token_ms or 0:.1f} ms per token over {p.rounds} rounds"))
    choice = choose(cand.id, curve, p95_ms)
    progress(f"serving curve: {len(curve)} count(s) in {time.perf_counter() - t0:.1f} s; {choice.note}")
    return choice


def serving_notes(choice: ServingChoice | None, winner_id: str) -> list[str]:
    """The plan's notes on its serving curve: the choice, and the placement it was timed on when validation kept
    another."""
    if choice is None:
        return []
    other = ([f"the serving curve was timed on {choice.candidate_id}, the fastest native finalist; validation kept "
              f"{winner_id}, which serves the same count untimed"] if choice.candidate_id != winner_id else [])
    return [choice.note, *other]
