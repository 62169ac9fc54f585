"""The evidence a plan is chosen on: per-finalist measurements, and validation against the reference placement
with the noise floor of correct kernels (``tasks.quality_gate`` computes the statistics)."""

from __future__ import annotations

from pydantic import Field

from artifacts.engine_params import EngineParams
from artifacts.records.base import Record
from artifacts.records.serving import ServingChoice


class QualityStats(Record):
    """How one configuration's next-token distributions compare with the reference's, position by position."""

    mean_kl: float
    p90_kl: float
    max_kl: float
    top1: float
    n: int


class FloorResult(Record):
    """One correct variant of the reference, compared with it: a sample of the noise floor."""

    name: str
    stats: QualityStats


class MeasureSummary(Record):
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
    drafted: int | None = Field(None, description="tokens a drafting candidate's draft proposed over its rounds")
    accepted: int | None = Field(None, description="of them, the tokens the model kept")


class MeasureResults(Record):
    """The measure stage's result: summaries + the id of the stored trials table."""

    summaries: list[MeasureSummary]
    trials_table: str
    budget_s: float
    spent_s: float
    stopped_by_budget: bool
    lengths: list[int] = Field(default_factory=list, description="prompt tokens of one round")
    n_gen: int = 0
    scored_dir: str | None = Field(None, description="where finalists' scores of the reference's continuations are")
    serving: ServingChoice | None = Field(None, description="the serving curve and its choice (--serving-p95-ms)")


class ValidationResult(Record):
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


class ValidationReport(Record):
    """The validate stage's result: the winner among the top two."""

    results: list[ValidationResult]
    winner_id: str
    quality_profile: str
    reference: EngineParams
    floor: list[FloorResult] = Field(default_factory=list, description="the noise floor of correct kernels")
    kl_limit: float | None = None
    top1_limit: float | None = None
