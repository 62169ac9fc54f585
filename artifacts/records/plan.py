"""The plan (FFTW's wisdom) and the request it answers; its id is the content id of its body.

A plan is immutable: :func:`seal` gives it its id once, from every field (defaults included), and the server
refuses a plan whose body no longer hashes to its id (:func:`plan_id`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from artifacts.engine_params import KvType
from artifacts.engine_spec import EngineSpec
from artifacts.ids import content_id
from artifacts.records.base import Record
from artifacts.records.evidence import MeasureSummary, ValidationResult
from artifacts.records.search import Candidate, DeviceName, Prediction
from artifacts.records.serving import ServingChoice


class PlanRequest(Record):
    """What the user asked `flux plan` for (the planning flags).

    Every field is one flag of ``flux plan`` (:mod:`flows.request_flags` builds them): ``--field-name``, typed
    by the field, its choices from a ``Literal``, its help the field's description. ``json_schema_extra`` says
    where that differs: ``flag`` (another name; no leading dashes: positional; None: not a flag), ``short``
    (a short form, ``-d``) and ``setting`` (the ``[plan]`` setting that fills the field when the flag is left
    out). The fields but the excluded ones (how to run, not what to plan) are hashed into plan ids: keep their
    names and defaults.
    """

    model: str = Field(description="a .gguf file (default: a synthesized tiny-moe twin)",
                       json_schema_extra={"flag": "model"})
    ctx: int | None = Field(None, ge=16, description="tokens per sequence (default: trained context, capped by RAM)")
    concurrency: int = Field(1, ge=1, le=256, description=(
        "sequences served at once (with --serving-p95-ms: the most that are tried)"))
    serving_p95_ms: float | None = Field(None, gt=0, description=(
        "time 1, 2, 4, ... up to --concurrency sequences served together and keep the count with the most "
        "aggregate tokens/s whose p95 per-token latency is within this many ms"))
    kv: KvType = Field("f16", description="KV cache type; other than f16 is a separate quality profile")
    budget_s: float = Field(600.0, gt=0, description="measurement budget (default [plan] tuning_budget_s)",
                            json_schema_extra={"setting": "tuning_budget_s"})
    gpu_mem_budget_gib: list[float] | None = Field(None, description="GiB per GPU, e.g. 12 or 12,24",
                                                   json_schema_extra={"flag": "--gpu-mem-budget"})
    allow_storage_streaming: bool = Field(
        False, description="allow placements that read weights beyond RAM from the drive")
    workload: Literal["agent", "chat"] = Field("agent", description=(
        "what the plan is timed on: agent (long prompts, short replies; the default) or chat (a short message on "
        "a cached history, a long reply: decode-heavy)"))
    host_mem_budget_gib: float | None = Field(None, gt=0, description=(
        "GiB of this machine's RAM the plan may hold (default: available RAM minus the host reserve)"),
        json_schema_extra={"flag": "--host-mem-budget"})
    rpc: list[str] | None = Field(None, description=(
        "llama.cpp RPC servers host:port,... (started with `flux rpc-server`) whose devices the plan may use "
        "(default [rpc] servers)"))
    rpc_mem_budget_gib: list[float] | None = Field(None, description=(
        "GiB the plan may hold on each RPC server, in --rpc order (default: what each reports free)"),
        json_schema_extra={"flag": "--rpc-mem-budget"})
    engines: list[str] = Field(["native"], min_length=1, description=(
        "engines the finalists' placements are measured on, e.g. native,llama-server (a configured "
        "[engines.NAME] too); the fastest that passes validation serves the plan"))
    prefer_engine: str | None = Field(None, description=(
        "serve on this engine (one of --engines) when one of its finalists passes validation, even where another "
        "engine measured faster (its features, say); every engine is still measured and recorded"))
    speculation: bool = Field(False, description=(
        "also measure drafting (speculative decoding of greedy requests): with --draft-model, by prompt lookup "
        "for the agent workload, and with the model's next-token (MTP) heads (its own, or --heads) on "
        "llama-server; kept only when faster"))
    draft_model: str | None = Field(None, description=(
        "with --speculation: a draft model (.gguf) sharing the model's vocabulary, e.g. `flux synth --draft-of`"))
    heads: str | None = Field(None, description=(
        "with --speculation and llama-server among --engines: next-token (MTP) heads (.gguf) grafted onto a model "
        "converted without them, e.g. `flux synth --heads-of`"))
    routing_from: str | None = Field(None, description=(
        "plan again with the expert routing `flux serve` counted: the id of a served plan (its saved trace) or a "
        "trace file from GET /flux/routing; the plan is keyed by that trace"))
    domains: str | None = Field(None, description=(
        "time a domain mix of the bundled corpus: TRACE[:MEASURE], each of code, prose, log, chat or several joined "
        "by + (code:chat: the routing trace on code, the measured rounds on chat)"))
    replan: bool = Field(False, exclude=True, description="measure again even if a matching plan exists")
    reprobe: bool = Field(False, exclude=True, description="measure the hardware again")
    finalists: int = Field(6, ge=1, json_schema_extra={"flag": None, "setting": "finalists"})
    repeats: int = Field(3, ge=1, json_schema_extra={"flag": None, "setting": "repeats"})
    seed: int = 0

    @field_validator("gpu_mem_budget_gib")
    @classmethod
    def _no_negative_budget(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and any(x < 0 for x in v):
            raise ValueError("a GPU's budget is 0 GiB or more (0: leave that GPU out)")
        return v

    @property
    def quality_profile(self) -> str:
        """'reference' for f16 KV, else the KV type: a different profile is allowed to differ in output."""
        return "reference" if self.kv in ("f16", "f32") else f"kv-{self.kv}"


class StorageStreaming(Record):
    """Weights read from the drive while decoding (``--allow-storage-streaming``) and the decode limit that sets
    (:mod:`tasks.streaming`)."""

    weights_bytes: int = Field(description="mapped weights on the host")
    ram_for_weights: int = Field(description="host memory left to them beside the KV cache and compute buffers")
    drive_bytes_per_token: float = Field(description="bytes a decoded token reads from the drive")
    drive_gbs: float = Field(description="the probe's drive read bandwidth, GB/s")
    storage_method: str = Field("", description="how the probe read the drive")
    decode_limit_tps: float | None = Field(description="drive bandwidth / drive bytes per token; None: none read")

    def limit_words(self) -> str:
        """'decode at most 3.1 tok/s: 1.20 GB of a token's reads from the drive at 3.5 GB/s'."""
        if self.decode_limit_tps is None:
            return "no weight read from the drive"
        return (f"decode at most {self.decode_limit_tps:,.2f} tok/s: {self.drive_bytes_per_token / 1e6:,.1f} MB of "
                f"each token's reads from the drive at {self.drive_gbs:.2f} GB/s (the probe's {self.storage_method} "
                "read)")


class DraftTrial(Record):
    """One drafting candidate beside its placement without drafting, from the same rounds."""

    candidate_id: str
    base_id: str
    kind: str = Field(description="'model' (a draft model) or 'ngram' (prompt lookup)")
    acceptance: float | None = Field(description="share of proposed tokens the model kept")
    proposed: int | None = Field(None, description=(
        "tokens the drafter proposed over the measured rounds: 0 when prompt lookup found no repeat to propose "
        "(then acceptance is None); None when not counted"))
    workload_s: float | None
    base_workload_s: float | None
    decode_tps: float | None
    base_decode_tps: float | None
    speedup: float | None = Field(description="the base's workload seconds over the drafting candidate's")
    speedup_ci: tuple[float, float] | None = Field(None, description=(
        "95% bootstrap interval of the speedup over the paired rounds (workload seconds, round by round)"))

    def acceptance_words(self) -> str:
        """How much of the proposals the model kept, or that the drafter proposed nothing (H200 run 22: prompt
        lookup on the 30B twin's agent prompts found no repeat in 3 rounds, so nothing was drafted)."""
        if self.acceptance is not None:
            return f"{self.acceptance:.0%} of proposals kept"
        return "no token proposed" if self.proposed == 0 else "acceptance not measured"


class Plan(Record):
    """An immutable plan (FFTW's wisdom): the winner, its evidence, and everything it is keyed by."""

    id: str
    key: dict[str, object]
    created_at: str
    model_path: str
    model_name: str
    model_hash: str
    hardware_fingerprint: str
    backend_build: str
    driver: str | None
    request: PlanRequest
    candidate: Candidate
    measured: MeasureSummary
    predicted: Prediction
    validation: ValidationResult
    finalists: list[MeasureSummary]
    families: dict[str, str] = Field(default_factory=dict, description="each finalist's family, by candidate id")
    predictions: list[Prediction]
    median_prediction_error: float | None
    roofline_decode_tps: float | None = Field(description=(
        "decode tokens/s if each device only read its bytes per token under the plan's placement and split"))
    all_gpu_decode: dict[str, str | float] | None = Field(None, description=(
        "the whole model decoding on one GPU as the probe timed it (device, decode_tps): the practical ceiling"))
    memory_budget: dict[DeviceName, int]
    trials_table: str
    quality_profile: str
    workload_prefill_share: float
    workload_lengths: list[int] = Field(default_factory=list, description="prompt tokens of one measured round")
    workload_n_gen: int = 0
    decode_by_depth: list[tuple[int, float]] = Field(default_factory=list, description=(
        "the chosen candidate's measured decode tokens/s after a prompt of each length (KV cache depth)"))
    notes: list[str] = Field(default_factory=list, description="choices a reader should know about")
    serving: ServingChoice | None = Field(None, description=(
        "the serving curve (aggregate tok/s and p95 per-token latency by sequences at once) and the count chosen "
        "under --serving-p95-ms"))

    @property
    def sequences(self) -> int:
        """The sequences the plan serves at once: the count --serving-p95-ms chose, else --concurrency."""
        return self.serving.sequences if self.serving and self.serving.sequences else self.request.concurrency

    kl_limit: float | None = Field(None, description="the largest mean KL validation allowed (noise floor included)")
    top1_limit: float | None = None
    routing_trace: str | None = Field(None, description="store id (kind 'routing') of the workload's routing trace")
    stage_seconds: dict[str, float] = Field(default_factory=dict, description=(
        "wall seconds of each planning stage of the run that made the plan, and the total"))
    routing_coverage: dict[str, float] = Field(default_factory=dict, description=(
        "share of picks that each layer's busiest 10/25/50% of experts take (median over layers)"))
    routing_repeat: float | None = Field(None, description=(
        "share of a token's expert picks that the previous token made too (temporal locality, median over layers)"))
    routing_shift: dict[str, float] = Field(default_factory=dict, description=(
        "with --domains TRACE:MEASURE: the share of the picks the GPU copies serve on the traced traffic ('trace') "
        "and on the measured rounds' ('measured')"))
    engine: EngineSpec | None = Field(None, description=(
        "the engine that serves the plan, as it was measured (its command template); None: the native worker"))
    speculation: list[DraftTrial] = Field(default_factory=list, description=(
        "each drafting candidate against its placement without drafting, as measured (--speculation)"))
    storage_streaming: StorageStreaming | None = Field(None, description=(
        "the weights the chosen placement reads from the drive and its decode limit (--allow-storage-streaming)"))


def plan_id(body: Mapping[str, Any]) -> str:
    """A plan's id: the content id of its stored body, every field but ``id``."""
    return content_id({k: v for k, v in body.items() if k != "id"})


def seal(body: Mapping[str, Any]) -> Plan:
    """The plan of ``body`` (every field but ``id``) with its id, computed over every field, defaults included."""
    full = Plan(id="", **body).model_dump(mode="json", exclude={"id"})
    return Plan(id=plan_id(full), **full)


class ModelPath(Record):
    """Where `flux plan` saw a model's bytes (kind ``model_path``): ``flux serve`` of a plan whose model moved
    finds it at the newest such path (plans are immutable; the path they name may not be)."""

    model_hash: str
    path: str
