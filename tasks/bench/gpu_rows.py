"""The GPU record's rows (``flux bench record``): what a pair's row says, from the plan ``flux plan`` persisted and
the summary rows ``flux bench run --via serve`` stored.

One row per pair (:func:`record_row`): ratios (``tg_vs_fit``, ``pp_vs_fit``, ``agent_vs_fit``, ... against each
baseline of :data:`BASELINE_KEYS`), the plan's own measured decode against its decode through HTTP, GPU memory of
every contender, planning time, ``plan_id`` and ``ctx``, the ``card`` and ``date``, and the ``race`` (how the
contenders were held, :mod:`tasks.bench.standing`); a ratio against a flagged contender is moved aside
(:func:`mask_invalid`). One row per depth of a depth race (:func:`depth_rows`). Beside the rows, each plan's
finalists with their predicted and measured GPU memory (:func:`memory_record`), what the memory and cost models'
tests check against.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from artifacts.model_info import model_info
from artifacts.records.kinds import FINALISTS, PLAN, PROBE
from artifacts.records.plan import Plan
from artifacts.records.store import Records
from tasks.bench.host_state import host_columns
from tasks.bench.spec_facts import speculation_facts
from tasks.bench.standing import gpu_card, race_of_metrics
from tasks.bench.step_facts import step_facts, step_times

GIB = 2**30
# a race's baseline -> its key in the record's column names (tg_vs_fit, ncmoe_valid, ngl_gpu_gib, ...)
BASELINE_KEYS = {"fit": "fit", "n-cpu-moe": "ncmoe", "most-ngl": "ngl"}


def _gib(n: float | None) -> float | None:
    """Bytes as GiB; None for none (or zero)."""
    return (n or 0) / GIB or None


def plan_facts(records: Records, plan_id: str) -> dict[str, Any]:
    """What the persisted plan says of itself."""
    plan = records.find_by_prefix(PLAN, plan_id)
    c, m = plan.candidate, plan.measured
    hw = next((h for h in reversed(records.all(PROBE)) if h.fingerprint == plan.hardware_fingerprint), None)
    return {"card": gpu_card([g.name for g in hw.gpus]) if hw else None, **whole_tensor_facts(plan), **step_facts(c),
            **speculation_facts(plan), "plan_family": c.family, "workload": plan.request.workload,
            "plan_flags": " ".join(c.params.cli_args()), "ctx": c.params.n_ctx,
            "plan_prefill_tps": m.prefill_tps, "plan_decode_tps": m.decode_tps, "plan_workload_s": m.workload_s,
            "plan_workload_iqr": m.workload_iqr, "plan_rounds": m.n_rounds,
            "plan_kv_gpu_gib": sum(b for d, b in c.kv_bytes.items() if d != "CPU") / GIB,
            "plan_notes": json.dumps(plan.notes), "plan_kl": plan.validation.mean_kl,
            "plan_kl_limit": plan.kl_limit, "plan_top1": plan.validation.top1_agreement,
            "plan_stage_seconds": json.dumps(plan.stage_seconds), "plan_total_s": plan.stage_seconds.get("total"),
            "plan_roofline_tps": plan.roofline_decode_tps,
            "all_gpu_decode_tps": float(plan.all_gpu_decode["decode_tps"]) if plan.all_gpu_decode else None,
            "finalists_gpu": json.dumps([{"id": f.candidate_id, "family": plan.families.get(f.candidate_id),
                                          "predicted": f.predicted_gpu_bytes, "measured": f.gpu_bytes,
                                          "method": f.gpu_method, "rounds": f.n_rounds, "error": f.error}
                                         for f in plan.finalists]),
            "finalists_rejected_for_memory": sum(1 for f in plan.finalists if (f.error or "").startswith("over the GPU"))}


def memory_record(records: Records, plan_id: str, path: Path) -> None:
    """The plan's finalists (candidates with their predicted and measured GPU memory and their measured speeds),
    its probe report and its model's header, as JSON: what tests/tasks/test_gpu_memory.py checks the memory
    model against, and the cost model's tests its predictions."""
    plan = records.find_by_prefix(PLAN, plan_id)
    fin = next((f for f in reversed(records.all(FINALISTS)) if plan.candidate in f.finalists), None)
    hw = next((h for h in reversed(records.all(PROBE)) if h.fingerprint == plan.hardware_fingerprint
               and h.model_hash == plan.model_hash), None)
    measured = {s.candidate_id: s for s in plan.finalists}
    path.write_text(json.dumps({
        "plan_id": plan.id, "hardware": hw.model_dump(mode="json") if hw else None,
        "model": model_info(Path(plan.model_path)).model_dump(mode="json"),
        "finalists": [{"candidate": c.model_dump(mode="json"), "predicted": measured[c.id].predicted_gpu_bytes,
                       "measured": measured[c.id].gpu_bytes, "method": measured[c.id].gpu_method,
                       # the speeds too, for the cost model's tests (tests/tasks/test_costmodel_attention.py)
                       "prefill_tps": measured[c.id].prefill_tps, "decode_tps": measured[c.id].decode_tps,
                       "rounds": measured[c.id].n_rounds, "prompt_tokens": plan.workload_lengths,
                       "n_gen": plan.workload_n_gen}
                      for c in (fin.finalists if fin else []) if c.id in measured]}))


def per_expert(family: str) -> bool:
    """A per-expert split's family (experts-hot, experts-mapped, with or without an ``@ctx`` suffix)."""
    return family.startswith("experts-")


def whole_tensor_facts(plan: Plan) -> dict[str, Any]:
    """The plan against the best whole-tensor finalist its own measurement raced (per-expert plans only): the
    same `flux plan` run timed both in its paired rounds. (Before run 16 only a family spelled exactly
    ``experts-hot`` counted, so no mapped plan, nor one with an ``@ctx`` suffix, had this comparison.)"""
    whole = [s for s in plan.finalists if not per_expert(plan.families.get(s.candidate_id, "experts-hot"))
             and s.decode_tps and s.workload_s]
    best = min(whole, key=lambda s: s.workload_s or 0.0, default=None)
    if best is None or not best.decode_tps or not per_expert(plan.candidate.family):
        return {}
    m = plan.measured
    return {"whole_id": best.candidate_id, "whole_family": plan.families[best.candidate_id],
            "whole_decode_tps": best.decode_tps, "whole_prefill_tps": best.prefill_tps,
            "tg_vs_whole": (m.decode_tps or 0) / best.decode_tps,
            "workload_vs_whole": (best.workload_s or 0.0) / m.workload_s if m.workload_s else None}


def _baseline_columns(key: str, r: dict[str, Any], m: dict[str, Any]) -> dict[str, Any]:
    """One baseline's columns of a pair's row, from its summary row and that row's metrics."""
    turns: dict[str, Any] = m.get("per_turn") or {}
    unreported = m.get("unreported") or {}
    first: dict[str, Any] = turns.get("agent") or next(iter(turns.values()), {})
    agent = first.get("turn_speedup")
    return {f"tg_vs_{key}": r["ratio_decode"], f"pp_vs_{key}": r["ratio_prefill"],
            f"{key}_valid": m.get("baseline_valid"), f"{key}_flag": m.get("baseline_flag"),
            f"{key}_gpu_method": m.get("baseline_gpu_method"),
            f"{key}_tg_unreported": (unreported.get("decode") or {}).get("ratio"),
            f"{key}_gpu_gib": _gib(m.get("baseline_gpu_bytes")),
            f"{key}_note": m.get("engine_note"), f"{key}_sweep_vs_race": m.get("sweep_vs_race"),
            f"agent_vs_{key}": agent["ratio"] if agent else None}


def _plan_columns(m: dict[str, Any]) -> dict[str, Any]:
    """The served plan's columns of a pair's row, from a summary row's metrics (each row says the same)."""
    return {"served_decode_tps": m.get("served_decode_tps"), "plan_gpu_gib": _gib(m.get("plan_gpu_bytes")),
            "plan_gpu_method": m.get("plan_gpu_method"), "plan_gpu_vs_measured": m.get("plan_gpu_vs_measured"),
            "plan_flag": m.get("plan_flag"), "baseline_threads": m.get("baseline_threads"),
            "baseline_threads_note": m.get("baseline_threads_note"), **host_columns(m.get("host"))}


def _metrics(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [json.loads(r["metrics"] or "{}") for r in rows]


def record_row(records: Records, run: str, preset: str, routing: str, budget: float, plan_id: str, plan_s: float,
               rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One record row from the plan and the race's summary rows (``bench_summary``, suite ``run``)."""
    out: dict[str, Any] = {"run": run, "model": preset, "routing": routing, "budget_gib": budget, "plan_id": plan_id,
                           "plan_s": plan_s, **plan_facts(records, plan_id)}
    for r, m in zip(rows, _metrics(rows), strict=True):
        key = BASELINE_KEYS.get(r["baseline"])
        if key is not None:
            out.update({**_baseline_columns(key, r, m), **_plan_columns(m)})
    if rows:  # how the race held its contenders (tasks/bench/standing.py): co-resident unless its metrics say
        out["race"] = race_of_metrics(_metrics(rows))
    out.update({"date": time.strftime("%Y-%m-%d", time.gmtime()), "superseded_by": None})
    if out.get("served_decode_tps") and out.get("plan_decode_tps"):
        out["http_vs_plan_decode"] = out["served_decode_tps"] / out["plan_decode_tps"]
    out.update(step_times(out.get("served_decode_tps"), out.get("all_gpu_decode_tps")))
    return mask_invalid(out)


def _depth_contender(r: dict[str, Any], m: dict[str, Any]) -> dict[str, Any]:
    """A depth row's columns of one contender at that depth (the plan, or a baseline of :data:`BASELINE_KEYS`)."""
    who = m.get("contender", "plan")
    if who == "plan":
        return {**{f"plan_{k}": m.get(k) for k in ("decode_tps", "prefill_tps", "bound_decode_tps",
                                                   "predicted_decode_tps", "of_bound")},
                "plan_verdict": r["verdict"], "plan_gpu_gib": _gib(m.get("plan_gpu_bytes"))}
    key = BASELINE_KEYS.get(who)
    if key is None:
        return {}
    return {f"{key}_decode_tps": m.get("decode_tps"), f"{key}_prefill_tps": m.get("prefill_tps"),
            f"{key}_server_decode_tps": m.get("server_decode_tps"), f"tg_vs_{key}": r["ratio_decode"],
            f"pp_vs_{key}": r["ratio_prefill"], f"{key}_not_held": m.get("not_held"),
            f"{key}_valid": r["verdict"] == "info" and not m.get("baseline_flag") and not m.get("not_held"),
            f"{key}_gpu_gib": _gib(m.get("baseline_gpu_bytes"))}


def depth_rows(run: str, tag: str, plan_id: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record row per depth from a depth race's summary rows (``flux bench run --via serve --depths``: a row
    per contender and depth, tasks/bench/served_depths.py): the plan's prefill and decode there beside the bytes
    bound of its decode and the cost model's prediction, each baseline's readings and the plan/baseline ratios
    (no ratio where the row is no result), the depths not held by a baseline's own context and those the plan's
    context does not hold (``skipped``)."""
    by: dict[int, dict[str, Any]] = {}
    for r, m in zip(rows, _metrics(rows), strict=True):
        depth = m.get("depth")
        if depth is None:
            continue
        out = by.setdefault(depth, {"run": run, "pair": tag, "plan_id": plan_id, "ctx": m.get("ctx"),
                                    "depth_tokens": depth, "gen_tokens": m.get("gen_tokens"), "skipped": False,
                                    "race": m.get("race")})
        if m.get("skipped"):
            out["skipped"] = True
        else:
            out.update(_depth_contender(r, m))
    return [by[d] for d in sorted(by)]


def mask_invalid(row: dict[str, Any]) -> dict[str, Any]:
    """No ratio against a flagged baseline (or of a flagged plan) stands as a result: each moves to
    ``<key>_<ratio>_unreported`` and its result column is emptied."""
    out = dict(row)
    for key in BASELINE_KEYS.values():
        if out.get(f"{key}_valid") is False:
            for ratio in ("tg", "pp", "agent"):
                col = f"{ratio}_vs_{key}"
                if out.get(col) is not None:
                    out[f"{key}_{ratio}_unreported"] = out[col]
                out[col] = None
    return out
