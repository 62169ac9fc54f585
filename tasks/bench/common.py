"""What every ``flux bench`` suite shares: the plan under test, results storage, statistics, engines.

Storage: each run writes its raw rows (one per trial, request or check) as a Parquet table of kind
``bench_<suite>_raw`` keyed by the run id, and one row per (run, baseline) as a table of kind
``bench_summary`` keyed ``<plan>.<suite>.<baseline>.<backend build>.<run>``, so
``Store.query("SELECT * FROM bench_summary")`` shows every run of every suite.

Statistics: speed claims are ratios of paired trials (same round, same prompt) with a bootstrap 95%
interval of their geometric mean; "faster" and "slower" need the whole interval on one side of 1.

Engines: the plan and the llama-cpp-python defaults run in fresh engine workers (``timed_run``: llama.cpp's
perf counters); llama.cpp's ``llama-server`` runs as a subprocess (its own ``timings``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from artifacts.config import Settings
from artifacts.errors import FluxError
from artifacts.filehash import model_hash
from artifacts.model_info import shard_paths
from artifacts.store import Store
from engine_bridge import ops
from engine_bridge.backend import backend_info, llama_server_path
from engine_bridge.client import WorkerClient
from engine_bridge.llama_server import LlamaServer, ServerTimings
from engine_bridge.params import EngineParams
from tasks.plan_types import Plan

log = logging.getLogger(__name__)
Progress = Callable[[str], None]
Verdict = Literal["pass", "fail", "info"]
Outcome = Literal["faster", "same", "slower", "n/a"]
# Every suite of the seed's table that records a verdict, in the table's order (matrix columns).
VERDICT_SUITES: tuple[str, ...] = ("run", "quality", "conformance", "soak", "arrivals", "ablate")
SUMMARY_KIND = "bench_summary"
SUMMARY_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("plan_id", pa.string()), ("suite", pa.string()), ("baseline", pa.string()),
    ("backend_build", pa.string()), ("created_at", pa.timestamp("us", tz="UTC")), ("verdict", pa.string()),
    ("detail", pa.string()), ("ratio_prefill", pa.float64()), ("ratio_decode", pa.float64()),
    ("ci_low", pa.float64()), ("ci_high", pa.float64()), ("prefill_ci_low", pa.float64()),
    ("prefill_ci_high", pa.float64()), ("n_samples", pa.int64()), ("metrics", pa.string()),
])


class BenchError(FluxError):
    """A benchmark cannot run as asked (missing model, engine, or data); the message says what to do."""


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- the plan under test ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchContext:
    """What a suite needs: settings, store, the plan, this machine's backend build, llama-server."""

    settings: Settings
    store: Store
    plan: Plan
    backend_build: str
    llama_server: Path | None

    @property
    def model(self) -> Path:
        """The plan's model file."""
        return Path(self.plan.model_path)

    @property
    def params(self) -> EngineParams:
        """The plan's engine parameters."""
        return self.plan.candidate.params

    @property
    def worker_log(self) -> Path:
        """Where benchmark workers write their output."""
        return self.settings.logs_dir / "bench-worker.log"

    @property
    def server_log(self) -> Path:
        """Where benchmark llama-server processes write their output."""
        return self.settings.logs_dir / "bench-llama-server.log"

    @property
    def timeout_s(self) -> float:
        """Longest wait for one engine call."""
        return self.settings.plan.measure_timeout_s

    def need_llama_server(self) -> Path:
        """The llama-server binary, or a BenchError saying how to build it."""
        if self.llama_server is None:
            raise BenchError("llama-server is not built for this backend: run scripts/build-backend.sh")
        return self.llama_server


def open_bench(settings: Settings, plan_prefix: str, *, check_hash: bool = True) -> BenchContext:
    """Load a plan for benchmarking and check that its model file is still the one it was made for.

    Raises:
        NotFound: no plan id starts with ``plan_prefix`` (or several do).
        BenchError: the plan's model file is gone or changed.
    """
    store = Store(settings.data_dir)
    plan = Plan.model_validate(store.get_json("plan", store.find("plan", plan_prefix)))
    model = Path(plan.model_path)
    if not model.is_file():
        raise BenchError(f"plan {plan.id[:12]} was made for {model}, which is gone: restore the file, "
                         f"or plan the model again at its new path (`flux plan <model.gguf>`)")
    if check_hash and model_hash(shard_paths(model), settings.cache_dir) != plan.model_hash:
        raise BenchError(f"{model} changed since plan {plan.id[:12]} was made: plan it again "
                         f"(`flux plan {model} --replan`)")
    build = backend_info(settings.cache_dir).build_id
    if build != plan.backend_build:
        log.warning("plan %s was measured on backend %s; this is %s: results describe this build",
                    plan.id[:12], plan.backend_build, build)
    return BenchContext(settings=settings, store=store, plan=plan, backend_build=build,
                        llama_server=llama_server_path(settings.cache_dir))


# -- statistics ---------------------------------------------------------------------------------------
class RatioCI(_Model):
    """Ratio of paired samples (median of the pairs' ratios) with a bootstrap interval; None where undefined."""

    ratio: float | None
    low: float | None
    high: float | None
    n: int
    geomean: float | None = Field(None, description="geometric mean of the pairs' ratios (not robust to bursts)")
    p_value: float | None = Field(None, description="Wilcoxon signed-rank test of the log ratios (n >= 6)")

    @property
    def outcome(self) -> Outcome:
        """'faster'/'slower' when the whole interval is above/below 1, 'same' when it straddles 1."""
        if self.low is None or self.high is None:
            return "n/a"
        return "faster" if self.low > 1.0 else "slower" if self.high < 1.0 else "same"

    def text(self) -> str:
        """``1.23x [1.10, 1.35]``."""
        if self.ratio is None:
            return "n/a"
        ci = f" [{self.low:.2f}, {self.high:.2f}]" if self.low is not None and self.high is not None else ""
        return f"{self.ratio:.2f}x{ci}"


def paired_ratio(num: Sequence[float], den: Sequence[float], *, n_boot: int = 4000, seed: int = 0,
                 level: float = 0.95) -> RatioCI:
    """Ratio num/den over paired samples: exp(median(log num - log den)), bootstrap percentile interval.

    The median, not the mean: on a shared machine a burst of load can slow one engine's visit 10x, and one
    such pair must not decide the verdict (the geometric mean is kept alongside). Pairs where either side
    is missing or not positive are dropped.
    """
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    ok = np.isfinite(a) & np.isfinite(b) & (a > 0) & (b > 0)
    d = np.log(a[ok]) - np.log(b[ok])
    if d.size == 0:
        return RatioCI(ratio=None, low=None, high=None, n=0)
    ratio, geomean = float(np.exp(np.median(d))), float(np.exp(d.mean()))
    if d.size < 2:
        return RatioCI(ratio=ratio, low=None, high=None, n=1, geomean=geomean)
    medians = np.median(d[np.random.default_rng(seed).integers(0, d.size, size=(n_boot, d.size))], axis=1)
    lo, hi = np.quantile(medians, [(1 - level) / 2, 1 - (1 - level) / 2])
    p = None
    if d.size >= 6 and np.any(d != 0):
        from scipy.stats import wilcoxon

        p = float(wilcoxon(d).pvalue)
    return RatioCI(ratio=ratio, low=float(np.exp(lo)), high=float(np.exp(hi)), n=int(d.size), geomean=geomean,
                   p_value=p)


def busy_warning(loads: Sequence[float], cpu_count: int | None = None) -> str | None:
    """A warning when the 1-minute load average during a timed run shows foreign load.

    The engine under test keeps up to one runnable thread per CPU itself, so only a load above the CPU
    count plus half of it (3 on 2 CPUs) is taken as someone else's work.
    """
    cpus, worst = cpu_count or os.cpu_count() or 1, max(loads, default=0.0)
    return None if worst <= cpus + max(1, cpus // 2) else (f"machine busy during the run (load average up to {worst:.1f} on {cpus} "
                                       "CPUs): timings are noisy, rerun on an idle machine")


# -- results ------------------------------------------------------------------------------------------
class SummaryRow(_Model):
    """One row of ``bench_summary``: a run's result against one baseline."""

    baseline: str
    verdict: Verdict
    detail: str = ""
    ratio_prefill: float | None = None
    ratio_decode: float | None = None
    ci_low: float | None = Field(None, description="decode ratio interval (the suite's main ratio)")
    ci_high: float | None = None
    prefill_ci_low: float | None = None
    prefill_ci_high: float | None = None
    n_samples: int | None = None
    metrics: dict[str, Any] = Field(default_factory=dict)


@dataclass
class BenchRun:
    """A finished suite run: its summary rows and its raw rows."""

    suite: str
    ctx: BenchContext
    rows: list[SummaryRow]
    raw: pa.Table
    run_id: str = ""
    created_at: datetime | None = None

    def __post_init__(self) -> None:
        self.run_id = self.run_id or uuid.uuid4().hex
        self.created_at = self.created_at or datetime.now(UTC)

    @property
    def verdict(self) -> Verdict:
        """The run's verdict: fail if any row fails, info if every row is info, else pass."""
        return overall([r.verdict for r in self.rows])


def overall(verdicts: Sequence[str]) -> Verdict:
    """Combine row verdicts: any fail → fail; all info (or none) → info; else pass."""
    if "fail" in verdicts:
        return "fail"
    return "pass" if "pass" in verdicts else "info"


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._-") or "x"


def summary_table(run: BenchRun) -> pa.Table:
    """The run's ``bench_summary`` rows."""
    plan = run.ctx.plan
    rows = [{"run_id": run.run_id, "plan_id": plan.id, "suite": run.suite, "backend_build": run.ctx.backend_build,
             "created_at": run.created_at, **r.model_dump(exclude={"metrics"}),
             "metrics": json.dumps(r.metrics, sort_keys=True, default=str)} for r in run.rows]
    return pa.Table.from_pylist(rows, schema=SUMMARY_SCHEMA)


def save_run(run: BenchRun) -> list[Path]:
    """Store the raw table (``bench_<suite>_raw``) and one ``bench_summary`` table per row; their paths."""
    store, plan = run.ctx.store, run.ctx.plan
    raw = run.raw.append_column("run_id", pa.array([run.run_id] * run.raw.num_rows, pa.string()))
    meta = {"plan_id": plan.id, "suite": run.suite, "run_id": run.run_id}
    paths = [store.put_table(f"bench_{run.suite}_raw", raw, key=run.run_id, meta=meta)]
    table = summary_table(run)
    for i, row in enumerate(run.rows):
        key = ".".join([plan.id[:16], _safe(run.suite), _safe(row.baseline)[:40], _safe(run.ctx.backend_build)[:16],
                        run.run_id[:12]])
        paths.append(store.put_table(SUMMARY_KIND, table.slice(i, 1), key=key,
                                     meta={**meta, "baseline": row.baseline, "verdict": row.verdict}))
    return paths


def load_avg() -> list[float]:
    """The machine's 1/5/15-minute load averages (recorded with every run: a busy machine skews timings)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


# -- engines ------------------------------------------------------------------------------------------
EngineKind = Literal["worker", "llama-server"]


class EngineSpec(_Model):
    """An engine configuration that a race can start fresh in every round."""

    name: str
    kind: EngineKind
    params: EngineParams | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    note: str = ""


class TrialTiming(_Model):
    """One prompt's prefill and decode, normalized to one definition for every engine.

    ``prompt_ms`` is the time to process ``prompt_tokens`` prompt tokens; ``gen_ms`` the time of
    ``gen_tokens`` decode steps (the first generated token comes free with the prompt's logits).
    """

    prompt_tokens: int
    prompt_ms: float
    gen_tokens: int
    gen_ms: float
    source: str


def worker_timing(t: ops.Timing) -> TrialTiming:
    """The worker's wall-clock timing: prefill up to the first token's logits, then ``gen_tokens`` steps."""
    return TrialTiming(prompt_tokens=t.prompt_tokens, prompt_ms=t.prompt_ms, gen_tokens=t.gen_tokens, gen_ms=t.gen_ms,
                       source="worker wall clock")


def server_timing(t: ServerTimings) -> TrialTiming:
    """llama-server's timings, normalized: ``predicted_ms`` spans ``predicted_n - 1`` decode steps."""
    return TrialTiming(prompt_tokens=t.prompt_n, prompt_ms=t.prompt_ms, gen_tokens=max(t.predicted_n - 1, 0),
                       gen_ms=t.predicted_ms, source="llama-server timings (first token is free)")


class Engine(Protocol):
    """A started engine that times prompts."""

    def start(self) -> float:
        """Start and load; seconds taken."""

    def run(self, prompt: list[int], n_gen: int) -> TrialTiming:
        """Prefill ``prompt``, decode ``n_gen`` greedy tokens."""

    def stop(self) -> None:
        """Stop and free everything."""


class WorkerEngine:
    """The native engine in a fresh worker: ``load`` with EngineParams, then ``timed_run``."""

    def __init__(self, spec: EngineSpec, ctx: BenchContext) -> None:
        if spec.params is None:
            raise BenchError(f"engine {spec.name}: a worker engine needs EngineParams")
        self.params, self.ctx = spec.params, ctx
        self.w = WorkerClient(log_path=ctx.worker_log, env={**spec.params.environment(), **spec.env})

    def start(self) -> float:
        self.w.start()
        got = self.w.request(ops.LOAD, ops.LoadArgs(model=str(self.ctx.model), params=self.params), self.ctx.timeout_s)
        return got.load_ms / 1e3

    def run(self, prompt: list[int], n_gen: int) -> TrialTiming:
        return worker_timing(self.w.request(ops.TIMED_RUN, ops.TimedRunArgs(prompt=prompt, n_gen=n_gen), self.ctx.timeout_s))

    def stop(self) -> None:
        self.w.close(timeout=5)


class ServerEngine:
    """llama.cpp's llama-server as a subprocess; timings from its responses."""

    def __init__(self, spec: EngineSpec, ctx: BenchContext) -> None:
        self.srv = LlamaServer(ctx.need_llama_server(), ctx.model, spec.args, log_path=ctx.server_log,
                               env=spec.env, start_timeout_s=ctx.timeout_s, request_timeout_s=ctx.timeout_s)

    def start(self) -> float:
        return self.srv.start()

    def run(self, prompt: list[int], n_gen: int) -> TrialTiming:
        return server_timing(self.srv.timed_completion(prompt, n_gen))

    def stop(self) -> None:
        self.srv.stop()


ENGINES: dict[EngineKind, Callable[[EngineSpec, BenchContext], Engine]] = {
    "worker": WorkerEngine, "llama-server": ServerEngine}


def make_engine(spec: EngineSpec, ctx: BenchContext) -> Engine:
    """A new, not yet started engine for ``spec``."""
    return ENGINES[spec.kind](spec, ctx)


def plan_engine(ctx: BenchContext) -> EngineSpec:
    """The plan itself, through the native engine."""
    return EngineSpec(name="plan", kind="worker", params=ctx.params, note=" ".join(ctx.params.cli_args()))


def llama_cpp_python_defaults(params: EngineParams, cpu_count: int | None = None) -> EngineParams:
    """What ``Llama(model, n_ctx=...)`` uses: n_batch = n_ubatch = 512, threads cpu//2 / cpu, no FA, f16 KV, mmap, CPU."""
    cpus = cpu_count or os.cpu_count() or 1
    return EngineParams(n_ctx=params.n_ctx, n_seq_max=params.n_seq_max, n_batch=512, n_ubatch=512,
                        n_threads=max(cpus // 2, 1), n_threads_batch=cpus, n_gpu_layers=0, flash_attn=False,
                        type_k="f16", type_v="f16", load_mode="mmap", seed=params.seed)


def fit_server_args(params: EngineParams) -> tuple[str, ...]:
    """llama-server with its automatic fit: only context and slots (-ngl/-ot would turn fit off).

    The plan's ``n_ctx`` is per sequence; llama-server splits ``-c`` among its ``-np`` slots.
    """
    return ("-c", str(params.n_ctx * params.n_seq_max), "-np", str(params.n_seq_max))
