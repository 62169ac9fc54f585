"""``flux bench record PAIRS``: the GPU record, on the path a user runs: `flux plan` → the persisted plan →
`flux serve` / `flux bench`.

For each ``MODEL[/ROUTING]:BUDGET[@CTX][~WORKLOAD][+spec|+draftK|+heads][%PLAN_S][#D1/D2/...]`` pair
(:mod:`tasks.bench.gpu_pairs`: GiB per GPU, 0 = the whole cards; CTX = ``--ctx``, else the model's trained context;
WORKLOAD = ``flux plan --workload``, agent unless given; ``+spec``: ``--speculation``, ``+draftK``: also
``--draft-model`` of a draft twin of the model's first K layers, ``+heads``: also ``--heads``, the twin's
next-token block grafted on llama-server; ``%PLAN_S``: this pair's ``--budget-s``; ``#D1/D2/...``: the
depths this pair's plan is raced at, below), the twin written by ``flux synth`` when it is missing:

1. ``flux plan <twin> --gpu-mem-budget BUDGET [--ctx CTX] --budget-s S`` — the Prefect flow with its store,
   exactly as a user runs it; the plan id it prints is the plan raced below, and its wall time is ``plan_s``
   (refused for its budget, it plans once more at the budget the refusal names, unless ``--no-retry``);
2. ``flux show <plan>`` saved next to the results;
3. ``flux bench run <plan> --via serve`` — the plan served by ``flux serve`` raced against llama-server
   ``--fit`` at the same budget holding the same context, the best ``--n-cpu-moe`` and the most ``-ngl``
   (tasks/bench/served.py), every contender timed through the same streaming HTTP client; its rows land in
   the store's ``bench_summary`` table;
4. one record row (:func:`tasks.bench.gpu_rows.record_row`) in ``OUT/h200_results.parquet``.

With ``--depths`` (or a pair's ``#D1/D2/...``), after every pair, each such pair's plan is raced once more at each
depth its context holds (``flux bench run --via serve --depths ...``, tasks/bench/served_depths.py): against
``--depth-baselines`` (``fit`` unless given), each contender alone, ``--depth-rounds`` rounds, ``--depth-gen``
tokens decoded after a prompt of each depth; one row per depth in ``OUT/h200_depths.parquet``.

Each command's output is kept in ``OUT`` (``plan-*.log``, ``show-*.log``, ``bench-*.log``, ``depths-*.log``,
``memory-*.json``), the rows go into the store as table ``bench_gpu``, and the run is stored as every suite's is:
``bench_record_raw`` (the run's rows) and one ``info`` row per pair in ``bench_summary``. ``--import --out DIR``
puts a finished run's rows into the store (table ``bench_gpu``) and, with ``--record R``, appends them to ``R``
(and its depth rows to ``R``'s sibling ``depths.parquet``) once; ``--backfill-steps R`` gives ``R``'s older rows
the step columns (:mod:`tasks.bench.gpu_files`). ``python3 scripts/standing.py`` then rewrites the standing table
of docs/benchmarks/gpu-record.md from that record.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from artifacts.records.store import Records
from tasks.bench.context import BenchSite, Progress
from tasks.bench.errors import BenchError
from tasks.bench.gpu_commands import FluxCommands, draft_twin, heads_twin, plan_pair, summary_rows, twin
from tasks.bench.gpu_files import (
    DEPTHS,
    RESULTS,
    append_record,
    backfill_steps,
    store_results,
    united,
    write_rows,
)
from tasks.bench.gpu_pairs import Pair, parse_depths, parse_pair
from tasks.bench.gpu_rows import depth_rows, memory_record, record_row
from tasks.bench.record import BenchRun, SummaryRow
from tasks.bench.registry import Suite

# what a pair's progress line reports of its row
SHOWN = ("_vs_fit", "_vs_whole", "_vs_plan_decode", "spec_speedup", "acceptance")


class RecordOptions(BaseModel):
    """What ``flux bench record`` plans, races and records, and where."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    pairs: str = Field("qwen3-30b-a3b:8,qwen3-30b-a3b:12,qwen3-30b-a3b:16,qwen3-30b-a3b:0",
                       description="MODEL[/ROUTING]:BUDGET[@CTX][~WORKLOAD][+spec|+draftK|+heads][%PLAN_S][#D1/D2/...],"
                                   "...: the pairs to plan and race (tasks/bench/gpu_pairs.py)")
    out: Path | None = Field(None, description="the run's folder (required but with --backfill-steps)")
    model_dir: Path = Field(Path("/dev/shm/flux-models"), description="where the twins are, written once")
    plan_budget_s: float | None = Field(None, gt=0, description="flux plan --budget-s (default: its own)")
    rounds: int = Field(3, ge=1, description="rounds of each pair's race (flux bench run --rounds)")
    baselines: str = Field("fit,n-cpu-moe,most-ngl", description="the baselines of each pair's race")
    run: str = Field(default_factory=lambda: time.strftime("run-%Y%m%d-%H%M"), description="the run's name in its rows")
    synth: str = Field("", description="extra flux synth flags, e.g. '--routing skewed'")
    depths: str = Field("", description="tokens of context in the cache, e.g. 4096,32768,131072: every pair's plan "
                        "raced at each depth it holds against --depth-baselines (`flux bench run --via serve "
                        "--depths`); a pair's own #D1/D2/... suffix replaces them for that pair")
    depth_baselines: str = Field("fit", description="the baselines of the depth races")
    depth_rounds: int = Field(2, ge=1, description="rounds of the depth races (two or more compare each depth's "
                              "visits with each other)")
    depth_gen: int = Field(64, ge=1, description="tokens decoded at each depth")
    backfill_steps: Path | None = Field(None, description="give this record's older rows the step columns (from the "
                                        "show logs beside it) and exit")
    no_retry: bool = Field(False, description="a plan refused for its budget is not planned again at the budget "
                           "it names")
    import_only: bool = Field(False, description="put --out's finished run into the store (table bench_gpu) "
                              "instead of running")
    record: Path | None = Field(None, description="with --import: also append the rows to this Parquet file")


def _clocked(progress: Progress | None) -> Progress:
    """Progress lines with the time of day (a record run takes hours; its log is read afterwards)."""
    return lambda msg: progress(f"record {time.strftime('%H:%M:%S')} {msg}") if progress else None


def _parsed(opts: RecordOptions) -> tuple[list[Pair], tuple[int, ...]]:
    """The pairs and the run's depths, or a BenchError before anything runs."""
    try:
        pairs = [parse_pair(p) for p in opts.pairs.split(",") if p.strip()]
        depths = parse_depths(opts.depths) if opts.depths else ()
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    if not pairs:
        raise BenchError("no pairs: give MODEL:BUDGET[,...], e.g. `flux bench record qwen3-30b-a3b/skewed:12 --out DIR`")
    return pairs, depths


def _shown(row: dict[str, Any]) -> str:
    """A pair's row in a line: its ratios (:data:`SHOWN`)."""
    return ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k.endswith(SHOWN) and isinstance(v, float))


def _summary(row: dict[str, Any]) -> SummaryRow:
    """A pair's row as the run's summary row: its ratios against --fit, its line, the whole row in metrics."""
    shown = _shown(row)
    detail = (f"flux plan failed: {row['error'][-200:]}" if row.get("error")
              else f"plan {row['plan_id'][:12]} in {row['plan_s']:.0f} s" + (f": {shown}" if shown else ""))
    return SummaryRow(baseline=row["pair"], verdict="info", detail=detail,
                      ratio_prefill=row.get("pp_vs_fit"), ratio_decode=row.get("tg_vs_fit"), metrics=row)


class _Recorder:
    """One record run: the commands it drives, the store it reads back, the rows it writes."""

    def __init__(self, site: BenchSite, opts: RecordOptions, out: Path, say: Progress) -> None:
        self.site, self.opts, self.out, self.say = site, opts, out, say
        self.flux = FluxCommands(out, say)
        self.records = Records(site.store)

    def pair(self, pair: Pair) -> tuple[dict[str, Any], str | None]:
        """Plan, show and race one pair; its record row and the plan's id (None where ``flux plan`` failed)."""
        o, extra, tag = self.opts, self.opts.synth.split(), pair.tag
        model = twin(self.flux, o.model_dir.resolve(), pair.preset, pair.routing, extra)
        draft = draft_twin(self.flux, model, pair.draft_layers) if pair.draft_layers else None
        heads = heads_twin(self.flux, model, pair.preset, pair.routing, extra) if pair.heads else None
        planned = plan_pair(self.flux, pair, model, draft, heads, o.plan_budget_s, not o.no_retry)
        head = {"run": o.run, "model": pair.preset, "routing": pair.routing, "budget_gib": pair.budget_gib}
        plan_id = planned.plan_id
        if plan_id is None:
            err = planned.proc.stderr.strip()
            self.say(f"{tag}: flux plan failed ({planned.proc.returncode}): {err.splitlines()[-1:]}")
            return {**head, "plan_s": planned.plan_s, "error": err[-500:], **planned.refused}, None
        self.say(f"{tag}: plan {plan_id[:12]} in {planned.plan_s:.0f} s")
        self.flux("show", plan_id, name=f"show-{tag}")
        try:
            memory_record(self.records, plan_id, self.out / f"memory-{tag}.json")
        except Exception as exc:  # noqa: BLE001 - the record goes on without it
            self.say(f"{tag}: memory record not written: {exc}")
        t1 = time.time()
        bench = self.flux("bench", "run", plan_id, "--via", "serve", "--rounds", str(o.rounds), "--baselines",
                          o.baselines, name=f"bench-{tag}")
        got = summary_rows(self.site.store, plan_id, t1)
        if not got:
            self.say(f"{tag}: flux bench run stored nothing ({bench.returncode}): {bench.stderr.strip()[-300:]}")
        row = {**record_row(self.records, o.run, pair.preset, pair.routing, pair.budget_gib, plan_id, planned.plan_s,
                            got), **planned.refused}
        self.say(f"{tag}: {_shown(row)}")
        return row, plan_id

    def depths(self, pair: Pair, plan_id: str, depths: tuple[int, ...]) -> None:
        """The plan against ``--depth-baselines`` at each depth (``flux bench run --via serve --depths``), one
        record row per depth in :data:`~tasks.bench.gpu_files.DEPTHS`."""
        o, t1 = self.opts, time.time()
        bench = self.flux("bench", "run", plan_id, "--via", "serve", "--depths", ",".join(map(str, depths)),
                          "--depth-gen", str(o.depth_gen), "--rounds", str(o.depth_rounds), "--baselines",
                          o.depth_baselines, name=f"depths-{pair.tag}")
        rows = depth_rows(o.run, pair.tag, plan_id, summary_rows(self.site.store, plan_id, t1))
        if not rows:
            self.say(f"{pair.tag}: the depth race stored nothing ({bench.returncode}): {bench.stderr.strip()[-300:]}")
            return
        for r in rows:
            if r["skipped"]:
                self.say(f"{pair.tag} at {r['depth_tokens']} tokens: skipped (past the plan's {r['ctx']} tokens)")
                continue
            self.say(f"{pair.tag} at {r['depth_tokens']} tokens: decode {r.get('plan_decode_tps') or 0:.1f} tok/s "
                     f"(bound {r.get('plan_bound_decode_tps') or 0:.1f}) vs --fit " + (
                         "not held" if r.get("fit_not_held") else f"{r.get('fit_decode_tps') or 0:.1f}"))
        write_rows(rows, self.out / DEPTHS)


def _race(site: BenchSite, opts: RecordOptions, out: Path, say: Progress) -> BenchRun:
    """Every pair planned, shown and raced, then the depth races; the run's rows stored as ``bench_gpu``."""
    pairs, run_depths = _parsed(opts)
    opts.model_dir.mkdir(parents=True, exist_ok=True)
    recorder, rows = _Recorder(site, opts, out, say), []
    deep: list[tuple[Pair, str, tuple[int, ...]]] = []
    for pair in pairs:
        row, plan_id = recorder.pair(pair)
        write_rows([row], out / RESULTS)
        rows.append({**row, "pair": pair.tag})
        if plan_id is not None and (pair.depths or run_depths):
            deep.append((pair, plan_id, pair.depths or run_depths))
    for pair, plan_id, depths in deep:  # last: a long prompt's race may take what is left of the machine's time
        recorder.depths(pair, plan_id, depths)
    store_results(out, site.store, say)
    return BenchRun(suite="record", ctx=site, rows=[_summary(r) for r in rows], raw=united(rows))


def record_gpu(site: BenchSite, opts: RecordOptions, progress: Progress | None = None) -> BenchRun | None:
    """Run the record (or, with ``--import`` or ``--backfill-steps``, file a finished run's rows: None, nothing
    measured to store)."""
    say = _clocked(progress)
    if opts.backfill_steps:
        backfill_steps(opts.backfill_steps, say)
        return None
    if opts.out is None:
        raise BenchError("--out DIR is required: the run's folder")
    if opts.import_only:
        store_results(opts.out, site.store, say)
        if opts.record:
            append_record(opts.out, opts.record, say)
        return None
    opts.out.mkdir(parents=True, exist_ok=True)
    return _race(site, opts, opts.out, say)


SUITE = Suite(
    name="record", help="the GPU record: flux plan, show and bench run --via serve of each MODEL:BUDGET pair "
                        "(no plan: pairs), one row each",
    description="For each pair, writes the twin when missing (flux synth), plans it (flux plan), shows the plan and "
                "races it served against llama-server (flux bench run --via serve), each a flux command of its own "
                "as a user runs it, logged in --out; one row per pair in OUT/h200_results.parquet and the store's "
                "bench_gpu table; --depths races each plan again by depth (OUT/h200_depths.parquet). --import files "
                "a finished run's rows (and --record appends them to the docs' record). The rows are info.",
    options=RecordOptions, run=record_gpu,
    flags=("out", "model_dir", "plan_budget_s", "rounds", "baselines", "run", "synth", "depths", "depth_baselines",
           "depth_rounds", "depth_gen", "backfill_steps", "no_retry", "import_only", "record"),
    rename={"import_only": "--import"}, subject="pairs")
