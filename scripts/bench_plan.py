#!/usr/bin/env python3
"""Benchmark: Flux's plan vs llama-cpp-python's defaults vs the oracle (best of an exhaustive grid).

For each model (synthetic twins: TinyLlama-1.1B shape Q4_0 and a ~0.7 GB qwen3moe), this script
1. plans it with `flux plan` (the real Prefect flow, fresh store) and records the planner's wall time;
2. measures EVERY candidate of the same search space on the same prompts (the exhaustive grid), in
   paired randomized rounds, and takes the best as the oracle; records the grid's wall time;
3. races plan, defaults and oracle side by side in paired rounds and prints ratios.
Results go to the store's DuckDB-queryable table `bench_plan` (one row per model).

    python3 scripts/bench_plan.py [--budget-s 300] [--rounds 4] [--models tinyllama-1.1b,qwen3moe-small]
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from artifacts.config import load_settings  # noqa: E402
from artifacts.store import Store  # noqa: E402
from artifacts.synth import cached_twin  # noqa: E402
from engine_bridge.params import EngineParams  # noqa: E402
from flows import stages, workload  # noqa: E402
from flows.plan_model import plan_model  # noqa: E402
from tasks.measure import measure  # noqa: E402
from tasks.plan_types import Candidate, HardwareReport, PlacementSpace, Plan  # noqa: E402


def llama_cpp_python_defaults(n_ctx: int) -> EngineParams:
    """What `Llama(model_path)` uses: n_batch 512, n_ubatch 512, n_threads cpu/2, n_threads_batch cpu, mmap, no FA."""
    import multiprocessing

    cpus = multiprocessing.cpu_count()
    return EngineParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=max(cpus // 2, 1), n_threads_batch=cpus,
                        flash_attn=False, load_mode="mmap")


def as_candidate(cid: str, params: EngineParams, like: Candidate) -> Candidate:
    return like.model_copy(update={"id": cid, "family": cid, "params": params})


def race(cands: list[Candidate], model: Path, prompts: list[list[int]], n_gen: int, rounds: int,
         log: Path) -> dict[str, dict[str, float | None]]:
    summaries, _, _, _ = measure(cands, model, prompts, n_gen, budget_s=1e9, repeats=rounds, timeout_s=900,
                                 log_path=log, seed=7)
    return {s.candidate_id: {"prefill": s.prefill_tps, "decode": s.decode_tps, "workload": s.workload_s}
            for s in summaries}


def bench_model(preset: str, budget_s: float, rounds: int, grid_rounds: int, out_dir: Path) -> dict[str, object]:
    settings = load_settings()
    model = cached_twin(settings.cache_dir, preset)
    t0 = time.monotonic()
    plan_id = plan_model(model=str(model), budget_s=budget_s, replan=True)
    plan_s = time.monotonic() - t0
    store = Store(settings.data_dir)
    plan = Plan.model_validate(store.get_json("plan", plan_id))
    ctx = stages.context(plan.request, settings)
    hw = HardwareReport.model_validate(store.get_json("probe", stages.content_id(stages.probe_key(ctx.facts, ctx.model_hash, ctx.backend_build, ctx.code))))
    space = PlacementSpace.model_validate(store.get_json("space", stages.content_id(stages._space_key(ctx, hw))))
    lengths, n_gen = ((plan.workload_lengths, plan.workload_n_gen) if plan.workload_lengths
                      else workload.nominal_lengths(space.n_ctx, plan.request))
    prompts = workload.tune_prompts(model, lengths, 0, out_dir / "worker.log")
    t1 = time.monotonic()
    grid = race(space.candidates, model, prompts, n_gen, grid_rounds, out_dir / "worker.log")
    grid_s = time.monotonic() - t1
    oracle_id = min((c for c in grid if grid[c]["workload"]), key=lambda c: grid[c]["workload"] or 1e9)
    oracle = next(c for c in space.candidates if c.id == oracle_id)
    final = [as_candidate("plan", plan.candidate.params, plan.candidate),
             as_candidate("defaults", llama_cpp_python_defaults(space.n_ctx), plan.candidate),
             as_candidate("oracle", oracle.params, oracle)]
    res = race(final, model, prompts, n_gen, rounds, out_dir / "worker.log")

    def ratio(a: str, b: str, k: str) -> float | None:
        x, y = res[a][k], res[b][k]
        if not x or not y:
            return None
        return (y / x) if k == "workload" else (x / y)  # >1 = plan better

    return {"model": preset, "plan_id": plan_id, "plan_s": plan_s, "grid_s": grid_s, "grid_size": len(space.candidates),
            "oracle": oracle_id, "plan_candidate": plan.candidate.id,
            "plan_prefill": res["plan"]["prefill"], "plan_decode": res["plan"]["decode"],
            "defaults_prefill": res["defaults"]["prefill"], "defaults_decode": res["defaults"]["decode"],
            "oracle_prefill": res["oracle"]["prefill"], "oracle_decode": res["oracle"]["decode"],
            "vs_oracle_workload": ratio("plan", "oracle", "workload"),
            "vs_oracle_prefill": ratio("plan", "oracle", "prefill"), "vs_oracle_decode": ratio("plan", "oracle", "decode"),
            "vs_defaults_workload": ratio("plan", "defaults", "workload"),
            "vs_defaults_prefill": ratio("plan", "defaults", "prefill"),
            "vs_defaults_decode": ratio("plan", "defaults", "decode"),
            "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tinyllama-1.1b,qwen3moe-small")
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--grid-rounds", type=int, default=2)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for preset in args.models.split(","):
            r = bench_model(preset, args.budget_s, args.rounds, args.grid_rounds, Path(d))
            rows.append(r)
            print(f"\n== {preset}: planner {r['plan_s']:.0f} s vs exhaustive grid {r['grid_s']:.0f} s "
                  f"({r['grid_size']} candidates); plan {r['plan_candidate']} vs oracle {r['oracle']}")
            for k in ("workload", "prefill", "decode"):
                vo, vd = r[f"vs_oracle_{k}"], r[f"vs_defaults_{k}"]
                print(f"   {k:9s} plan/oracle {vo if vo is None else f'{vo:.3f}x'}   "
                      f"plan/defaults {vd if vd is None else f'{vd:.3f}x'}")
    store = Store(load_settings().data_dir)
    key = stages.content_id(rows)
    store.put_table("bench_plan", pa.Table.from_pylist(rows), key=key)
    print(f"\nstored as bench_plan/{key[:12]}; query: SELECT * FROM bench_plan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
