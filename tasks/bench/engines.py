"""The engines a race starts fresh in every round, and the baselines' parameters.

The plan and the llama-cpp-python defaults run in fresh engine workers (``timed_run``: llama.cpp's perf
counters); llama.cpp's ``llama-server`` runs as a subprocess (its own ``timings``). Both are normalized to one
definition of a trial (:class:`TrialTiming`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.llama_server import LlamaServer, ServerTimings
from tasks.bench.context import BenchContext
from tasks.bench.errors import BenchError

EngineKind = Literal["worker", "llama-server"]


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class EngineSpec(_Model):
    """An engine configuration that a race can start fresh in every round."""

    name: str
    kind: EngineKind
    params: EngineParams | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)
    note: str = ""
    draft: Drafting | None = Field(None, description="a worker engine drafts its greedy decoding this way")


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
        self.params, self.ctx, self.draft = spec.params, ctx, spec.draft
        self.w = WorkerClient(log_path=ctx.worker_log, env={**spec.params.environment(), **spec.env})

    def start(self) -> float:
        self.w.start()
        got = self.w.request(ops.LOAD, ops.LoadArgs(model=str(self.ctx.model), params=self.params), self.ctx.timeout_s)
        return got.load_ms / 1e3

    def run(self, prompt: list[int], n_gen: int) -> TrialTiming:
        d = self.draft
        if d is None:
            return worker_timing(self.w.request(ops.TIMED_RUN, ops.TimedRunArgs(prompt=prompt, n_gen=n_gen),
                                                self.ctx.timeout_s))
        got = self.w.request(ops.SPEC_GREEDY, ops.SpecGreedyArgs(  # n_gen + 1: the prefill's token, then n_gen
            prompt=prompt, n_gen=n_gen + 1, draft_model=d.model if d.kind == "model" else None,
            ngram=d.ngram if d.kind == "ngram" else 0, n_draft=d.n_draft), self.ctx.timeout_s)
        return TrialTiming(prompt_tokens=len(prompt), prompt_ms=got.prompt_ms, gen_tokens=len(got.tokens) - 1,
                           gen_ms=got.gen_ms, source=f"worker wall clock, drafted ({d.kind})")

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
    """The plan itself, through its engine (the native worker, or llama-server with the plan's flags), drafting
    as the plan drafts."""
    d = ctx.plan.candidate.draft
    if ctx.plan.engine is not None and ctx.plan.engine.kind == "llama-server":
        return server_spec("plan", ctx.params, d)
    return EngineSpec(name="plan", kind="worker", params=ctx.params, draft=d, note=" ".join(ctx.params.cli_args())
                      + (f" drafting {d.kind}" if d else ""))


def server_spec(name: str, params: EngineParams, draft: Drafting | None = None) -> EngineSpec:
    """llama-server with a placement's flags and environment (FLUX_MOE_SPLIT), as ``flux plan --engines`` starts it,
    drafting as ``draft`` says."""
    args = [*params.server_args(), *(draft.server_args(params) if draft is not None else [])]
    return EngineSpec(name=name, kind="llama-server", params=params, args=tuple(args), env=params.environment(),
                      note="llama-server " + " ".join(args))


def other_engine(ctx: BenchContext, name: str = "other-engine") -> EngineSpec:
    """The plan's placement on the engine it was not planned for: llama-server for a native plan, the native
    worker for a llama-server plan; drafting as the plan does where that engine can (a next-token head drafts
    on llama-server only, and llama-server loads no draft file beside a per-expert split)."""
    d = ctx.plan.candidate.draft
    if ctx.plan.engine is not None and ctx.plan.engine.kind == "llama-server":
        d = d if d is not None and d.kind != "mtp" else None
        return EngineSpec(name=name, kind="worker", params=ctx.params, draft=d,
                          note="native worker, the plan's parameters" + (f", drafting {d.kind}" if d else ""))
    # llama-server applies a per-expert split to every model it loads: no draft file beside one
    return server_spec(name, ctx.params, None if d is not None and d.model and ctx.params.expert_split else d)


def no_drafting(ctx: BenchContext, name: str) -> EngineSpec:
    """The plan's placement on its own engine without its drafting."""
    if ctx.plan.engine is not None and ctx.plan.engine.kind == "llama-server":
        return server_spec(name, ctx.params)
    return EngineSpec(name=name, kind="worker", params=ctx.params, note="the plan without drafting")


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
