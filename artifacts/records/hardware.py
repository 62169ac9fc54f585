"""The probe report and the machine facts it is keyed by (``tasks.probing.machine`` measures them; the server reads the
facts to check a plan against this machine)."""

from __future__ import annotations

from pydantic import Field

from artifacts.records.base import Record


class CpuInfo(Record):
    """The host CPU."""

    model: str
    physical_cores: int
    logical_cores: int
    isa: list[str]


class GpuInfo(Record):
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


class RpcDevice(Record):
    """One device of a llama.cpp RPC server (llama.cpp names it RPC<n>, n counting over every server in order)."""

    index: int
    memory_free: int
    memory_total: int


class RpcLink(Record):
    """The link to an RPC server, measured with the messages a step sends (``engine_bridge.rpc``)."""

    rtt_ms: float = Field(description="median round trip of an empty command")
    up_small_ms: float = Field(description="writing a decode step's hidden state (16 KiB) to the server")
    down_small_ms: float = Field(description="reading 16 KiB back")
    up_gbs: float = Field(description="bandwidth to the server at 8 MiB (a prefill batch's activations)")
    down_gbs: float = Field(description="bandwidth from the server at 8 MiB")


class RpcServer(Record):
    """A llama.cpp RPC server a plan may use: its identity (facts) and, once probed, its link."""

    endpoint: str
    build_id: str
    protocol: str
    devices: list[RpcDevice]
    link: RpcLink | None = None

    def identity(self) -> dict[str, object]:
        """What keys plans to it: the endpoint, the build and each device's size (not free memory or speed)."""
        return {"endpoint": self.endpoint, "build": self.build_id, "devices": [d.memory_total for d in self.devices]}


class MachineFacts(Record):
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
    rpc: list[RpcServer] = Field(default_factory=list, description=(
        "the llama.cpp RPC servers the plan may use (flux plan --rpc), identified before anything is measured"))


class KernelTiming(Record):
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


class GpuMemoryFit(Record):
    """What one GPU holds beyond the memory model's weights, KV cache and compute buffer (tasks.gpu_memory),
    learned from the probe's loads: for every placement, and in addition when host weights are offloaded."""

    device: str
    base_bytes: int
    offload_bytes: int = Field(0, description="the extra of a placement offloading host weights (the largest)")
    offload_by_ubatch: dict[int, int] = Field(default_factory=dict, description=(
        "that extra at each micro-batch the probe calibrated"))
    mapped_by_ubatch: dict[int, int] = Field(default_factory=dict, description=(
        "the extra of a mapped per-expert split (instead of the offload extra; may be negative), per micro-batch"))
    residuals: dict[str, int] = Field(default_factory=dict, description="measured minus modelled, per probe load")
    step_ms_by_load: dict[str, tuple[float, float]] = Field(default_factory=dict, description=(
        "(prefill, decode) ms per token of each calibration load's read-out run: a hybrid shape's own step"))


class HardwareReport(Record):
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
    rpc_servers: list[RpcServer] = Field(default_factory=list, description=(
        "the RPC servers the plan may use, with their links measured"))
    others_cpus: float | None = Field(None, description=(
        "CPUs other processes kept busy on average while the probe ran (their CPU seconds over its wall seconds, on "
        "the CPUs Flux could use); None: probed before this was measured"))
    load_avg_1m: float | None = Field(None, description="the 1-minute load average when the probe started")
    usable_cpus: int | None = Field(None, description="the CPUs Flux could run on when probed (its affinity mask)")
