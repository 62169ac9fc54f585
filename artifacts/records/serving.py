"""The serving curve of ``flux plan --serving-p95-ms``: aggregate throughput and per-token latency of the plan's
placement serving 1..N sequences at once (continuous batching in one context)."""

from __future__ import annotations

from pydantic import Field

from artifacts.records.base import Record


class ServingPoint(Record):
    """One sequence count timed: that many streams of the workload started together on one loaded worker."""

    sequences: int = Field(ge=1, description="streams generating at once")
    aggregate_tps: float | None = Field(description=(
        "completion tokens of every stream over the wall seconds from their start to the last token"))
    p95_token_ms: float | None = Field(description=(
        "95th percentile of the gaps between a stream's successive tokens, over every stream (ms)"))
    p50_token_ms: float | None = None
    tokens: int = Field(0, ge=0, description="completion tokens generated, every stream together")
    seconds: float = Field(0.0, ge=0, description="wall seconds of its rounds together")
    rounds: int = Field(0, ge=0, description="times the count was run (every count once a round, in a new order)")
    error: str | None = None


class ServingChoice(Record):
    """What the curve chose under ``--serving-p95-ms`` and why (the plan's note)."""

    candidate_id: str = Field(description="the finalist whose placement was timed")
    p95_ms: float
    curve: list[ServingPoint]
    sequences: int | None = Field(description="the sequence count the plan serves; None: none could be timed")
    met: bool = Field(description="whether ``sequences`` meets --serving-p95-ms")
    note: str
