"""The nouns of planning, shared by the pipeline stages (TVM-style: Candidate, MeasureResult, Plan).

Each stage's result is a frozen pydantic model, content-hashed into the store. Bulk rows (candidate
grids, per-trial timings) travel as pyarrow tables next to these models.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine_bridge.params import EngineParams, KvType
from tasks.quality_gate import FloorResult


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# -- request -----------------------------------------------------------------------------------------
class PlanRequest(_Model):
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
    concurrency: int = Field(1, ge=1, le=256, description="sequences served at once")
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
    replan: bool = Field(False, exclude=True, description="measure again even if a matching plan exists")
    reprobe: bool = Field(False, exclude=True, description="measure the hardware again")
    finalists: int = Field(6, ge=1, json_schema_extra={"flag": None, "setting": "finalists"})
    repeats: int = Field(3, ge=1, json_schema_extra={"flag": None, "setting": "repeats"})
    seed: int = 0

    @property
    def quality_profile(self) -> str:
        """'reference' for f16 KV, else the KV type: a different profile is allowed to differ in output."""
        return "reference" if self.kv in ("f16", "f32") else f"kv-{self.kv}"


# -- probe -------------------------------------------------------------------------------------------
class CpuInfo(_Model):
    """The host CPU."""

    model: str
    physical_cores: int
    logical_cores: int
    isa: list[str]


class GpuInfo(_Model):
    """One NVIDIA GPU as NVML reports it (plus measured host-to-device bandwidth when probed)."""

    index: int
    name: str
    memory_total: int
    memory_free: int
    pcie_gen: int | None = None
    pcie_width: int | None = None
    compute_capability: str | None = None
    h2d_pinned_gbs: float | None = None
    h2d_pageable_gbs: float | None = None
    uuid: str | None = None


class MachineFacts(_Model):
    """What identifies this machine, read cheaply before anything is measured (no CUDA context).

    The probe report is keyed by all of it; a plan's hardware fingerprint by its stable part.
    """

    node: str
    machine_id: str
    cpu: CpuInfo
    ram_total: int
    gpus: list[GpuInfo]
    driver: str | None
    cuda_driver: str | None = Field(None, description="CUDA version the driver supports (NVML)")
    cuda_runtime: str | None = Field(None, description="the libcudart a CUDA build loads (file name)")


class KernelTiming(_Model):
    """The model's own kernels timed on one device (whole-model runs divided per layer)."""

    device: str
    n_threads: int
    decode_ms_per_token: float
    prefill_ms_per_token: float
    prefill_batch: int
    decode_ms_per_layer: float
    prefill_ms_per_layer: float
    flash_attn: bool = False
    load_ms: float | None = Field(None, description="the timed load of the whole model on this device")
    gpu_bytes: int | None = Field(None, description="GPU memory the timed worker held (NVML), for the memory model")
    gpu_bytes_predicted: int | None = Field(None, description="the memory model's bytes for the same load, uncorrected")


class GpuMemoryFit(_Model):
    """What one GPU holds beyond the memory model's weights, KV cache and compute buffer (tasks.gpu_memory),
    learned from the probe's loads: for every placement, and in addition when host weights are offloaded."""

    device: str
    base_bytes: int
    offload_bytes: int = 0
    residuals: dict[str, int] = Field(default_factory=dict, description="measured minus modelled, per probe load")


class HardwareReport(_Model):
    """Everything the probe measured; the fingerprint keys plans to this machine."""

    fingerprint: str
    cpu: CpuInfo
    ram_total: int
    ram_available: int
    ram_read_gbs: float
    ram_read_gbs_1thread: float
    storage_read_gbs: float
    storage_method: str
    gpus: list[GpuInfo]
    driver: str | None
    ggml_devices: list[dict[str, object]]
    kernels: list[KernelTiming]
    model_hash: str
    backend_build: str
    gpu_memory: list[GpuMemoryFit] = Field(default_factory=list, description=(
        "per GPU, the memory model's correction measured by the probe (none: the fixed margin)"))


# -- search space --------------------------------------------------------------------------------------
DeviceName = str  # "CPU", "CUDA0", ...
ExpertPart = Literal["gate", "up", "down"]


class Placement(_Model):
    """Where weights live: per layer, its attention/dense part and each expert tensor."""

    layer_device: list[DeviceName] = Field(description="device of each layer's non-expert weights")
    expert_device: list[dict[str, DeviceName]] = Field(
        default_factory=list, description="per layer {'gate'|'up'|'down': device}; empty for dense models")
    output_device: DeviceName = "CPU"

    def gpu_layers(self) -> int:
        """Layers whose non-expert weights are not on the CPU."""
        return sum(1 for d in self.layer_device if d != "CPU")

    def gpus(self) -> set[str]:
        """The devices other than the CPU that hold a part of the placement."""
        experts = (d for ex in self.expert_device for d in ex.values())
        return {d for d in (*self.layer_device, self.output_device, *experts) if d != "CPU"}

    def is_hybrid(self) -> bool:
        """A GPU placement that leaves per-token weights (a layer or an expert tensor) to the CPU."""
        on_cpu = "CPU" in self.layer_device or any(d == "CPU" for ex in self.expert_device for d in ex.values())
        return on_cpu and (self.gpu_layers() > 0 or self.output_device != "CPU")


class Candidate(_Model):
    """One point of the search space: a placement plus runtime knobs, as llama.cpp parameters."""

    id: str
    family: str = Field(description="how it was generated: 'cpu-grid', 'all-gpu', 'experts-milp', ...")
    placement: Placement
    params: EngineParams
    weights_bytes: dict[DeviceName, int]
    kv_bytes: dict[DeviceName, int]
    compute_bytes: dict[DeviceName, int]
    needs_storage_streaming: bool = False
    hot_share: list[float] = Field(default_factory=list, description=(
        "per layer, the share of its router's picks that hit an expert copied to the GPU (params.expert_split)"))


class PlacementSpace(_Model):
    """The enumerated, memory-feasible candidates and the limits they were checked against."""

    candidates: list[Candidate]
    rejected: dict[str, int] = Field(description="reason -> count of infeasible points")
    memory_limits: dict[DeviceName, int]
    n_ctx: int
    n_seq: int
    ctx_capped_by_ram: bool = False


class Prediction(_Model):
    """The cost model's estimate for one candidate."""

    candidate_id: str
    prefill_tps: float
    decode_tps: float
    score_s: float = Field(description="predicted seconds for the workload mix; lower is better")


class Finalists(_Model):
    """What prune kept for measurement, with predictions for every kept candidate."""

    finalists: list[Candidate]
    predictions: list[Prediction]
    workload_prefill_tokens: int
    workload_decode_tokens: int
    n_ranked: int


# -- measurement ---------------------------------------------------------------------------------------
class MeasureSummary(_Model):
    """Per-finalist medians over its trials (the trials themselves are a Parquet table)."""

    candidate_id: str
    prefill_tps: float | None
    decode_tps: float | None
    prefill_iqr: float | None = None
    decode_iqr: float | None = None
    workload_s: float | None = Field(description="median over rounds of one round's prompt + decode seconds")
    n_trials: int = Field(description="timed prompt runs")
    workload_iqr: float | None = None
    n_rounds: int = 0
    error: str | None = None
    peak_rss_bytes: int | None = None
    gpu_bytes: int | None = None
    gpu_method: str | None = Field(None, description=(
        "how gpu_bytes was read: 'per-process' (NVML's figure) or 'device-delta' (the device's use above a "
        "baseline, where NVML hides per-process figures)"))
    predicted_gpu_bytes: int | None = Field(None, description="the memory model's GPU bytes for the candidate")


class MeasureResults(_Model):
    """The measure stage's result: summaries + the id of the stored trials table."""

    summaries: list[MeasureSummary]
    trials_table: str
    budget_s: float
    spent_s: float
    stopped_by_budget: bool
    lengths: list[int] = Field(default_factory=list, description="prompt tokens of one round")
    n_gen: int = 0
    scored_dir: str | None = Field(None, description="where finalists' scores of the reference's continuations are")


class ValidationResult(_Model):
    """One candidate compared with the reference placement."""

    candidate_id: str
    mean_kl: float
    max_kl: float
    top1_agreement: float
    n_tokens: int
    passed: bool
    p90_kl: float | None = None
    reason: str = ""
    held_out_decode_tps: float | None = None
    held_out_prefill_tps: float | None = None


class ValidationReport(_Model):
    """The validate stage's result: the winner among the top two."""

    results: list[ValidationResult]
    winner_id: str
    quality_profile: str
    reference: EngineParams
    floor: list[FloorResult] = Field(default_factory=list, description="the noise floor of correct kernels")
    kl_limit: float | None = None
    top1_limit: float | None = None


class Plan(_Model):
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
    kl_limit: float | None = Field(None, description="the largest mean KL validation allowed (noise floor included)")
    top1_limit: float | None = None
    routing_trace: str | None = Field(None, description="store id (kind 'routing') of the workload's routing trace")
    stage_seconds: dict[str, float] = Field(default_factory=dict, description=(
        "wall seconds of each planning stage of the run that made the plan, and the total"))
    routing_coverage: dict[str, float] = Field(default_factory=dict, description=(
        "share of picks that each layer's busiest 10/25/50% of experts take (median over layers)"))
