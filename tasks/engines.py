"""Engines in the search: each finalist's placement on each engine (``--engines``), and one visit of a
placement on an engine other than the worker, timed and scored like a worker's visit (:mod:`tasks.measurement.rounds`).

A finalist ``c3`` on llama-server is the candidate ``c3@llama-server``: the same placement, parameters and
predictions, with ``engine`` naming where it runs. The rounds, the budget and the quality gate treat it as
any finalist; the plan records the winner's engine.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from artifacts.engine_spec import NATIVE, EngineSpec
from artifacts.records.evidence import MeasureSummary
from artifacts.records.search import Candidate, Finalists
from engine_bridge.engines.process import EngineProcess, peak_rss
from engine_bridge.engines.stream import body, client, completion, score
from engine_bridge.errors import EngineError

log = logging.getLogger(__name__)
SCORE_TOP_LOGPROBS = 512  # alternatives asked per scored token: the rest of the mass is spread evenly
HELD_OUT_GEN = 16  # tokens decoded after each held-out prompt (as the worker's visit)


def on_engines(fin: Finalists, engines: Sequence[EngineSpec]) -> Finalists:
    """``fin`` with every finalist also on each engine other than the worker (ids ``<id>@<engine>``); the
    worker's own finalists only when ``native`` is among the engines."""
    others = [e for e in engines if not e.native]
    if not others:
        return fin
    keep_native = any(e.native for e in engines)
    cands = [c for c in fin.finalists if keep_native]
    preds = [p for p in fin.predictions if keep_native]
    by_id = {p.candidate_id: p for p in fin.predictions}
    for e in others:
        for c in fin.finalists:
            cid = f"{c.id}@{e.name}"
            cands.append(c.model_copy(update={"id": cid, "engine": e.name}))
            if c.id in by_id:
                preds.append(by_id[c.id].model_copy(update={"candidate_id": cid}))
    return fin.model_copy(update={"finalists": cands, "predictions": preds})


def prefer(ranked: list[MeasureSummary], fin: Finalists, engine: str | None) -> list[MeasureSummary]:
    """``ranked`` with the finalists on ``engine`` first (each group in its measured order): ``--prefer-engine``."""
    if engine is None:
        return ranked
    on = {c.id for c in fin.finalists if c.engine == engine}
    return [s for s in ranked if s.candidate_id in on] + [s for s in ranked if s.candidate_id not in on]


def spec_of(engines: Sequence[EngineSpec], name: str) -> EngineSpec:
    """The engine named ``name``."""
    return next(e for e in engines if e.name == name)


def _held_out(client: httpx.Client, base: str, held_out: list[list[int]]) -> np.ndarray:
    pre_t = pre_ms = dec_t = dec_ms = 0.0
    for p in held_out:
        t = completion(client, base, body(p, HELD_OUT_GEN)).timing(len(p))
        pre_t, pre_ms, dec_t, dec_ms = pre_t + t.prompt_tokens, pre_ms + t.prompt_ms, dec_t + t.gen_tokens, dec_ms + t.gen_ms
    return np.asarray([pre_t / pre_ms * 1e3 if pre_ms else np.nan, dec_t / dec_ms * 1e3 if dec_ms else np.nan])


def _scores(client: httpx.Client, base: str, cand: Candidate, seqs: list[tuple[list[int], list[int]]],
            held_out: list[list[int]], n_vocab: int, path: Path) -> None:
    """The engine's rows of the reference's continuations and its held-out speeds, in the file validation reads
    (:func:`tasks.validation.gate.scored_path`)."""
    arrays: dict[str, np.ndarray] = {f"lp{i}": score(client, base, p, c, n_vocab, min(n_vocab, SCORE_TOP_LOGPROBS))
                                     for i, (p, c) in enumerate(seqs)}
    arrays["held_out"] = _held_out(client, base, held_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{cand.id}.{os.getpid()}.partial.npz")
    np.savez(part, **arrays)  # type: ignore[arg-type]
    os.replace(part, path)


def engine_visit(cand: Candidate, spec: EngineSpec, model: Path, prompts: list[list[int]], n_gen: int, rnd: int,
                 timeout_s: float, log_path: Path, scoring: tuple[list[tuple[list[int], list[int]]],
                                                                  list[list[int]], int, Path] | None) -> list[dict[str, Any]]:
    """Start the engine with the finalist's placement, warm it up, time every prompt; with ``scoring``
    (seqs, held-out prompts, vocabulary size, file), score the reference's continuations after the timed
    prompts. Errors become one row, as a worker's visit's."""
    rows: list[dict[str, Any]] = []
    proc = EngineProcess(spec, str(model), cand.params, log_path=log_path.with_name("engines.log"),
                         drafting=cand.draft)
    load_ms: float | None = None
    try:
        load_ms = proc.start() * 1e3
        with client(timeout_s) as http:
            completion(http, proc.base, body(prompts[0][:16], 2))  # the first run after a load is slow
            for i, prompt in enumerate(prompts):
                got = completion(http, proc.base, body(prompt, n_gen))
                t = got.timing(len(prompt))
                rows.append({"candidate_id": cand.id, "round": rnd, "prompt_index": i,
                             "prompt_tokens": t.prompt_tokens, "prompt_ms": t.prompt_ms, "gen_tokens": t.gen_tokens,
                             "gen_ms": t.gen_ms, "prefill_tps": t.prefill_tps if t.prompt_ms else None,
                             "decode_tps": t.decode_tps if t.gen_ms else None, "load_ms": load_ms,
                             "peak_rss_bytes": peak_rss(proc.pid), "error": None, **_drafted(cand, got.timings)})
            if scoring is not None:
                seqs, held_out, n_vocab, path = scoring
                _scores(http, proc.base, cand, seqs, held_out, n_vocab, path)
    except EngineError as exc:
        log.warning("measure: %s failed in round %d: %s", cand.id, rnd, exc)
        rows.append({"candidate_id": cand.id, "round": rnd, "prompt_index": -1, "load_ms": load_ms,
                     "error": f"{exc.code}: {exc.message}"})
    finally:
        proc.stop()
    return rows


def _drafted(cand: Candidate, timings: Mapping[str, float] | None) -> dict[str, int]:
    """A drafting candidate's proposed and kept tokens, as llama-server's timings count them (draft_n,
    draft_n_accepted); nothing for one that does not draft."""
    if cand.draft is None:
        return {}
    t = timings or {}
    return {"drafted": int(t.get("draft_n", 0)), "accepted": int(t.get("draft_n_accepted", 0))}


def engine_notes(summaries: Mapping[str, Any], engines: Sequence[EngineSpec], winner: Candidate) -> list[str]:
    """One note comparing the winner's placement on each engine, when more than one engine was measured."""
    if len(engines) < 2:
        return []
    base = winner.id.split("@")[0]
    parts = []
    for e in engines:
        s = summaries.get(base if e.name == NATIVE else f"{base}@{e.name}")
        if s is not None and s.workload_s:
            parts.append(f"{e.name} {s.workload_s:.3f} s (prefill {s.prefill_tps or 0:.1f}, decode "
                         f"{s.decode_tps or 0:.1f} tok/s)")
        elif s is not None:
            parts.append(f"{e.name}: {s.error}")
    return [f"engines on placement {base}: " + "; ".join(parts) + f"; {winner.engine} serves the plan"]
