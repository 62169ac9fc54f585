"""The contenders of ``flux bench run --via serve`` (tasks/bench/served.py) and how each is found and timed.

``plan`` is ``flux serve`` of the plan; ``fit`` is llama-server's own fit at the plan's budget and context;
``n-cpu-moe`` and ``most-ngl`` are found by starting llama-server alone with one configuration after another
and measuring its GPU memory (:func:`probe_config`), not by predicting it. :func:`streamed_completion` is the
one client every contender is timed through.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from artifacts.model_info import ModelInfo
from engine_bridge.gpumem import GpuMemoryMeter, GpuReading
from engine_bridge.llama_server import LlamaServer, ServerTimings
from tasks.bench.context import BenchContext, Progress
from tasks.bench.engines import TrialTiming, server_timing
from tasks.bench.errors import BenchError
from tasks.bench.http import FluxServe, client_limits

log = logging.getLogger(__name__)
GIB, MIB = 2**30, 2**20


class Turn(BaseModel):
    """One request of the race: a prompt of ``prompt`` tokens and ``gen`` generated tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    prompt: int
    gen: int


# pp512 / tg128 (a short prompt, a long reply) and an agent's turn (a long prompt, a short reply)
DEFAULT_TURNS = (Turn(name="pp512-tg128", prompt=512, gen=128), Turn(name="agent", prompt=2048, gen=32))


class StreamTiming(TrialTiming):
    """A streamed completion timed by the client, with the server's own timing of it where the stream's last
    chunk carries one (llama-server's ``timings``: measured inside llama.cpp; ``flux serve`` sends none)."""

    server: TrialTiming | None = None


def streamed_completion(base: str, prompt: Sequence[int], n_gen: int, timeout_s: float) -> StreamTiming:
    """POST /v1/completions (streamed, greedy, EOS ignored where the engine honours it, no prompt cache where the
    engine honours it), timed by the client.

    ``prompt_ms``: request sent to first generated text; ``gen_ms``: first to last generated text, over
    ``completion_tokens - 1`` steps (the usage chunk's count). ``server``: the server's own timing, if it sent one.
    """
    body = {"prompt": list(prompt), "max_tokens": n_gen, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "cache_prompt": False}
    t0 = time.perf_counter()
    first = last = None
    n_tokens = 0
    timings: dict[str, float] | None = None
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
            timings = chunk.get("timings") or timings
    if first is None or last is None:
        raise BenchError(f"{base}: the stream carried no generated text")
    return StreamTiming(prompt_tokens=len(prompt), prompt_ms=(first - t0) * 1e3, gen_tokens=max(0, n_tokens - 1),
                        gen_ms=(last - first) * 1e3, source="client stream (/v1/completions)",
                        server=_server_timing(timings))


def _server_timing(timings: dict[str, float] | None) -> TrialTiming | None:
    """The server's ``timings`` object as a trial timing (llama-server's normalization), or None."""
    if not timings:
        return None
    try:
        return server_timing(ServerTimings.model_validate(timings))
    except ValidationError:
        return None


def served_context(base: str, timeout_s: float = 10.0) -> int | None:
    """The context a started server holds per sequence, as ``GET /v1/models`` says (``meta.n_ctx``: llama-server's
    slot context, which ``--fit`` may have shrunk; ``flux serve``'s plan context), or None when it does not say."""
    try:
        with httpx.Client(timeout=timeout_s) as client:
            cards = client.get(f"{base}/v1/models").json().get("data") or []
        n_ctx = (cards[0].get("meta") or {}).get("n_ctx") if cards else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return int(n_ctx) if isinstance(n_ctx, int | float) and n_ctx > 0 else None


# fit overshot the memory it was told to use by 0.11-0.15 GiB on the H200 (8.11 of 8, 12.15 of 12, 16.14 of
# 16 GiB), which flags it; it is told to use this much less, so that it lands inside its budget.
FIT_SLACK = 256 * MIB
# A contender holding less than this share of its budget is not a fair baseline (it was starved or misread).
MIN_BUDGET_SHARE = 0.85


def budget_flag(reading: GpuReading | None, budget: int | None) -> str | None:
    """Why a contender's measured GPU memory makes its race no result at ``budget`` bytes, or ``None``.

    Under :data:`MIN_BUDGET_SHARE` of the budget, the contender did not get the memory the comparison is
    about (llama-server's fit told to leave the plan's memory free twice, say); over it, it had more. An
    unread memory (no NVML) cannot be checked: flagged too, since no equal-memory claim can rest on it.
    """
    if not budget:
        return None
    if reading is None:
        return "its GPU memory could not be read (no NVML figure): no equal-memory claim"
    held = reading.total
    if held > budget:
        return f"held {held / GIB:.2f} GiB, over the {budget / GIB:.2f} GiB budget"
    if held < MIN_BUDGET_SHARE * budget:
        return (f"held {held / GIB:.2f} GiB, {held / budget:.0%} of the {budget / GIB:.2f} GiB budget "
                f"(under {MIN_BUDGET_SHARE:.0%}: starved, not an equal-memory baseline)")
    return None


@dataclass
class Contender:
    """One engine in the race: how to start it, and once started, where it listens."""

    name: str
    note: str
    start_fn: Callable[[], tuple[str, int | None, Callable[[], None]]]
    base: str = ""
    pid: int | None = None
    stop_fn: Callable[[], None] | None = None
    gpu: GpuReading | None = None
    flag: str | None = None
    readings: dict[str, float] = field(default_factory=dict)
    n_ctx: int | None = None  # tokens a sequence holds, as the started server says (:func:`served_context`)

    @property
    def gpu_bytes(self) -> int | None:
        """Bytes it held on every GPU once warm (NVML), ``None`` when unread."""
        return self.gpu.total if self.gpu else None

    def start(self) -> None:
        """Start the engine and wait until it answers (a failed start leaves no pid of an earlier visit), then
        read the context it holds (``--fit`` may shrink it from one start to the next)."""
        self.base, self.pid, self.n_ctx = "", None, None
        self.base, self.pid, self.stop_fn = self.start_fn()
        self.n_ctx = served_context(self.base) if self.base else None

    def holds(self, turn: Turn) -> bool:
        """Whether its context holds ``turn``'s prompt and reply (unknown: it is tried)."""
        return self.n_ctx is None or turn.prompt + turn.gen <= self.n_ctx

    def stop(self) -> None:
        """Stop it (idempotent); its pid is forgotten, since the process is gone."""
        if self.stop_fn is not None:
            self.stop_fn()
            self.stop_fn = None
        self.pid = None


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


@dataclass
class BaselineThreads:
    """The ``-t`` of every llama-server contender: the plan's thread count until :func:`pick_threads` finds
    that every physical core decodes the first baseline found faster. A baseline with its experts on the host
    is CPU-bound and may want more threads than the plan chose for itself (H200 run 12 raced its 8 GiB
    baselines at the plan's 8 threads of 16)."""

    n: int
    note: str = ""


def _common_args(ctx: BenchContext, threads: int | None = None) -> list[str]:
    """The plan's context and flash attention, and ``threads`` (default: the plan's), for every llama-server
    contender."""
    p = ctx.params
    return ["-c", str(p.n_ctx * p.n_seq_max), "-np", str(p.n_seq_max), "-t", str(threads or p.n_threads),
            "-fa", "on" if p.flash_attn else "off", "--no-warmup"]


def fit_args(ctx: BenchContext, budget: int | None, free: list[int], threads: int | None = None) -> list[str]:
    """llama-server's fit holding the plan's context, told to leave all but ``budget`` of ``free`` free.

    ``free`` must be read right before the server starts: fit leaves ``--fit-target`` MiB free on each GPU,
    so a target computed while another process held memory it has since freed (or before one loaded) gives
    fit the wrong share (the 0.92 GiB of a 14 GiB budget seen on the H200, when contenders were co-resident).
    The race now runs each contender alone, so ``free`` is read with nothing else of the race loaded.
    """
    args = [*_common_args(ctx, threads), "--fit", "on", "-fitc", str(ctx.params.n_ctx * ctx.params.n_seq_max)]
    if budget and free:
        args += ["--fit-target", ",".join(str(max(0, (f - budget + FIT_SLACK) // MIB)) for f in free)]
    return args


def fit_contender(ctx: BenchContext, budget: int | None, meter: GpuMemoryMeter,
                  threads: BaselineThreads | None = None) -> Contender:
    """llama-server's own fit at the budget, holding the plan's context; its target is derived from the
    memory free when it starts (:func:`fit_args`), its threads are ``threads`` as they stand then."""
    c = Contender("fit", "llama-server --fit on (target set when it starts)", lambda: ("", None, lambda: None))

    def start() -> tuple[str, int | None, Callable[[], None]]:
        free = meter.device_free()
        args = fit_args(ctx, budget, free, threads.n if threads else None)
        c.note = "llama-server " + " ".join(args) + (
            f" (free at start: {', '.join(f'{f / GIB:.2f}' for f in free)} GiB)" if free else "")
        return server_contender(ctx, "fit", args, c.note).start_fn()

    c.start_fn = start
    return c


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
        reading = meter.read(c.pid)
        return Probe(args, reading.total if reading else None, t)
    except Exception as exc:  # noqa: BLE001 - a configuration that fails to start is a skipped point
        log.warning("bench: %s failed: %s", " ".join(args), exc)
        return Probe(args, None, None)
    finally:
        c.stop()


def _fits(p: Probe, budget: int | None) -> bool:
    return p.timing is not None and (not budget or (p.gpu_bytes is not None and p.gpu_bytes <= budget))


def _decode_rate(p: Probe) -> float:
    """A probe's decode tokens per second (0 when it did not run)."""
    t = p.timing
    return t.gen_tokens / t.gen_ms * 1e3 if t and t.gen_ms else 0.0


def sweep_n_cpu_moe(ctx: BenchContext, info: ModelInfo, budget: int | None, prompts: list[list[int]], turn: Turn,
                    progress: Progress, threads: int | None = None) -> tuple[Contender, Probe] | str:
    """The smallest ``--n-cpu-moe`` whose measured GPU memory fits (each step only moves experts off the GPU)."""
    per_layer = max(1, max(sum(b for r, b in layer.bytes_by_role.items() if r.startswith("experts_"))
                           for layer in info.layers))
    n = 0 if not budget else max(0, min(info.n_layer, -(-(info.weight_bytes - budget) // per_layer)))
    seen: set[int] = set()
    while 0 <= n <= info.n_layer and n not in seen:
        seen.add(n)
        p = probe_config(ctx, [*_common_args(ctx, threads), "-ngl", "999", "--n-cpu-moe", str(n)], prompts, turn)
        progress(f"n-cpu-moe {n}: GPU {(p.gpu_bytes or 0) / GIB:.2f} GiB, decode {_decode_rate(p):.1f} tok/s")
        if _fits(p, budget):
            c = server_contender(ctx, "n-cpu-moe", p.args, "llama-server " + " ".join(p.args))
            return c, p
        over = (p.gpu_bytes or 0) - (budget or 0)
        n += max(1, -(-over // per_layer)) if p.gpu_bytes else 1
    return f"n/a: no --n-cpu-moe fits {budget / GIB if budget else 0:.1f} GiB"


def most_layers(ctx: BenchContext, info: ModelInfo, budget: int | None, prompts: list[list[int]], turn: Turn,
                progress: Progress, threads: int | None = None) -> tuple[Contender, Probe] | str:
    """The most ``-ngl`` layers whose measured GPU memory fits."""
    per_layer = max(1, max(layer.total_bytes for layer in info.layers))
    k = info.n_layer + 1 if not budget else max(0, min(info.n_layer + 1, budget // per_layer))
    seen: set[int] = set()
    while 0 <= k <= info.n_layer + 1 and k not in seen:
        seen.add(k)
        p = probe_config(ctx, [*_common_args(ctx, threads), "-ngl", str(k)], prompts, turn)
        progress(f"-ngl {k}: GPU {(p.gpu_bytes or 0) / GIB:.2f} GiB")
        if _fits(p, budget):
            return server_contender(ctx, "most-ngl", p.args, "llama-server " + " ".join(p.args)), p
        over = (p.gpu_bytes or 0) - (budget or 0)
        k -= max(1, -(-over // per_layer)) if p.gpu_bytes else 1
    return f"n/a: no -ngl fits {budget / GIB if budget else 0:.1f} GiB"


def pick_threads(ctx: BenchContext, found: tuple[Contender, Probe], threads: BaselineThreads, alt: int,
                 budget: int | None, prompts: list[list[int]], turn: Turn,
                 progress: Progress) -> tuple[Contender, Probe]:
    """Time the first baseline found again at ``alt`` threads; keep whichever decodes faster (by more than
    3%, a probe's noise) for it and every baseline after it (``threads`` is updated)."""
    contender, probe = found
    args = list(probe.args)
    if alt == threads.n or "-t" not in args or probe.timing is None:
        return found
    args[args.index("-t") + 1] = str(alt)
    other = probe_config(ctx, args, prompts, turn)
    a, b = _decode_rate(probe), _decode_rate(other)
    progress(f"{contender.name} at -t {threads.n}: {a:.1f} tok/s, at -t {alt}: {b:.1f} tok/s")
    if not _fits(other, budget) or b <= 1.03 * a:
        threads.note = f"baselines at -t {threads.n} (-t {alt} decoded {b:.1f} tok/s against {a:.1f})"
        return found
    threads.note = f"baselines at -t {alt}, the faster for them (-t {threads.n}: {a:.1f} tok/s, -t {alt}: {b:.1f})"
    threads.n = alt
    return server_contender(ctx, contender.name, other.args, "llama-server " + " ".join(other.args)), other
