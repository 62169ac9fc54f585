#!/usr/bin/env python3
"""GPU benchmark record, on the path a user runs: `flux plan` → the persisted plan → `flux serve` / `flux bench`.

For each ``MODEL[/ROUTING]:BUDGET[@CTX][~WORKLOAD][+spec|+draftK|+heads][%PLAN_S][#D1/D2/...]`` pair
(:mod:`tasks.bench.gpu_pairs`: GiB per GPU, 0 = the whole cards; CTX = ``--ctx``, else the model's trained context;
WORKLOAD = ``flux plan --workload``, agent unless given; ``+spec``: ``--speculation``, ``+draftK``: also
``--draft-model`` of a draft twin of the model's first K layers, ``+heads``: also ``--heads``, the twin's
next-token block grafted on llama-server; ``%PLAN_S``: this pair's ``--budget-s``; ``#D1/D2/...``: the
depths this pair's plan is raced at, below):

1. ``flux plan <twin> --gpu-mem-budget BUDGET [--ctx CTX] --budget-s S`` — the Prefect flow with its store,
   exactly as a user runs it; the plan id it prints is the plan raced below, and its wall time is
   ``plan_s``;
2. ``flux show <plan>`` saved next to the results;
3. ``flux bench run <plan> --via serve`` — the plan served by ``flux serve`` raced against llama-server
   ``--fit`` at the same budget holding the same context, the best ``--n-cpu-moe`` and the most ``-ngl``
   (tasks/bench/served.py), every contender timed through the same streaming HTTP client; its rows land in
   the store's ``bench_summary`` table;
4. one record row: ratios (``tg_vs_fit``, ``pp_vs_fit``, ``agent_vs_fit``, ... against each baseline), the
   plan's own measured decode against its decode through HTTP, GPU memory of every contender, planning
   time, ``plan_id`` and ``ctx``, the ``card`` and ``date``, and the ``race`` (how the contenders were held:
   ``co-resident`` unless the race's metrics say otherwise; ``superseded_by`` empty, tasks/bench/standing.py).

With ``--depths`` (or a pair's ``#D1/D2/...``), after every pair, each such pair's plan is raced once more at each
depth its context holds (``flux bench run --via serve --depths ...``, tasks/bench/served_depths.py): against
``--depth-baselines`` (``fit`` unless given), each contender alone, ``--depth-rounds`` rounds, ``--depth-gen``
tokens decoded after a prompt of each depth; one row per depth in ``h200_depths.parquet`` with the plan's
prefill and decode there beside the bytes bound of its decode, each baseline's readings and the ratios, and the
depths skipped or not held (``--import --record R`` appends them to ``R``'s sibling depths.parquet).

Nothing here plans, times or races on its own: it drives the ``flux`` commands and reads what they stored.

    python3 scripts/bench_gpu.py --out DIR --model-dir DIR --pairs qwen3-30b-a3b/skewed:8,qwen3-30b-a3b:12@8192 \\
        [--plan-budget-s 300] [--rounds 3] [--run NAME]
    python3 scripts/bench_gpu.py ... --depths 4096,32768,131072   # and every pair's plan at those depths
    python3 scripts/bench_gpu.py ... --pairs 'qwen3.6-35b-a3b/skewed:12#4096/65536/262144,llama3-8b:8'   # one pair's
    python3 scripts/bench_gpu.py --import --out DIR      # put DIR's record into the store (table bench_gpu)
    python3 scripts/bench_gpu.py --import --out DIR --record docs/benchmarks/h200/record.parquet   # and append
        # its rows to the docs' record (a row already there, same run and plan, is not added twice)
    python3 scripts/standing.py   # then the standing table of docs/benchmarks/gpu-record.md from that record
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tasks.bench.gpu_pairs import Pair, parse_depths, parse_pair, refused_budget  # noqa: E402
from tasks.bench.host_state import flag_record, host_columns, probe_readings  # noqa: E402
from tasks.bench.spec_facts import speculation_facts  # noqa: E402
from tasks.bench.standing import gpu_card, race_of_metrics  # noqa: E402
from tasks.bench.step_facts import step_facts, step_facts_from_show, step_times  # noqa: E402

GIB = 2**30
RESULTS = "h200_results.parquet"
DEPTHS = "h200_depths.parquet"
BASELINE_KEYS = {"fit": "fit", "n-cpu-moe": "ncmoe", "most-ngl": "ngl"}


def log(msg: str) -> None:
    print(f"[bench-gpu {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def flux(*args: str, out: Path, name: str, timeout_s: float = 3600) -> subprocess.CompletedProcess[str]:
    """Run one ``flux`` command as a user would; its output is kept in ``out/name.log``."""
    cmd = [sys.executable, "-m", "flows", *args]
    log("$ flux " + " ".join(args))
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    (out / f"{name}.log").write_text(f"$ flux {' '.join(args)}\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")
    return proc


def twin_path(model_dir: Path, preset: str, routing: str) -> Path:
    """Where the twin of ``preset`` with ``routing`` lives (scripts/gpu-e2e.sh writes the same names)."""
    return model_dir / (f"{preset}-Q4_0.gguf" if routing == "uniform" else f"{preset}-{routing}-Q4_0.gguf")


def twin(model_dir: Path, preset: str, routing: str, extra: list[str], out: Path) -> Path:
    """The twin file, written once by ``flux synth``."""
    path = twin_path(model_dir, preset, routing)
    if not path.exists():
        proc = flux("synth", "--like", preset, "--quant", "Q4_0", "--routing", routing, "-o", str(path), *extra,
                    out=out, name=f"synth-{preset}-{routing}")
        if proc.returncode != 0:
            raise SystemExit(f"flux synth failed: {proc.stderr[-500:]}")
    return path


def draft_twin(model: Path, layers: int, out: Path) -> Path:
    """A draft of ``model`` made of its first ``layers`` layers, written once by ``flux synth --draft-of`` (which
    also measures and logs how often the draft's greedy token is the model's)."""
    path = model.with_name(f"{model.name.removesuffix('-Q4_0.gguf')}-draft{layers}-Q4_0.gguf")
    if not path.exists():
        proc = flux("synth", "--draft-of", str(model), "--layers", str(layers), "-o", str(path),
                    out=out, name=f"synth-{path.stem}")
        if proc.returncode != 0:
            raise SystemExit(f"flux synth --draft-of failed: {proc.stderr[-500:]}")
    return path


def heads_twin(model: Path, preset: str, routing: str, extra: list[str], out: Path) -> Path:
    """The twin's next-token block alone (``flux synth --heads-of``), written once: from the same twin synthesized
    with its block (``--set n_mtp=1``, the trunk's bytes unchanged), which is deleted after (it is the size of the
    model, in /dev/shm)."""
    stem = model.name.removesuffix("-Q4_0.gguf")
    path = model.with_name(f"{stem}-heads-Q4_0.gguf")
    if path.exists():
        return path
    whole = model.with_name(f"{stem}-mtp-Q4_0.gguf")
    steps = (("synth", "--like", preset, "--quant", "Q4_0", "--routing", routing, "--set", "n_mtp=1", "-o",
              str(whole), *extra), ("synth", "--heads-of", str(whole), "-o", str(path)))
    try:
        for i, step in enumerate(steps):
            proc = flux(*step, out=out, name=f"synth-{stem}-{('mtp', 'heads')[i]}")
            if proc.returncode != 0:
                raise SystemExit(f"flux {' '.join(step[:2])} failed: {proc.stderr[-500:]}")
    finally:
        whole.unlink(missing_ok=True)
    return path


def summary_rows(plan_id: str, run_after: float) -> list[dict[str, Any]]:
    """The bench_summary rows `flux bench run` stored for this plan since ``run_after``."""
    from artifacts.config import load_settings
    from artifacts.store import Store

    store = Store(load_settings().data_dir)
    rows = store.query("SELECT * FROM bench_summary").to_pylist()
    mine = [r for r in rows if r["plan_id"] == plan_id and r["suite"] == "run"
            and r["created_at"].timestamp() >= run_after - 1]
    last = max((r["run_id"] for r in mine), key=lambda rid: max(r["created_at"] for r in mine if r["run_id"] == rid),
               default=None)
    return [r for r in mine if r["run_id"] == last]


def plan_facts(plan_id: str) -> dict[str, Any]:
    """What the persisted plan says of itself."""
    from artifacts.config import load_settings
    from artifacts.records.kinds import PLAN, PROBE
    from artifacts.records.store import Records

    records = Records.at(load_settings().data_dir)
    plan = records.find_by_prefix(PLAN, plan_id)
    c = plan.candidate
    hw = next((h for h in reversed(records.all(PROBE)) if h.fingerprint == plan.hardware_fingerprint), None)
    return {"card": gpu_card([g.name for g in hw.gpus]) if hw else None, **whole_tensor_facts(plan), **step_facts(c), **speculation_facts(plan), "plan_family": c.family, "workload": plan.request.workload, "plan_flags": " ".join(c.params.cli_args()), "ctx": c.params.n_ctx,
            "plan_prefill_tps": plan.measured.prefill_tps, "plan_decode_tps": plan.measured.decode_tps,
            "plan_workload_s": plan.measured.workload_s, "plan_workload_iqr": plan.measured.workload_iqr,
            "plan_rounds": plan.measured.n_rounds, "plan_kv_gpu_gib": sum(b for d, b in c.kv_bytes.items() if d != "CPU") / GIB,
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


def memory_record(plan_id: str, path: Path) -> None:
    """The plan's finalists (candidates with their predicted and measured GPU memory and their measured speeds),
    its probe report and its model's header, as JSON: what tests/tasks/test_gpu_memory.py checks the memory
    model against, and the cost model's tests its predictions."""
    from artifacts.config import load_settings
    from artifacts.model_info import model_info
    from artifacts.records.kinds import FINALISTS, PLAN, PROBE
    from artifacts.records.store import Records

    records = Records.at(load_settings().data_dir)
    plan = records.find_by_prefix(PLAN, plan_id)
    fin = next((f for f in reversed(records.all(FINALISTS)) if plan.candidate in f.finalists), None)
    probes = records.all(PROBE)
    hw = next((h for h in reversed(probes) if h.fingerprint == plan.hardware_fingerprint
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


def whole_tensor_facts(plan: Any) -> dict[str, Any]:
    """The plan against the best whole-tensor finalist its own measurement raced (per-expert plans only): the
    same `flux plan` run timed both in its paired rounds. (Before run 16 only a family spelled exactly
    ``experts-hot`` counted, so no mapped plan, nor one with an ``@ctx`` suffix, had this comparison.)"""
    whole = [s for s in plan.finalists if not per_expert(plan.families.get(s.candidate_id, "experts-hot"))
             and s.decode_tps and s.workload_s]
    best = min(whole, key=lambda s: s.workload_s, default=None)
    if best is None or not per_expert(plan.candidate.family):
        return {}
    m = plan.measured
    return {"whole_id": best.candidate_id, "whole_family": plan.families[best.candidate_id],
            "whole_decode_tps": best.decode_tps, "whole_prefill_tps": best.prefill_tps,
            "tg_vs_whole": (m.decode_tps or 0) / best.decode_tps,
            "workload_vs_whole": best.workload_s / m.workload_s if m.workload_s else None}


def record_row(run: str, preset: str, routing: str, budget: float, plan_id: str, plan_s: float, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One record row from the plan and the race's summary rows."""
    out: dict[str, Any] = {"run": run, "model": preset, "routing": routing, "budget_gib": budget, "plan_id": plan_id, "plan_s": plan_s,
                           **plan_facts(plan_id)}
    for r in rows:
        key = BASELINE_KEYS.get(r["baseline"])
        if key is None:
            continue
        m = json.loads(r["metrics"] or "{}")
        turns: dict[str, Any] = m.get("per_turn") or {}
        unreported = m.get("unreported") or {}
        out.update({f"tg_vs_{key}": r["ratio_decode"], f"pp_vs_{key}": r["ratio_prefill"],
                    f"{key}_valid": m.get("baseline_valid"), f"{key}_flag": m.get("baseline_flag"),
                    f"{key}_gpu_method": m.get("baseline_gpu_method"),
                    f"{key}_tg_unreported": (unreported.get("decode") or {}).get("ratio"),
                    f"{key}_gpu_gib": (m.get("baseline_gpu_bytes") or 0) / GIB or None,
                    f"{key}_note": m.get("engine_note"), f"{key}_sweep_vs_race": m.get("sweep_vs_race")})
        first: dict[str, Any] = turns.get("agent") or next(iter(turns.values()), {})
        agent = first.get("turn_speedup")
        out[f"agent_vs_{key}"] = agent["ratio"] if agent else None
        out.update({"served_decode_tps": m.get("served_decode_tps"), "plan_gpu_gib": (m.get("plan_gpu_bytes") or 0) / GIB or None,
                    "plan_gpu_method": m.get("plan_gpu_method"), "plan_gpu_vs_measured": m.get("plan_gpu_vs_measured"),
                    "plan_flag": m.get("plan_flag"), "baseline_threads": m.get("baseline_threads"),
                    "baseline_threads_note": m.get("baseline_threads_note"), **host_columns(m.get("host"))})
    if rows:  # how the race held its contenders (tasks/bench/standing.py): co-resident unless its metrics say
        out["race"] = race_of_metrics(json.loads(r["metrics"] or "{}") for r in rows)
    out.update({"date": time.strftime("%Y-%m-%d", time.gmtime()), "superseded_by": None})
    if out.get("served_decode_tps") and out.get("plan_decode_tps"):
        out["http_vs_plan_decode"] = out["served_decode_tps"] / out["plan_decode_tps"]
    out.update(step_times(out.get("served_decode_tps"), out.get("all_gpu_decode_tps")))
    return mask_invalid(out)


def depth_rows(run: str, tag: str, plan_id: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record row per depth from a depth race's summary rows (``flux bench run --via serve --depths``: a row
    per contender and depth, tasks/bench/served_depths.py): the plan's prefill and decode there beside the bytes
    bound of its decode and the cost model's prediction, each baseline's readings and the plan/baseline ratios
    (no ratio where the row is no result), the depths not held by a baseline's own context and those the plan's
    context does not hold (``skipped``)."""
    by: dict[int, dict[str, Any]] = {}
    for r in rows:
        m = json.loads(r["metrics"] or "{}")
        depth = m.get("depth")
        if depth is None:
            continue
        out = by.setdefault(depth, {"run": run, "pair": tag, "plan_id": plan_id, "ctx": m.get("ctx"),
                                    "depth_tokens": depth, "gen_tokens": m.get("gen_tokens"), "skipped": False,
                                    "race": m.get("race")})
        who = m.get("contender", "plan")
        if m.get("skipped"):
            out["skipped"] = True
        elif who == "plan":
            out.update({f"plan_{k}": m.get(k) for k in ("decode_tps", "prefill_tps", "bound_decode_tps",
                                                         "predicted_decode_tps", "of_bound")})
            out.update(plan_verdict=r["verdict"], plan_gpu_gib=(m.get("plan_gpu_bytes") or 0) / GIB or None)
        elif who in BASELINE_KEYS:
            key = BASELINE_KEYS[who]
            out.update({f"{key}_decode_tps": m.get("decode_tps"), f"{key}_prefill_tps": m.get("prefill_tps"),
                        f"{key}_server_decode_tps": m.get("server_decode_tps"), f"tg_vs_{key}": r["ratio_decode"],
                        f"pp_vs_{key}": r["ratio_prefill"], f"{key}_not_held": m.get("not_held"),
                        f"{key}_valid": r["verdict"] == "info" and not m.get("baseline_flag") and not m.get("not_held"),
                        f"{key}_gpu_gib": (m.get("baseline_gpu_bytes") or 0) / GIB or None})
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


def write_rows(rows: list[dict[str, Any]], path: Path) -> None:
    """Append rows to a Parquet file (the columns' union: Arrow would take the first row's keys alone)."""
    every = [*(pq.read_table(path).to_pylist() if path.exists() else []), *rows]
    keys = list(dict.fromkeys(k for r in every for k in r))
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in every]), path)


def append_record(out: Path, record: Path) -> int:
    """Append ``out``'s rows to ``record`` (the docs' record, rows from every run) unless a row of the same run
    and plan is there already; returns how many were added."""
    have = {(r.get("run"), r.get("plan_id")) for r in pq.read_table(record).to_pylist()} if record.exists() else set()
    new = [r for r in pq.read_table(out / RESULTS).to_pylist() if (r.get("run"), r.get("plan_id")) not in have]
    if new:
        write_rows(new, record)
    log(f"appended {len(new)} row(s) to {record}")
    depths, record_depths = out / DEPTHS, record.with_name("depths.parquet")
    if depths.exists():
        seen = {(r.get("run"), r.get("plan_id"), r.get("depth_tokens"))
                for r in pq.read_table(record_depths).to_pylist()} if record_depths.exists() else set()
        more = [r for r in pq.read_table(depths).to_pylist()
                if (r.get("run"), r.get("plan_id"), r.get("depth_tokens")) not in seen]
        if more:
            write_rows(more, record_depths)
        log(f"appended {len(more)} depth row(s) to {record_depths}")
    return len(new)


def backfill_steps(record: Path) -> int:
    """Give the record's rows made before the step columns (:mod:`tasks.bench.step_facts`) their figures: the
    split from the ``flux show`` log saved with the row's run (``runN/show-*.log`` beside the record, found by
    plan id), the step times from the row's own speeds; and every row its run's probe reading of the host with
    the flag of a slow host against the record's other runs (:func:`tasks.bench.host_state.flag_record`).
    Returns how many rows gained a step figure."""
    shows = {}
    for log_path in record.parent.glob("run*/**/show-*.log"):
        text = log_path.read_text()
        shows[text.split("\n", 1)[0].rsplit(" ", 1)[-1]] = text  # "$ flux show <plan id>"
    rows, changed = pq.read_table(record).to_pylist(), 0
    for r in rows:
        if not r.get("plan_id") or r.get("step_ms") is not None:
            continue
        facts = step_facts_from_show(shows.get(r["plan_id"], ""))
        r.update({k: v for k, v in facts.items() if r.get(k) is None})
        r.update(step_times(r.get("served_decode_tps"), r.get("all_gpu_decode_tps")))
        changed += 1
    host = flag_record(rows, probe_readings(record.parent))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in keys} for r in rows]), record)
    log(f"{record}: step figures for {changed} row(s), the host's probe reading for {host}; "
        f"{sum(1 for r in rows if r.get('host_flag'))} row(s) on a host slower than usual")
    return changed


def store_results(out: Path) -> None:
    """Put the record into the store as table ``bench_gpu`` (DuckDB: SELECT * FROM bench_gpu)."""
    from artifacts.config import load_settings
    from artifacts.ids import content_id
    from artifacts.store import Store

    table = pq.read_table(out / RESULTS)
    key = content_id({"bench_gpu": [r.get("plan_id") for r in table.to_pylist()], "rows": table.num_rows})
    Store(load_settings().data_dir).put_table("bench_gpu", table, key=key)
    log(f"stored {out / RESULTS} as bench_gpu/{key[:12]}")


def race_depths(args: argparse.Namespace, pair: Pair, plan_id: str) -> None:
    """The plan against ``--depth-baselines`` at each of the pair's depths (``flux bench run --via serve --depths``),
    one record row per depth in DEPTHS."""
    depths = pair.depths or parse_depths(args.depths)
    t1 = time.time()
    bench = flux("bench", "run", plan_id, "--via", "serve", "--depths", ",".join(map(str, depths)), "--depth-gen",
                 str(args.depth_gen), "--rounds", str(args.depth_rounds), "--baselines", args.depth_baselines,
                 out=args.out, name=f"depths-{pair.tag}")
    rows = depth_rows(args.run, pair.tag, plan_id, summary_rows(plan_id, t1))
    if not rows:
        log(f"{pair.tag}: the depth race stored nothing ({bench.returncode}): {bench.stderr.strip()[-300:]}")
        return
    for r in rows:
        if r["skipped"]:
            log(f"{pair.tag} at {r['depth_tokens']} tokens: skipped (past the plan's {r['ctx']} tokens)")
            continue
        log(f"{pair.tag} at {r['depth_tokens']} tokens: decode {r.get('plan_decode_tps') or 0:.1f} tok/s (bound "
            f"{r.get('plan_bound_decode_tps') or 0:.1f}) vs --fit " + (
                "not held" if r.get("fit_not_held") else f"{r.get('fit_decode_tps') or 0:.1f}"))
    write_rows(rows, args.out / DEPTHS)


def plan(args: argparse.Namespace, pair: Pair, model: Path, draft: Path | None, heads: Path | None = None
         ) -> tuple[subprocess.CompletedProcess[str], float, dict[str, Any]]:
    """``flux plan`` for the pair; refused for its budget ("use --budget-s N or more") and without ``--no-retry``,
    once more at N, the stages before measuring reused from the refusal. Returns the last run, its wall seconds
    and, after a refusal, ``plan_refused_s`` (the refused run's seconds) and ``plan_budget_s_used``."""
    args_ = pair.plan_args(model, draft, args.plan_budget_s, heads)
    t0 = time.monotonic()
    proc = flux(*args_, out=args.out, name=f"plan-{pair.tag}")
    plan_s = time.monotonic() - t0
    need = refused_budget(proc.stderr) if proc.returncode == 2 and not args.no_retry else None
    if need is None:
        return proc, plan_s, {}
    log(f"{pair.tag}: refused at its budget after {plan_s:.0f} s; planning again at --budget-s {need}")
    (args.out / f"plan-{pair.tag}.log").rename(args.out / f"plan-{pair.tag}-refused.log")
    t1 = time.monotonic()
    proc = flux(*pair.model_copy(update={"plan_budget_s": need}).plan_args(model, draft, None, heads), out=args.out,
                name=f"plan-{pair.tag}")
    return proc, time.monotonic() - t1, {"plan_refused_s": plan_s, "plan_budget_s_used": need}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="the run's folder (required but with --backfill-steps)")
    ap.add_argument("--model-dir", type=Path, default=Path("/dev/shm/flux-models"))
    ap.add_argument("--pairs", default="qwen3-30b-a3b:8,qwen3-30b-a3b:12,qwen3-30b-a3b:16,qwen3-30b-a3b:0")
    ap.add_argument("--plan-budget-s", type=float, default=None, help="flux plan --budget-s (default: its own)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baselines", default="fit,n-cpu-moe,most-ngl")
    ap.add_argument("--run", default=time.strftime("run-%Y%m%d-%H%M"))
    ap.add_argument("--synth", default="", help="extra flux synth flags, e.g. '--routing skewed'")
    ap.add_argument("--depths", default="", help="tokens of context in the cache, e.g. 4096,32768,131072: every "
                    "pair's plan raced at each depth it holds against --depth-baselines (`flux bench run --via serve "
                    "--depths`); a pair's own #D1/D2/... suffix replaces them for that pair")
    ap.add_argument("--depth-baselines", default="fit", help="the baselines of the depth races")
    ap.add_argument("--depth-rounds", type=int, default=2, help="rounds of the depth races (two or more compare "
                    "each depth's visits with each other)")
    ap.add_argument("--depth-gen", type=int, default=64, help="tokens decoded at each depth")
    ap.add_argument("--backfill-steps", type=Path, default=None, metavar="RECORD",
                    help="give RECORD's older rows the step columns (from the show logs beside it) and exit")
    ap.add_argument("--no-retry", action="store_true", help="a plan refused for its budget is not planned again at "
                    "the budget it names")
    ap.add_argument("--import", dest="import_only", action="store_true")
    ap.add_argument("--record", type=Path, default=None, help="with --import: also append the rows to this Parquet file")
    args = ap.parse_args()
    if args.backfill_steps:
        backfill_steps(args.backfill_steps)
        return 0
    if args.out is None:
        ap.error("--out DIR is required: the run's folder")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.import_only:
        store_results(args.out)
        if args.record:
            append_record(args.out, args.record)
        return 0
    args.model_dir.mkdir(parents=True, exist_ok=True)
    deep: list[tuple[Pair, str]] = []
    for text in args.pairs.split(","):
        try:
            pair = parse_pair(text)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        preset, routing, budget, tag = pair.preset, pair.routing, pair.budget_gib, pair.tag
        model = twin(args.model_dir, preset, routing, args.synth.split(), args.out)
        draft = draft_twin(model, pair.draft_layers, args.out) if pair.draft_layers else None
        heads = heads_twin(model, preset, routing, args.synth.split(), args.out) if pair.heads else None
        proc, plan_s, refused = plan(args, pair, model, draft, heads)
        if proc.returncode != 0:
            log(f"{tag}: flux plan failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
            write_rows([{"run": args.run, "model": preset, "routing": routing, "budget_gib": budget, "plan_s": plan_s,
                         "error": proc.stderr.strip()[-500:], **refused}], args.out / RESULTS)
            continue
        plan_id = proc.stdout.strip().splitlines()[-1]
        log(f"{tag}: plan {plan_id[:12]} in {plan_s:.0f} s")
        flux("show", plan_id, out=args.out, name=f"show-{tag}")
        try:
            memory_record(plan_id, args.out / f"memory-{tag}.json")
        except Exception as exc:  # noqa: BLE001 - the record goes on without it
            log(f"{tag}: memory record not written: {exc}")
        t1 = time.time()
        bench = flux("bench", "run", plan_id, "--via", "serve", "--rounds", str(args.rounds), "--baselines",
                     args.baselines, out=args.out, name=f"bench-{tag}")
        got = summary_rows(plan_id, t1)
        if not got:
            log(f"{tag}: flux bench run stored nothing ({bench.returncode}): {bench.stderr.strip()[-300:]}")
        row = {**record_row(args.run, preset, routing, budget, plan_id, plan_s, got), **refused}
        log(f"{tag}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()
                                   if k.endswith(("_vs_fit", "_vs_whole", "_vs_plan_decode", "spec_speedup", "acceptance"))
                                   and isinstance(v, float)))
        write_rows([row], args.out / RESULTS)
        if pair.depths or args.depths:
            deep.append((pair, plan_id))
    for pair, plan_id in deep:  # last: a long prompt's race may take what is left of the machine's time
        race_depths(args, pair, plan_id)
    store_results(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
