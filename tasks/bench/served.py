"""``flux bench run --via serve``: the plan as ``flux serve`` serves it, raced against llama-server at the
plan's own GPU budget and context.

Contenders, each started once and kept loaded for the whole race (on a GPU the loads dominate otherwise):

* ``plan``: ``flux serve <plan>`` (what a user runs), its worker loaded with the plan's parameters;
* ``fit``: llama-server with its automatic fit (``--fit on``), told to leave all but the budget free
  (``--fit-target`` = free memory minus the budget) and to hold the plan's context (``-c`` and ``-fitc``
  both the plan's, so it cannot shrink the context to make room, which it otherwise does first);
* ``n-cpu-moe``: llama-server ``-ngl 999 --n-cpu-moe N`` with the smallest N whose *measured* GPU memory
  fits the budget (MoE models);
* ``most-ngl``: llama-server with the most ``-ngl`` layers whose measured GPU memory fits.

Every contender is timed by the same client through the same endpoint (``/v1/completions``, streamed,
greedy, a fresh prompt each turn so that no prompt cache helps): prefill is the time to the first token,
decode the generated tokens after it over their time. Each contender first runs one untimed full-size turn
(a cold first turn ran at 45% speed on the H200); rounds shuffle the order. A sweep's reading of a
configuration is compared with its reading in the race: more than :data:`AGREE` apart, the sweep reading is
reported as discarded (cold) and the race's stands.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from artifacts.model_info import ModelInfo, model_info
from engine_bridge.gpumem import GpuMemoryMeter
from engine_bridge.llama_server import LlamaServer
from tasks.bench.common import BenchContext, BenchError, Progress, TrialTiming
from tasks.bench.http import FluxServe, client_limits

log = logging.getLogger(__name__)
GIB, MIB = 2**30, 2**20
AGREE = 0.05  # two readings of one configuration in one run must agree within this, or the cold one goes
TRIAL_SCHEMA = pa.schema([
    ("engine", pa.string()), ("round", pa.int32()), ("turn", pa.int32()), ("prompt_tokens", pa.int32()),
    ("prompt_ms", pa.float64()), ("gen_tokens", pa.int32()), ("gen_ms", pa.float64()),
    ("prefill_tps", pa.float64()), ("decode_tps", pa.float64()), ("turn_s", pa.float64()),
    ("gpu_bytes", pa.int64()), ("error", pa.string()),
])


class Turn(BaseModel):
    """One request of the race: a prompt of ``prompt`` tokens and ``gen`` generated tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    prompt: int
    gen: int


# pp512 / tg128 (a short prompt, a long reply) and an agent's turn (a long prompt, a short reply)
DEFAULT_TURNS = (Turn(name="pp512-tg128", prompt=512, gen=128), Turn(name="agent", prompt=2048, gen=32))


def streamed_completion(base: str, prompt: Sequence[int], n_gen: int, timeout_s: float) -> TrialTiming:
    """POST /v1/completions (streamed, greedy, EOS ignored where the engine honours it), timed by the client.

    ``prompt_ms``: request sent to first generated text; ``gen_ms``: first to last generated text, over
    ``completion_tokens - 1`` steps (the usage chunk's count).
    """
    body = {"prompt": list(prompt), "max_tokens": n_gen, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "cache_prompt": False}
    t0 = time.perf_counter()
    first = last = None
    n_tokens = 0
    with httpx.Client(timeout=timeout_s, limits=client_limits()) as client, \
            client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise BenchError(f"{base}: HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            chunk = json.loads(line[5:])
            if any((c.get("text") or "") for c in chunk.get("choices") or []):
                last = time.perf_counter()
                first = first or last
            usage = chunk.get("usage") or {}
            n_tokens = int(usage.get("completion_tokens") or n_tokens)
    if first is None or last is None:
        raise BenchError(f"{base}: the stream carried no generated text")
    return TrialTiming(prompt_tokens=len(prompt), prompt_ms=(first - t0) * 1e3, gen_tokens=max(0, n_tokens - 1),
                       gen_ms=(last - first) * 1e3, source="client stream (/v1/completions)")


def _tree_gpu_bytes(meter: GpuMemoryMeter, pid: int | None) -> int | None:
    """GPU memory held by ``pid`` and its children (flux serve's worker is a child process)."""
    if pid is None or not meter.available:
        return None
    try:
        pids = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        pids = [pid]
    per = [meter.used_by(p) for p in pids]
    known = [u for u in per if u]
    return max(sum(sum(u) for u in known), 0) if known else None


@dataclass
class Contender:
    """One engine in the race: how to start it, and once started, where it listens."""

    name: str
    note: str
    start_fn: Callable[[], tuple[str, int | None, Callable[[], None]]]
    base: str = ""
    pid: int | None = None
    stop_fn: Callable[[], None] | None = None
    gpu_bytes: int | None = None
    readings: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        """Start the engine and wait until it answers."""
        self.base, self.pid, self.stop_fn = self.start_fn()

    def stop(self) -> None:
        """Stop it (idempotent)."""
        if self.stop_fn is not None:
            self.stop_fn()
            self.stop_fn = None


def plan_contender(ctx: BenchContext) -> Contender:
    """``flux serve`` of the plan."""
    def start() -> tuple[str, int | None, Callable[[], None]]:
        srv = FluxServe(ctx.settings, ctx.plan.id, log_path=ctx.settings.logs_dir / "bench-serve.log",
                        start_timeout_s=ctx.settings.serve.worker_timeouts.load_s)
        srv.start()
        return srv.base, srv.proc.pid if srv.proc else None, srv.stop

    return Contender("plan", f"flux serve {ctx.plan.id[:12]}: " + " ".join(ctx.params.cli_args()), start)


def server_contender(ctx: BenchContext, name: str, args: Sequence[str], note: str) -> Contender:
    """llama-server of the plan's model with ``args``."""
    def start() -> tuple[str, int | None, Callable[[], None]]:
        srv = LlamaServer(ctx.need_llama_server(), ctx.model, args, log_path=ctx.server_log,
                          start_timeout_s=ctx.settings.serve.worker_timeouts.load_s, request_timeout_s=ctx.timeout_s)
        srv.start()
        return f"http://127.0.0.1:{srv.port}", srv.pid, srv.stop

    return Contender(name, note, start)


def _common_args(ctx: BenchContext) -> list[str]:
    """The plan's context, threads and flash attention, for every llama-server contender."""
    p = ctx.params
    return ["-c", str(p.n_ctx * p.n_seq_max), "-np", str(p.n_seq_max), "-t", str(p.n_threads),
            "-fa", "on" if p.flash_attn else "off", "--no-warmup"]


def gpu_free() -> list[int]:
    """Free bytes on each GPU now (NVML), [] without one."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free)
                    for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no GPU, no driver: nothing to fit
        return []


def fit_contender(ctx: BenchContext, budget: int | None) -> Contender:
    """llama-server's own fit at the budget, holding the plan's context."""
    args = [*_common_args(ctx), "--fit", "on", "-fitc", str(ctx.params.n_ctx * ctx.params.n_seq_max)]
    free = gpu_free()
    if budget and free:
        args += ["--fit-target", ",".join(str(max(0, (f - budget) // MIB)) for f in free)]
    return server_contender(ctx, "fit", args, "llama-server " + " ".join(args))


@dataclass
class Probe:
    """One configuration started alone: its measured GPU memory and warm speed on the first turn."""

    args: list[str]
    gpu_bytes: int | None
    timing: TrialTiming | None


def probe_config(ctx: BenchContext, args: list[str], prompts: list[list[int]], turn: Turn) -> Probe:
    """Start llama-server with ``args`` alone, warm it up, time one turn, read its GPU memory, stop it."""
    c = server_contender(ctx, "probe", args, "")
    meter = GpuMemoryMeter()
    try:
        c.start()
        streamed_completion(c.base, prompts[0], turn.gen, ctx.timeout_s)  # warm-up, untimed
        t = streamed_completion(c.base, prompts[1], turn.gen, ctx.timeout_s)
        return Probe(args, _tree_gpu_bytes(meter, c.pid), t)
    except Exception as exc:  # noqa: BLE001 - a configuration that fails to start is a skipped point
        log.warning("bench: %s failed: %s", " ".join(args), exc)
        return Probe(args, None, None)
    finally:
        c.stop()


def _fits(p: Probe, budget: int | None) -> bool:
    return p.timing is not None and (not budget or (p.gpu_bytes is not None and p.gpu_bytes <= budget))


def sweep_n_cpu_moe(ctx: BenchContext, info: ModelInfo, budget: int | None, prompts: list[list[int]], turn: Turn,
                    progress: Progress) -> tuple[Contender, Probe] | str:
    """The smallest ``--n-cpu-moe`` whose measured GPU memory fits (each step only moves experts off the GPU)."""
    per_layer = max(1, max(sum(b for r, b in layer.bytes_by_role.items() if r.startswith("experts_"))
                           for layer in info.layers))
    n = 0 if not budget else max(0, min(info.n_layer, -(-(info.weight_bytes - budget) // per_layer)))
    seen: set[int] = set()
    while 0 <= n <= info.n_layer and n not in seen:
        seen.add(n)
        p = probe_config(ctx, [*_common_args(ctx), "-ngl", "999", "--n-cpu-moe", str(n)], prompts, turn)
        progress(f"n-cpu-moe {n}: GPU {(p.gpu_bytes or 0) / GIB:.2f} GiB, decode "
                 f"{(p.timing.gen_tokens / p.timing.gen_ms * 1e3) if p.timing and p.timing.gen_ms else 0:.1f} tok/s")
        if _fits(p, budget):
            c = server_contender(ctx, "n-cpu-moe", p.args, "llama-server " + " ".join(p.args))
            return c, p
        over = (p.gpu_bytes or 0) - (budget or 0)
        n += max(1, -(-over // per_layer)) if p.gpu_bytes else 1
    return f"n/a: no --n-cpu-moe fits {budget / GIB if budget else 0:.1f} GiB"


def most_layers(ctx: BenchContext, info: ModelInfo, budget: int | None, prompts: list[list[int]], turn: Turn,
                progress: Progress) -> tuple[Contender, Probe] | str:
    """The most ``-ngl`` layers whose measured GPU memory fits."""
    per_layer = max(1, max(layer.total_bytes for layer in info.layers))
    k = info.n_layer + 1 if not budget else max(0, min(info.n_layer + 1, budget // per_layer))
    seen: set[int] = set()
    while 0 <= k <= info.n_layer + 1 and k not in seen:
        seen.add(k)
        p = probe_config(ctx, [*_common_args(ctx), "-ngl", str(k)], prompts, turn)
        progress(f"-ngl {k}: GPU {(p.gpu_bytes or 0) / GIB:.2f} GiB")
        if _fits(p, budget):
            return server_contender(ctx, "most-ngl", p.args, "llama-server " + " ".join(p.args)), p
        over = (p.gpu_bytes or 0) - (budget or 0)
        k -= max(1, -(-over // per_layer)) if p.gpu_bytes else 1
    return f"n/a: no -ngl fits {budget / GIB if budget else 0:.1f} GiB"


def race_loaded(contenders: list[Contender], prompts: dict[str, list[list[int]]], turns: Sequence[Turn],
                rounds: int, timeout_s: float, seed: int, progress: Progress) -> pa.Table:
    """Every contender started once (and measured), warmed with one full turn, then timed in shuffled rounds.

    ``prompts[turn.name]`` holds one distinct prompt per (contender, round) visit plus one for the warm-up.
    """
    meter = GpuMemoryMeter()
    rows: list[dict[str, Any]] = []
    live: list[Contender] = []
    for i, c in enumerate(contenders):
        try:
            meter.rebase()
            c.start()
            for t in turns:  # warm-up: one untimed full-size turn of each kind
                streamed_completion(c.base, prompts[t.name][-1 - i], t.gen, timeout_s)
            c.gpu_bytes = _tree_gpu_bytes(meter, c.pid)
            live.append(c)
            progress(f"{c.name}: started, GPU {(c.gpu_bytes or 0) / GIB:.2f} GiB ({c.note})")
        except Exception as exc:  # noqa: BLE001 - a contender that fails to start is an error row
            rows.append({"engine": c.name, "round": -1, "turn": -1, "error": f"{type(exc).__name__}: {exc}"[:500]})
            c.stop()
    rng = random.Random(seed)
    visit = 0
    try:
        for rnd in range(rounds):
            order = live[:]
            rng.shuffle(order)
            for c in order:
                for j, t in enumerate(turns):
                    prompt = prompts[t.name][visit % (len(prompts[t.name]) - len(contenders))]
                    rows.append(_timed_row(c, rnd, j, prompt, t, timeout_s))
                visit += 1
            progress(f"round {rnd + 1}/{rounds} done")
    finally:
        for c in contenders:
            c.stop()
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in TRIAL_SCHEMA} for r in rows], schema=TRIAL_SCHEMA)


def _timed_row(c: Contender, rnd: int, j: int, prompt: list[int], t: Turn, timeout_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {"engine": c.name, "round": rnd, "turn": j, "gpu_bytes": c.gpu_bytes}
    try:
        tm = streamed_completion(c.base, prompt, t.gen, timeout_s)
    except Exception as exc:  # noqa: BLE001 - one failed request is a row, the race goes on
        return {**row, "error": f"{type(exc).__name__}: {exc}"[:500]}
    return {**row, "prompt_tokens": tm.prompt_tokens, "prompt_ms": tm.prompt_ms, "gen_tokens": tm.gen_tokens,
            "gen_ms": tm.gen_ms, "prefill_tps": tm.prompt_tokens / tm.prompt_ms * 1e3 if tm.prompt_ms else None,
            "decode_tps": tm.gen_tokens / tm.gen_ms * 1e3 if tm.gen_ms else None,
            "turn_s": (tm.prompt_ms + tm.gen_ms) / 1e3}


def medians(table: pa.Table, engine: str, turn: int) -> dict[str, float]:
    """Median prefill and decode speed and turn seconds of one engine on one turn."""
    rows = [r for r in table.to_pylist() if r["engine"] == engine and r["turn"] == turn and not r["error"]]
    out = {}
    for k in ("prefill_tps", "decode_tps", "turn_s"):
        xs = [r[k] for r in rows if r[k]]
        if xs:
            out[k] = statistics.median(xs)
    return out


def agreement(sweep: Probe | None, raced: dict[str, float]) -> tuple[float | None, str | None]:
    """(relative difference, note) of a sweep's decode reading against the race's for one configuration."""
    if sweep is None or sweep.timing is None or not sweep.timing.gen_ms or not raced.get("decode_tps"):
        return None, None
    swept = sweep.timing.gen_tokens / sweep.timing.gen_ms * 1e3
    diff = abs(swept - raced["decode_tps"]) / raced["decode_tps"]
    if diff <= AGREE:
        return diff, None
    return diff, (f"sweep read {swept:.1f} tok/s decode, the race {raced['decode_tps']:.1f} ({diff:.0%} apart, more "
                  f"than {AGREE:.0%}): the sweep's single reading is discarded, the race's stands")


def model_of(ctx: BenchContext) -> ModelInfo:
    """The plan's model header (cheap)."""
    return model_info(ctx.model)


def _prompts(ctx: BenchContext, turns: Sequence[Turn], n: int, seed: int) -> dict[str, list[list[int]]]:
    """``n`` distinct corpus prompts per turn, in the model's tokens."""
    from tasks.bench.run import tokenize_prompts

    return {t.name: tokenize_prompts(ctx, [t.prompt] * n, "held_out", seed + k) for k, t in enumerate(turns)}


def _row(name: str, c: Contender, table: pa.Table, turns: Sequence[Turn], opts: Any,
         extra: dict[str, Any]) -> Any:
    """Plan vs one contender: paired ratios per turn (same round), a verdict on the first turn's speeds."""
    from tasks.bench.common import SummaryRow, paired_ratio
    from tasks.bench.run import ratio_row

    def pair(turn: int, metric: str) -> tuple[list[float], list[float]]:
        by: dict[str, dict[int, float]] = {"plan": {}, name: {}}
        for r in table.to_pylist():
            if r["engine"] in by and r["turn"] == turn and not r["error"] and r[metric]:
                by[r["engine"]][r["round"]] = r[metric]
        keys = sorted(by["plan"].keys() & by[name].keys())
        return [by["plan"][k] for k in keys], [by[name][k] for k in keys]

    if not pair(0, "decode_tps")[0]:
        return SummaryRow(baseline=name, verdict="info", detail=f"no paired turns with {name}", metrics=extra)
    pre = paired_ratio(*pair(0, "prefill_tps"), n_boot=opts.n_boot, seed=opts.seed)
    dec = paired_ratio(*pair(0, "decode_tps"), n_boot=opts.n_boot, seed=opts.seed + 1)
    per_turn = {}
    for j, t in enumerate(turns):
        plan_s, base_s = pair(j, "turn_s")
        ratio = paired_ratio(base_s, plan_s, n_boot=opts.n_boot, seed=opts.seed + 2 + j) if plan_s else None
        per_turn[t.name] = {"plan": medians(table, "plan", j), name: medians(table, name, j),
                            "turn_speedup": ratio.model_dump() if ratio else None}
    metrics = {**extra, "per_turn": per_turn, "engine_note": c.note, "baseline_gpu_bytes": c.gpu_bytes}
    slower = "slower" in (pre.outcome, dec.outcome)
    detail = f"{turns[0].name}: prefill {pre.outcome} {pre.text()}, decode {dec.outcome} {dec.text()}"
    return ratio_row(name, pre, dec, "fail" if slower else "pass", detail, metrics)


def bench_served(ctx: BenchContext, opts: Any, progress: Progress | None = None) -> Any:
    """The served race (module docstring); one summary row per baseline."""
    from tasks.bench.common import BenchRun, SummaryRow

    say = progress or log.info
    asked = tuple(Turn(name=f"p{p}-g{g}", prompt=p, gen=g) for p, g in opts.turns) if opts.turns else DEFAULT_TURNS
    room = ctx.params.n_ctx - 16  # a turn must fit the plan's context, with its reply
    turns = tuple(t if t.prompt + t.gen <= room else t.model_copy(update={"prompt": max(8, room - t.gen)})
                  for t in asked)
    budget_gib = opts.gpu_mem_budget_gib if opts.gpu_mem_budget_gib is not None else ctx.plan.request.gpu_mem_budget_gib
    budget = int(max(budget_gib) * GIB) if budget_gib else None
    info = model_of(ctx)
    n_prompts = opts.rounds * (len(opts.baselines) + 1) + len(opts.baselines) + 3
    prompts = _prompts(ctx, turns, n_prompts, opts.seed)
    sweep_prompts = prompts[turns[0].name][-2:]
    contenders: list[Contender] = [plan_contender(ctx)]
    probes: dict[str, Probe] = {}
    skipped: dict[str, str] = {}
    t0 = time.monotonic()
    for name in opts.baselines:
        if name == "fit":
            contenders.append(fit_contender(ctx, budget))
            continue
        finder = {"n-cpu-moe": sweep_n_cpu_moe, "most-ngl": most_layers}.get(name)
        if finder is None:
            raise BenchError(f"unknown baseline {name!r} for --via serve: choose from fit, n-cpu-moe, most-ngl")
        if name == "n-cpu-moe" and not info.is_moe:
            skipped[name] = "n/a: dense model (no experts)"
            continue
        got = finder(ctx, info, budget, sweep_prompts, turns[0], say)
        if isinstance(got, str):
            skipped[name] = got
            continue
        contenders.append(got[0])
        probes[name] = got[1]
    table = race_loaded(contenders, prompts, turns, opts.rounds, ctx.timeout_s, opts.seed, say)
    plan_c = contenders[0]
    served = medians(table, "plan", 0)
    common: dict[str, Any] = {
        "options": opts.model_dump(mode="json"), "turn_specs": [t.model_dump() for t in turns],
        "budget_gib": max(budget_gib) if budget_gib else None, "ctx": ctx.params.n_ctx, "seconds": time.monotonic() - t0,
        "plan_gpu_bytes": plan_c.gpu_bytes, "plan_measured_decode_tps": ctx.plan.measured.decode_tps,
        "plan_measured_prefill_tps": ctx.plan.measured.prefill_tps, "served_decode_tps": served.get("decode_tps"),
        "plan_backend_build": ctx.plan.backend_build, "timing": "client stream (/v1/completions)"}
    rows = []
    for c in contenders[1:]:
        diff, note = agreement(probes.get(c.name), medians(table, c.name, 0))
        extra = {**common, "sweep_vs_race": diff, "sweep_note": note}
        if note:
            say(f"{c.name}: {note}")
        rows.append(_row(c.name, c, table, turns, opts, extra))
    rows += [SummaryRow(baseline=name, verdict="info", detail=why, metrics=common) for name, why in skipped.items()]
    return BenchRun(suite="run", ctx=ctx, rows=rows, raw=table)
