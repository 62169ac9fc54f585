"""``flux bench run``: race the plan against baselines in paired, randomized trials.

Every round starts each engine fresh (a new worker or llama-server process), warms it up with one short
prompt, and times the same corpus prompts on it; the engines' order is shuffled every round, so slow
drift of a noisy machine hits them alike. A trial pairs the plan with a baseline on the same round and
prompt; the ratio plan/baseline of prefill and of decode tokens per second is the geometric mean over
the pairs, with a bootstrap 95% interval. The plan is *faster* or *slower* only when the whole interval
is on one side of 1; otherwise the two are the same within noise. A run during which the machine's load
average exceeded its CPU count is ``info`` (inconclusive), whatever the ratios say.

Timings come from inside llama.cpp on both sides (the worker's perf counters, llama-server's ``timings``)
and are normalized to one definition (:class:`tasks.bench.engines.TrialTiming`): prefill = prompt tokens
over the time to process them, decode = decode steps over their time. Each trial row records its source.

Baselines (a registry, :data:`BASELINES`): ``llama-server`` with its automatic fit (only ``-c``/``-np``),
``defaults`` (llama-cpp-python's ``Llama(model)`` defaults through our worker) and ``n-cpu-moe`` (the
best ``--n-cpu-moe`` of a sweep; only for MoE models on a machine with a GPU, else an explicit n/a row).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from artifacts.model_info import model_info
from engine_bridge.errors import EngineError
from engine_bridge.machine_facts import cpu_info
from tasks.bench.context import BenchContext, Progress
from tasks.bench.engines import (
    EngineSpec,
    fit_server_args,
    llama_cpp_python_defaults,
    make_engine,
    plan_engine,
)
from tasks.bench.errors import BenchError
from tasks.bench.host import busy_warning, load_avg
from tasks.bench.record import BenchRun, SummaryRow
from tasks.bench.registry import Suite, csv
from tasks.bench.rows import ratio_row, tokenize_prompts
from tasks.bench.stats import RatioCI, paired_ratio

log = logging.getLogger(__name__)
TRIAL_SCHEMA = pa.schema([
    ("engine", pa.string()), ("round", pa.int32()), ("visit", pa.int32()), ("prompt_index", pa.int32()),
    ("prompt_tokens", pa.int32()), ("prompt_ms", pa.float64()), ("gen_tokens", pa.int32()),
    ("gen_ms", pa.float64()), ("prefill_tps", pa.float64()), ("decode_tps", pa.float64()),
    ("start_s", pa.float64()), ("load_avg", pa.float64()), ("timing", pa.string()), ("error", pa.string()),
])
WARMUP_TOKENS = 16  # the first run after a load is 20-30% slow: one short run before timing


class RunOptions(BaseModel):
    """How ``flux bench run`` races."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    rounds: int = Field(3, ge=1, le=50)
    prompts: int = Field(3, ge=1, le=20, description="corpus prompts per round (64, 256, 1024, ... tokens)")
    n_gen: int = Field(32, ge=2, le=1024, description="tokens decoded per prompt")
    baselines: tuple[str, ...] = Field((), description=(
        "baselines to race (default: all of the chosen --via: llama-server, defaults, n-cpu-moe for worker; "
        "fit, n-cpu-moe, most-ngl for serve)"))
    seed: int = 0
    n_boot: int = Field(4000, ge=100)
    via: Literal["worker", "serve"] = Field("worker", description=(
        "worker: the plan in an engine worker, each engine restarted every round; serve: the plan served by "
        "flux serve against llama-server at the plan's GPU budget and context"))
    turns: tuple[tuple[int, int], ...] = Field((), description="serve: (prompt, generated) tokens per turn")
    gpu_mem_budget_gib: list[float] | None = Field(None, description="serve: GiB per GPU (default: the plan's)")
    depths: tuple[int, ...] = Field((), description=(
        "serve: tokens of context already in the cache; each contender prefills a prompt that long and decodes "
        "--depth-gen tokens after it, one row per (contender, depth) with the plan's bytes bound "
        "(tasks/bench/served_depths.py); depths past the plan's context are skipped"))
    depth_gen: int = Field(64, ge=2, le=1024, description="serve, with --depths: tokens decoded at each depth")

    @model_validator(mode="after")
    def _depths_are_served(self) -> RunOptions:
        if self.depths and self.via != "serve":
            raise ValueError("--depths races the plan's flux serve: add --via serve")
        if any(d < 1 for d in self.depths):
            raise ValueError("--depths are positive token counts, e.g. 4096,32768")
        return self


SERVED_BASELINES = ("fit", "n-cpu-moe", "most-ngl")


# -- prompts ------------------------------------------------------------------------------------------
LENGTHS = (64, 256, 1024, 2048, 4096)


def prompt_lengths(n_ctx: int, n_gen: int, count: int) -> list[int]:
    """``count`` prompt lengths from the ladder that leave room for ``n_gen`` tokens (repeated if needed)."""
    fits = [n for n in LENGTHS if n + n_gen + 2 <= n_ctx] or [max(8, (n_ctx - n_gen) // 2)]
    return [fits[i % len(fits)] for i in range(count)]


# -- the race (shared with ablate) --------------------------------------------------------------------
def _row(spec: EngineSpec, rnd: int, visit: int, i: int, start_s: float | None, **timing: Any) -> dict[str, Any]:
    pt, pms, gt, gms = (timing.get(k) for k in ("prompt_tokens", "prompt_ms", "gen_tokens", "gen_ms"))
    return {"engine": spec.name, "round": rnd, "visit": visit, "prompt_index": i, "start_s": start_s,
            "load_avg": next(iter(load_avg()), None),
            "prompt_tokens": pt, "prompt_ms": pms, "gen_tokens": gt, "gen_ms": gms,
            "prefill_tps": pt / pms * 1e3 if pt and pms else None, "decode_tps": gt / gms * 1e3 if gt and gms else None,
            "timing": timing.get("source"), "error": timing.get("error")}


def _visit(spec: EngineSpec, ctx: BenchContext, prompts: list[list[int]], n_gen: int, rnd: int,
           visit: int) -> list[dict[str, Any]]:
    """Start one engine fresh, warm it up, time every prompt, stop it; an error becomes one row."""
    engine = make_engine(spec, ctx)
    rows: list[dict[str, Any]] = []
    start_s: float | None = None
    try:
        start_s = engine.start()
        engine.run(prompts[0][:WARMUP_TOKENS], 2)
        for i, prompt in enumerate(prompts):
            rows.append(_row(spec, rnd, visit, i, start_s, **engine.run(prompt, n_gen).model_dump()))
    except EngineError as exc:
        log.warning("bench: %s failed in round %d: %s", spec.name, rnd, exc)
        rows.append(_row(spec, rnd, visit, -1, start_s, error=f"{exc.code}: {exc.message}"))
    finally:
        engine.stop()
    return rows


def race(specs: Sequence[EngineSpec], ctx: BenchContext, prompts: list[list[int]], n_gen: int, rounds: int,
         seed: int = 0, progress: Progress | None = None) -> pa.Table:
    """Time every engine on the same prompts in ``rounds`` rounds, in a new random order each round.

    An engine that fails is not visited again; its error is a row.
    """
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    failed: set[str] = set()
    visit = 0
    for rnd in range(rounds):
        order = [s for s in specs if s.name not in failed]
        rng.shuffle(order)
        for spec in order:
            visit += 1
            if progress:
                progress(f"round {rnd + 1}/{rounds}: {spec.name} ({len(prompts)} prompts)")
            got = _visit(spec, ctx, prompts, n_gen, rnd, visit)
            rows.extend(got)
            if any(r["error"] for r in got):
                failed.add(spec.name)
    return pa.Table.from_pylist(rows, schema=TRIAL_SCHEMA)


def paired(table: pa.Table, a: str, b: str, metric: str) -> tuple[list[float], list[float]]:
    """Values of ``metric`` for engines a and b on the same (round, prompt), both without error."""
    by: dict[str, dict[tuple[int, int], float]] = {a: {}, b: {}}
    for r in table.to_pylist():
        if r["engine"] in by and not r["error"] and r[metric]:
            by[r["engine"]][(r["round"], r["prompt_index"])] = r[metric]
    keys = sorted(by[a].keys() & by[b].keys())
    return [by[a][k] for k in keys], [by[b][k] for k in keys]


def compare(table: pa.Table, a: str, b: str, n_boot: int, seed: int) -> tuple[RatioCI, RatioCI]:
    """(prefill, decode) ratios a/b with intervals."""
    return (paired_ratio(*paired(table, a, b, "prefill_tps"), n_boot=n_boot, seed=seed),
            paired_ratio(*paired(table, a, b, "decode_tps"), n_boot=n_boot, seed=seed + 1))


def trial_busy(table: pa.Table) -> str | None:
    """The busy-machine warning for a race, from the load average recorded with each trial."""
    return busy_warning([x for x in table.column("load_avg").to_pylist() if x is not None])


def engine_error(table: pa.Table, name: str) -> str | None:
    """The first error of an engine in a race, if any."""
    return next((r["error"] for r in table.to_pylist() if r["engine"] == name and r["error"]), None)


# -- baselines ----------------------------------------------------------------------------------------
Resolved = EngineSpec | str  # a spec to race, or why the baseline does not apply here ("n/a: ...")


def _llama_server(ctx: BenchContext, opts: RunOptions) -> Resolved:
    if ctx.llama_server is None:
        return "n/a: llama-server is not built (scripts/build-backend.sh)"
    args = fit_server_args(ctx.params)
    # no -t: a user's llama-server runs its default, every physical core (the plan: -t/-tb of its own measuring)
    return EngineSpec(name="llama-server", kind="llama-server", args=args,
                      note=f"llama-server auto-fit: {' '.join(args)}, its default threads "
                           f"({cpu_info().physical_cores}: every physical core)")


def _defaults(ctx: BenchContext, opts: RunOptions) -> Resolved:
    p = llama_cpp_python_defaults(ctx.params)
    return EngineSpec(name="defaults", kind="worker", params=p, note="llama-cpp-python defaults: " + " ".join(p.cli_args()))


def _has_gpu() -> bool:
    from engine_bridge.gpu_inventory import nvml_inventory

    return bool(nvml_inventory().gpus)


def _n_cpu_moe(ctx: BenchContext, opts: RunOptions) -> Resolved:
    info = model_info(ctx.model)
    if not info.is_moe:
        return "n/a: dense model (no experts)"
    if not _has_gpu():
        return "n/a: no GPU"
    if ctx.llama_server is None:
        return "n/a: llama-server is not built (scripts/build-backend.sh)"
    return sweep_n_cpu_moe(ctx, info.n_layer, opts)


def sweep_n_cpu_moe(ctx: BenchContext, n_layer: int, opts: RunOptions) -> Resolved:
    """The fastest ``--n-cpu-moe`` (all layers on the GPU otherwise) on one mid-length prompt."""
    base = ("-c", str(ctx.params.n_ctx * ctx.params.n_seq_max), "-np", str(ctx.params.n_seq_max), "-ngl", "999")
    values = sorted({0, n_layer // 4, n_layer // 2, 3 * n_layer // 4, n_layer})
    prompt = tokenize_prompts(ctx, prompt_lengths(ctx.params.n_ctx, opts.n_gen, 2)[-1:], "held_out", opts.seed)[0]
    best: tuple[float, EngineSpec] | None = None
    for k in values:
        spec = EngineSpec(name="n-cpu-moe", kind="llama-server", args=(*base, "--n-cpu-moe", str(k)),
                          note=f"llama-server -ngl 999 --n-cpu-moe {k} (best of {values})")
        rows = _visit(spec, ctx, [prompt], opts.n_gen, -1, 0)
        if rows and not rows[0]["error"]:
            seconds = (rows[0]["prompt_ms"] + rows[0]["gen_ms"]) / 1e3
            if best is None or seconds < best[0]:
                best = (seconds, spec)
    return best[1] if best else f"n/a: every --n-cpu-moe in {values} failed (see {ctx.server_log})"


BASELINES: dict[str, Callable[[BenchContext, RunOptions], Resolved]] = {
    "llama-server": _llama_server, "defaults": _defaults, "n-cpu-moe": _n_cpu_moe}


# -- the suite ----------------------------------------------------------------------------------------
def _verdict_row(name: str, spec: EngineSpec, table: pa.Table, opts: RunOptions, common: dict[str, Any]) -> SummaryRow:
    """Plan vs one raced baseline: fail when the plan is slower on prefill or decode."""
    plan_err, base_err = engine_error(table, "plan"), engine_error(table, name)
    metrics = {**common, "engine": spec.model_dump(mode="json")}
    if plan_err:
        return SummaryRow(baseline=name, verdict="fail", detail=f"the plan failed: {plan_err}", metrics=metrics)
    if base_err:
        return SummaryRow(baseline=name, verdict="info", detail=f"baseline failed: {base_err}", metrics=metrics)
    pre, dec = compare(table, "plan", name, opts.n_boot, opts.seed)
    slower = "slower" in (pre.outcome, dec.outcome)
    detail = f"prefill {pre.outcome} {pre.text()}, decode {dec.outcome} {dec.text()}"
    if common.get("busy"):  # timings taken under foreign load are no evidence either way
        return ratio_row(name, pre, dec, "info", f"inconclusive: {common['busy']}; {detail}", metrics)
    return ratio_row(name, pre, dec, "fail" if slower else "pass", detail, metrics)


def bench_run(ctx: BenchContext, opts: RunOptions, progress: Progress | None = None) -> BenchRun:
    """Race the plan against the chosen baselines; one summary row per baseline.

    Raises:
        BenchError: an unknown baseline name.
    """
    if opts.via == "serve":
        from tasks.bench.served import bench_served
        from tasks.bench.served_depths import bench_depths

        served = bench_depths if opts.depths else bench_served
        run: BenchRun = served(ctx, opts.model_copy(update={"baselines": opts.baselines or SERVED_BASELINES}), progress)
        return run
    opts = opts.model_copy(update={"baselines": opts.baselines or tuple(BASELINES)})
    unknown = [b for b in opts.baselines if b not in BASELINES]
    if unknown:
        raise BenchError(f"unknown baseline(s) {', '.join(unknown)}: choose from {', '.join(BASELINES)}")
    resolved = {name: BASELINES[name](ctx, opts) for name in opts.baselines}
    specs = [s for s in resolved.values() if isinstance(s, EngineSpec)]
    lengths = prompt_lengths(ctx.params.n_ctx, opts.n_gen, opts.prompts)
    prompts = tokenize_prompts(ctx, lengths, "held_out", opts.seed)
    t0, load0 = time.monotonic(), load_avg()
    table = race([plan_engine(ctx), *specs], ctx, prompts, opts.n_gen, opts.rounds, opts.seed, progress)
    common = {"options": opts.model_dump(mode="json"), "prompt_lengths": lengths, "seconds": time.monotonic() - t0,
              "load_avg_start": load0, "load_avg_end": load_avg(), "plan_engine": plan_engine(ctx).note,
              "plan_backend_build": ctx.plan.backend_build, "busy": trial_busy(table)}
    rows = [_verdict_row(name, r, table, opts, common) if isinstance(r, EngineSpec)
            else SummaryRow(baseline=name, verdict="info", detail=r, metrics=common) for name, r in resolved.items()]
    return BenchRun(suite="run", ctx=ctx, rows=rows, raw=table)


def _turns(text: str) -> tuple[tuple[int, int], ...]:
    """``PROMPT:GEN,...`` pairs of positive integers."""
    try:
        pairs = [tuple(int(x) for x in part.split(":")) for part in csv(text)]
    except ValueError:
        raise ValueError(f"expected PROMPT:GEN pairs, e.g. 512:128,2048:32, got {text!r}") from None
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise ValueError(f"expected PROMPT:GEN pairs of positive integers, got {text!r}")
    return tuple((a, b) for a, b in pairs)


def _floats(text: str) -> list[float]:
    """Comma-separated numbers."""
    return [float(x) for x in csv(text)]


def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated token counts (``32k`` for 32,768)."""
    try:
        return tuple(int(x[:-1]) * 1024 if x.lower().endswith("k") else int(x) for x in csv(text))
    except ValueError:
        raise ValueError(f"expected token counts, e.g. 4096,32768 or 4k,32k, got {text!r}") from None


SUITE = Suite(
    name="run", help="race the plan against llama-server auto-fit and llama-cpp-python defaults",
    description="Paired, randomized rounds on the same corpus prompts, each engine started fresh per round; prints "
                "prefill and decode ratios plan/baseline with 95% bootstrap intervals and a verdict (faster, same "
                "within noise, slower; fail if slower). With --via serve: the plan served by flux serve against "
                "llama-server --fit, the best --n-cpu-moe and the most -ngl at the plan's GPU budget and context. "
                "Exit 1 on fail.",
    options=RunOptions, run=bench_run,
    flags=("rounds", "prompts", "n_gen", "baselines", "via", "turns", "gpu_mem_budget_gib", "depths", "depth_gen",
           "seed"),
    rename={"gpu_mem_budget_gib": "--gpu-mem-budget"},
    parsers={"baselines": csv, "turns": _turns, "gpu_mem_budget_gib": _floats, "depths": _ints},
    help_text={"turns": "with --via serve: PROMPT:GEN tokens per turn, e.g. 512:128,2048:32 (the default)",
               "gpu_mem_budget_gib": "with --via serve: GiB per GPU for the baselines (default: the plan's budget)",
               "depths": "with --via serve: decode and prefill by depth instead of the turns: tokens of context "
                         "already in the cache, e.g. 4096,32768,131072; each contender alone, one row per "
                         "(contender, depth), the plan's beside the bytes bound of its decode there; depths past "
                         "the plan's context are skipped, past a baseline's are 'not held' for it"})
