"""Persist: the immutable plan (JSON) and its trials (Parquet), keyed like FFTW's wisdom.

A plan's key is everything that makes its measurements valid: the model's file hashes, the hardware
fingerprint, the backend build id, the driver, the planning flags and the settings that shape the
search. ``flux plan`` reuses a plan whose key matches unless ``--replan``; ``flux serve`` refuses one
whose key does not match this machine.
"""

from __future__ import annotations

import datetime as dt
import logging
import statistics
from typing import Any

import pyarrow as pa

from artifacts.engine_spec import EngineSpec
from artifacts.ids import content_id
from artifacts.records.evidence import MeasureResults, MeasureSummary, ValidationReport
from artifacts.records.hardware import HardwareReport
from artifacts.records.kinds import PLAN, TRIALS_TABLE
from artifacts.records.plan import DraftTrial, Plan, PlanRequest, StorageStreaming, seal
from artifacts.records.routing import RoutingProfile
from artifacts.records.search import Candidate, Finalists, PlacementSpace
from artifacts.records.store import Records
from artifacts.store import Store
from tasks.measurement.concurrency import serving_notes
from tasks.probing.machine import load_words, taken_under_load
from tasks.workload import split_shift

log = logging.getLogger(__name__)
# A first round this many times faster than the cost model's time for it means the probe it priced with was slow:
# on a machine as quiet as when probed, visits ran within 2x of their prediction (run 9: up to 1.9x slower); issue
# 56's probe, taken at a load average of ~9, predicted 1.4 tok/s where 10.3 were measured (7x).
PROBE_DISAGREES = 3.0


def find_plan(records: Records, key: dict[str, Any]) -> Plan | None:
    """The newest stored plan with exactly this key (:func:`artifacts.records.keys.plan_key`), if any."""
    kid = content_id(key)
    rows = [r for r in records.rows(PLAN) if (r.get("meta") or {}).get("key_id") == kid]
    return records.get(PLAN, rows[-1]["id"]) if rows else None


def prediction_error(finalists: Finalists, summaries: list[MeasureSummary], lengths: list[int],
                     n_gen: int) -> float | None:
    """Median relative error of the cost model's time for the measured round (``lengths`` prompts, ``n_gen``
    tokens generated after each) over the measured finalists. Not prune's score: that prices the whole mix,
    while measuring may time a part of it (run 8 compared 16.6 s for the mix with 0.96 s for one 64-token
    prompt and printed 1634%)."""
    if not lengths:
        return None
    pred = {p.candidate_id: sum(lengths) / max(p.prefill_tps, 1e-9) + len(lengths) * n_gen / max(p.decode_tps, 1e-9)
            for p in finalists.predictions}
    errs = [abs(pred[s.candidate_id] - s.workload_s) / s.workload_s for s in summaries
            if s.workload_s and s.candidate_id in pred]
    return statistics.median(errs) if errs else None


def first_round_speedup(finalists: Finalists, trials: pa.Table) -> float | None:
    """Median over the finalists timed in the first round of the cost model's time for that visit's prompts and
    generated tokens over the measured time (above 1: faster than predicted); None when none was timed. A finalist
    on another engine (``c028@llama-server``) is priced as its placement."""
    preds = {p.candidate_id: p for p in finalists.predictions}
    pred_s: dict[str, float] = {}
    meas_s: dict[str, float] = {}
    for r in trials.to_pylist():
        p = preds.get(r["candidate_id"]) or preds.get(str(r["candidate_id"]).split("@")[0])
        if r.get("round") != 0 or r.get("error") or p is None or not r.get("prompt_ms") or not r.get("gen_ms"):
            continue
        cid = r["candidate_id"]
        pred_s[cid] = pred_s.get(cid, 0.0) + (r["prompt_tokens"] / max(p.prefill_tps, 1e-9)
                                              + r["gen_tokens"] / max(p.decode_tps, 1e-9))
        meas_s[cid] = meas_s.get(cid, 0.0) + (r["prompt_ms"] + r["gen_ms"]) / 1e3
    ratios = [pred_s[c] / meas_s[c] for c in pred_s if meas_s[c] > 0]
    return statistics.median(ratios) if ratios else None


def load_notes(hw: HardwareReport, finalists: Finalists, trials: pa.Table) -> list[str]:
    """What a plan should say when it was made from a probe of a busy machine: the probe recorded the load
    (:func:`tasks.probing.machine.taken_under_load`), or the first round ran PROBE_DISAGREES times faster than the probe's
    speeds predicted."""
    notes = []
    if taken_under_load(hw):
        notes.append(f"made on a busy machine: {load_words(hw, 'while it was probed')}, so "
                     "the probe's speeds, the cost model's predictions and the budget's sizing are a busy machine's; "
                     "`flux plan --replan --reprobe` on a quiet machine measures both again")
    speedup = first_round_speedup(finalists, trials)
    if speedup is not None and speedup > PROBE_DISAGREES:
        notes.append(f"the first round ran {speedup:.1f}x faster than the cost model predicted from the probe: the "
                     f"probe was likely taken while the machine was busy ({load_words(hw)}); `flux plan --reprobe` "
                     "measures the machine again")
    return notes


def decode_by_depth(trials: pa.Table, candidate_id: str) -> list[tuple[int, float]]:
    """A candidate's median measured decode speed after each prompt length (the KV cache's depth)."""
    by: dict[int, list[float]] = {}
    for r in trials.to_pylist():
        if r["candidate_id"] == candidate_id and not r.get("error") and r.get("decode_tps"):
            by.setdefault(int(r["prompt_tokens"]), []).append(float(r["decode_tps"]))
    return [(n, statistics.median(v)) for n, v in sorted(by.items())]


def plan_notes(space: PlacementSpace, finalists: Finalists, measured: MeasureResults,
               validation: ValidationReport, prefer_engine: str | None = None) -> list[str]:
    """What a reader of the plan should know about its choice: the context it holds and why, a winner that
    is slower on a displayed speed than another finalist (and why: validation, ``--prefer-engine``, drafting
    that was not surely faster, or the whole workload's time), a measurement the budget cut short."""
    by_id = {c.id: c for c in finalists.finalists}
    sums = {s.candidate_id: s for s in measured.summaries}
    win, win_s = by_id[validation.winner_id], sums[validation.winner_id]
    notes: list[str] = []
    if win.params.n_ctx < space.n_ctx:
        full = [s for s in measured.summaries if s.workload_s and by_id[s.candidate_id].params.n_ctx == space.n_ctx]
        best = min(full, key=lambda s: s.workload_s or 0.0, default=None)
        why = (f"the fastest finalist holding {space.n_ctx} ({best.candidate_id}) took {best.workload_s:.2f} s, "
               f"{(best.workload_s or 0) / (win_s.workload_s or 1) - 1:.0%} longer than {win_s.workload_s:.2f} s"
               if best and best.workload_s else f"no finalist holding {space.n_ctx} tokens was measured")
        notes.append(f"holds {win.params.n_ctx} tokens per sequence, not {space.n_ctx}: {why}; "
                     f"`flux plan --ctx {space.n_ctx}` plans for the whole context")
    if space.ctx_capped_by_ram:
        notes.append(f"context capped at {space.n_ctx} tokens by the RAM its KV cache may use")
    for s in measured.summaries:
        if s.candidate_id == win.id or not (s.prefill_tps and s.decode_tps and win_s.prefill_tps and win_s.decode_tps):
            continue
        if s.prefill_tps > win_s.prefill_tps and s.decode_tps > win_s.decode_tps:
            checked = next((r for r in validation.results if r.candidate_id == s.candidate_id), None)
            other = by_id[s.candidate_id]
            faster = (s.workload_s or 0) < (win_s.workload_s or 0)
            why = ("it failed validation: " + checked.reason) if checked and not checked.passed else (
                f"--prefer-engine {prefer_engine} serves the plan on {prefer_engine}"
                if prefer_engine and win.engine == prefer_engine and other.engine != prefer_engine else
                "its drafting was not surely faster than its placement (the speedup's 95% interval reaches 1)"
                if other.draft is not None and faster else
                f"its workload took {s.workload_s or 0:.2f} s vs {win_s.workload_s or 0:.2f} s (speeds are medians "
                "over rounds; the ranking is the whole round's time)")
            notes.append(f"{s.candidate_id} prefilled and decoded faster ({s.prefill_tps:.1f} / {s.decode_tps:.1f} "
                         f"tok/s vs {win_s.prefill_tps:.1f} / {win_s.decode_tps:.1f}) but was not chosen: {why}")
    if prefer_engine and win.engine != prefer_engine:
        notes.append(preferred_engine_note(prefer_engine, win.engine, finalists, sums, validation))
    notes += expert_split_notes(by_id, sums, win.id)
    if win_s.n_rounds < 2:
        notes.append(f"measured in {win_s.n_rounds} round(s) only: no spread (the budget of {measured.budget_s:g} s "
                     "ran out); a larger --budget-s gives more")
    return notes


def preferred_engine_note(engine: str, chosen: str, finalists: Finalists, sums: dict[str, MeasureSummary],
                          validation: ValidationReport) -> str:
    """Why the plan does not run on the ``--prefer-engine`` asked for: what became of each finalist on it."""
    checked = {r.candidate_id: r for r in validation.results}
    fates = []
    for c in finalists.finalists:
        if c.engine != engine:
            continue
        s, r = sums.get(c.id), checked.get(c.id)
        fate = (s.error if s and s.error else f"failed validation: {r.reason}" if r and not r.passed else
                "measured, not validated" if s and s.workload_s else "not measured")
        fates.append(f"{c.id}: {fate}")
    return (f"--prefer-engine {engine}: no finalist on {engine} was measured and passed the quality gate "
            f"({'; '.join(fates) or 'none was made'}), so the plan runs on {chosen}")


def expert_split_notes(by_id: dict[str, Candidate], sums: dict[str, MeasureSummary], win_id: str) -> list[str]:
    """Per-expert placement against whole expert tensors, as this run measured them: the best finalist of
    each kind (by workload time), when both were measured."""
    def best(hot: bool) -> MeasureSummary | None:
        got = [s for i, s in sums.items() if s.workload_s and s.decode_tps and (by_id[i].family == "experts-hot") == hot
               and by_id[i].placement.gpu_layers() > 0]
        return min(got, key=lambda s: s.workload_s or 0.0, default=None)
    hot, whole = best(True), best(False)
    if hot is None or whole is None or win_id not in (hot.candidate_id, whole.candidate_id):
        return []
    return [f"per-expert placement ({hot.candidate_id}): decode {hot.decode_tps:.1f} tok/s, workload "
            f"{hot.workload_s:.2f} s; the best whole-tensor finalist ({whole.candidate_id}, {by_id[whole.candidate_id].family}): "
            f"{whole.decode_tps:.1f} tok/s, {whole.workload_s:.2f} s; "
            f"{'per-expert' if win_id == hot.candidate_id else 'whole-tensor'} won"]


def persist(store: Store, *, key: dict[str, Any], model_path: str, model_name: str, hw: HardwareReport,
            req: PlanRequest, finalists: Finalists, measured: MeasureResults, trials: pa.Table,
            validation: ValidationReport, roofline_decode_tps: float | None, memory_limits: dict[str, int],
            prefill_share: float, notes: list[str], routing: RoutingProfile | None = None,
            all_gpu_decode: tuple[str, float] | None = None, stage_seconds: dict[str, float] | None = None,
            engine: EngineSpec | None = None, speculation: list[DraftTrial] | None = None,
            storage_streaming: StorageStreaming | None = None) -> Plan:
    """Write the plan and its trials; returns the plan (its id is a content hash of the whole plan)."""
    by_id = {c.id: c for c in finalists.finalists}
    summaries = measured.summaries
    win = validation.winner_id
    created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    kid = content_id(key)
    trials_id = content_id({"key": kid, "created": created, "rows": trials.num_rows})
    store.put_table(TRIALS_TABLE, trials.append_column("plan_key", pa.array([kid] * trials.num_rows, pa.string())),
                    key=trials_id)
    shift = split_shift(routing.array(), routing.measured_array(), by_id[win].params.expert_split) if routing else None
    body: dict[str, Any] = {
        "key": key, "created_at": created, "model_path": model_path, "model_name": model_name,
        "model_hash": key["model_hash"], "hardware_fingerprint": hw.fingerprint,
        "backend_build": key["backend_build"], "driver": hw.driver, "request": req.model_dump(),
        "candidate": by_id[win].model_dump(),
        "measured": next(s for s in summaries if s.candidate_id == win).model_dump(),
        "predicted": next(p for p in finalists.predictions if p.candidate_id == win).model_dump(),
        "validation": next(r for r in validation.results if r.candidate_id == win).model_dump(),
        "finalists": [s.model_dump() for s in summaries], "families": {c.id: c.family for c in finalists.finalists},
        "predictions": [p.model_dump() for p in finalists.predictions],
        "median_prediction_error": prediction_error(finalists, summaries, measured.lengths, measured.n_gen),
        "roofline_decode_tps": roofline_decode_tps,
        "storage_streaming": storage_streaming.model_dump() if storage_streaming else None,
        "stage_seconds": stage_seconds or {},
        "all_gpu_decode": {"device": all_gpu_decode[0], "decode_tps": all_gpu_decode[1]} if all_gpu_decode else None,
        "memory_budget": memory_limits, "trials_table": trials_id,
        "quality_profile": validation.quality_profile, "workload_prefill_share": prefill_share,
        "workload_lengths": measured.lengths, "workload_n_gen": measured.n_gen,
        "decode_by_depth": decode_by_depth(trials, win), "notes": [*notes, *serving_notes(measured.serving, win)],
        "serving": measured.serving.model_dump() if measured.serving else None,
        "kl_limit": validation.kl_limit, "top1_limit": validation.top1_limit, "routing_trace": routing.trace_id if routing else None,
        "routing_coverage": {f"{f:.0%}": routing.coverage(f) for f in (0.1, 0.25, 0.5)} if routing else {},
        "routing_repeat": routing.repeat if routing else None,
        "routing_shift": shift.model_dump() if shift else {},
        "engine": engine.model_dump(mode="json") if engine is not None else None,
        "speculation": [t.model_dump(mode="json") for t in speculation or []],
    }
    plan = seal(body)
    Records(store).put(PLAN, plan, key=plan.id, meta={"key_id": kid, "model": model_name, "created_at": created})
    log.info("persist: plan %s (%s)", plan.id[:12], model_name)
    return plan
