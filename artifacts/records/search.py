"""The search space and what prune keeps of it: placements, candidates as llama.cpp parameters, predictions."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from artifacts.records.base import Record

DeviceName = str  # "CPU", "CUDA0", ...
ExpertPart = Literal["gate", "up", "down"]


class Placement(Record):
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


class Candidate(Record):
    """One point of the search space: a placement plus runtime knobs, as llama.cpp parameters."""

    id: str
    family: str = Field(description="how it was generated: 'cpu-grid', 'all-gpu', 'experts-milp', ...")
    placement: Placement
    params: EngineParams
    weights_bytes: dict[DeviceName, int]
    kv_bytes: dict[DeviceName, int]
    compute_bytes: dict[DeviceName, int]
    needs_storage_streaming: bool = False
    engine: str = Field("native", description="the engine it runs on: 'native' (the worker), 'llama-server', or a "
                                              "configured [engines.NAME]")
    draft: Drafting | None = Field(None, description="how its greedy decoding drafts (speculation); None: it does not")
    hot_share: list[float] = Field(default_factory=list, description=(
        "per layer, the share of its router's picks that hit an expert copied to the GPU (params.expert_split)"))


class PlacementSpace(Record):
    """The enumerated, memory-feasible candidates and the limits they were checked against."""

    candidates: list[Candidate]
    rejected: dict[str, int] = Field(description="reason -> count of infeasible points")
    memory_limits: dict[DeviceName, int]
    n_ctx: int
    n_seq: int
    ctx_capped_by_ram: bool = False


class Prediction(Record):
    """The cost model's estimate for one candidate."""

    candidate_id: str
    prefill_tps: float
    decode_tps: float
    score_s: float = Field(description="predicted seconds for the workload mix; lower is better")


class Finalists(Record):
    """What prune kept for measurement, with predictions for every kept candidate."""

    finalists: list[Candidate]
    predictions: list[Prediction]
    workload_prefill_tokens: int
    workload_decode_tokens: int
    n_ranked: int
