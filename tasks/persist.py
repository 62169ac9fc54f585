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

from artifacts.ids import content_id
from artifacts.store import Store
from tasks.models import (
    Finalists,
    HardwareReport,
    MeasureSummary,
    Plan,
    PlanRequest,
    ValidationReport,
)

log = logging.getLogger(__name__)
PLAN_KIND = "plan"
TRIALS_KIND = "trials"


def plan_key(model_hash: str, hw: HardwareReport, backend_build: str, req: PlanRequest,
             settings_view: dict[str, Any]) -> dict[str, Any]:
    """The facts a plan is valid for (its identity minus the time it was made)."""
    flags = req.model_dump(exclude={"model"})
    if flags["workload"] == "agent":  # the default before there was a choice: plans saved then still match
        del flags["workload"]
    return {"model_hash": model_hash, "hardware": hw.fingerprint, "backend_build": backend_build,
            "driver": hw.driver, "flags": flags, "settings": settings_view}


def find_plan(store: Store, key: dict[str, Any]) -> dict[str, Any] | None:
    """The newest stored plan with exactly this key, if any."""
    kid = content_id(key)
    rows = [r for r in store.list(PLAN_KIND) if (r.get("meta") or {}).get("key_id") == kid]
    return store.get_json(PLAN_KIND, rows[-1]["id"]) if rows else None


def prediction_error(finalists: Finalists, summaries: list[MeasureSummary]) -> float | None:
    """Median relative error of the cost model's workload time over the measured finalists."""
    pred = {p.candidate_id: p.score_s for p in finalists.predictions}
    errs = [abs(pred[s.candidate_id] - s.workload_s) / s.workload_s for s in summaries
            if s.workload_s and s.candidate_id in pred]
    return statistics.median(errs) if errs else None


def persist(store: Store, *, key: dict[str, Any], model_path: str, model_name: str, hw: HardwareReport,
            req: PlanRequest, finalists: Finalists, summaries: list[MeasureSummary], trials: pa.Table,
            validation: ValidationReport, roofline_decode_tps: float | None, memory_limits: dict[str, int],
            prefill_share: float) -> Plan:
    """Write the plan and its trials; returns the plan (its id is a content hash of the whole plan)."""
    by_id = {c.id: c for c in finalists.finalists}
    win = validation.winner_id
    created = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    kid = content_id(key)
    trials_id = content_id({"key": kid, "created": created, "rows": trials.num_rows})
    store.put_table(TRIALS_KIND, trials.append_column("plan_key", pa.array([kid] * trials.num_rows, pa.string())),
                    key=trials_id)
    body: dict[str, Any] = {
        "key": key, "created_at": created, "model_path": model_path, "model_name": model_name,
        "model_hash": key["model_hash"], "hardware_fingerprint": hw.fingerprint,
        "backend_build": key["backend_build"], "driver": hw.driver, "request": req.model_dump(),
        "candidate": by_id[win].model_dump(),
        "measured": next(s for s in summaries if s.candidate_id == win).model_dump(),
        "predicted": next(p for p in finalists.predictions if p.candidate_id == win).model_dump(),
        "validation": next(r for r in validation.results if r.candidate_id == win).model_dump(),
        "finalists": [s.model_dump() for s in summaries], "predictions": [p.model_dump() for p in finalists.predictions],
        "median_prediction_error": prediction_error(finalists, summaries),
        "roofline_decode_tps": roofline_decode_tps, "memory_budget": memory_limits, "trials_table": trials_id,
        "quality_profile": validation.quality_profile, "workload_prefill_share": prefill_share,
    }
    plan = Plan(id=content_id(body), **body)
    store.put_json(PLAN_KIND, plan, key=plan.id, meta={"key_id": kid, "model": model_name, "created_at": created})
    log.info("persist: plan %s (%s)", plan.id[:12], model_name)
    return plan
