"""Engine parameters: one validated model of every llama.cpp knob a plan sets.

``Llama(**kwargs)`` silently ignores unknown keyword arguments, so Flux never passes a free-form dict: a
placement becomes an :class:`EngineParams`, whose fields are checked here, and only then llama.cpp calls.
This module does not import llama_cpp (planning tasks use it to describe candidates).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from artifacts import native_switches as sw

KvType = Literal["f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"]
# ggml_type ids of the KV cache types (ggml.h).
KV_TYPE_IDS: dict[str, int] = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
                               "iq4_nl": 20, "bf16": 30}
LoadMode = Literal["mmap", "load", "mlock"]
_CLI_LOAD_MODES: dict[str, str] = {"mmap": "mmap", "load": "none", "mlock": "mlock"}  # llama.cpp's -lm names
_DEVICE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")  # what FLUX_MOE_SPLIT can carry between its | ; : , separators
# Sliding-window layers (Gemma 2/3, gpt-oss, ...) keep a window-sized KV cache (the window plus one micro-batch,
# artifacts.model_info.kv_cache_bytes), as llama-server and llama-bench allocate it by default (their swa_full is
# false, so cli_args needs no flag); llama.cpp's C default (llama_context_default_params) and llama-cpp-python's
# Llama give those layers the whole context. The worker's context sets it (engine_bridge.worker.load).
SWA_FULL = False
MAPPED_TOKENS_DEFAULT = 4  # patch 0006's FLUX_MOE_MAPPED_MAX_TOKENS default
# The pinned llama.cpp's CUDA mul_mat_id takes its vector kernels (patched to skip a negative expert id) up to
# this many tokens per type on Turing and newer (ggml-cuda/mmvq.cu: get_mmvq_mmid_max_batch_turing_plus); other
# types up to 8 (MMVQ_MAX_BATCH_SIZE). Above it a matrix kernel runs, which the patch does not teach to skip.
_MMVQ_MMID_MAX = {"IQ2_S": 7, "IQ3_S": 6, "IQ3_XXS": 7, "MXFP4": 7, "NVFP4": 8, "Q2_K": 7, "Q3_K": 5}
_FLOAT_TYPES = {"F32", "F16", "BF16"}
# On the H200 (scripts/mapped_batch_check.py, run 18) 5-8 parallel sequences of a mapped split decoded the stock
# tokens at every limit; at 5-7 a limit of 8 ran 1.5-2.0x the default's speed, at 8 sequences two of three
# readings were 2.2x slower than the default: batches of 8 stay on the host path until that is understood.
MAPPED_TOKENS_CAP = 7


def mapped_batch_limit(quant_types: Iterable[str], compute_capability: str | None) -> int:
    """The largest batch a mapped split may compute on the GPU (FLUX_MOE_MAPPED_MAX_TOKENS): on a GPU of compute
    capability 7.5 or more, what the vector kernels take for every quantized type of the model; elsewhere (or
    unknown) the patch's default."""
    try:
        major, minor = (int(x) for x in (compute_capability or "").split(".")[:2])
    except ValueError:
        return MAPPED_TOKENS_DEFAULT
    if (major, minor) < (7, 5):
        return MAPPED_TOKENS_DEFAULT
    limit = min((_MMVQ_MMID_MAX.get(t.upper(), 8) for t in quant_types if t.upper() not in _FLOAT_TYPES), default=8)
    return min(limit, MAPPED_TOKENS_CAP)


class TensorOverride(BaseModel):
    """Put tensors whose name matches ``pattern`` (a regex, as llama.cpp's ``-ot``) on ``device``."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    pattern: str
    device: str = Field(description="ggml device name: 'CPU', 'CUDA0', ...")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        re.compile(v)
        return v

    def as_flag(self) -> str:
        """The same override as llama.cpp's command-line ``-ot`` value."""
        return f"{self.pattern}={self.device}"


class HotExperts(BaseModel):
    """One layer's routed experts that also get a copy on ``device`` (the rest run on the host)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    layer: int = Field(ge=0)
    experts: tuple[int, ...] = Field(min_length=1, description="expert ids, ascending")
    device: str = Field(description="ggml device name of the copy: 'CUDA0', ...; 'CPU' splits between two host buffers")

    @field_validator("experts")
    @classmethod
    def _ascending(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if v[0] < 0 or any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError(f"expert ids must be non-negative, ascending and unique, got {list(v)}")
        return v

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if not _DEVICE_NAME.match(v):
            raise ValueError(f"not a ggml device name: {v!r}")
        return v


class ExpertSplit(BaseModel):
    """Per-expert placement: per layer, the experts held on a GPU, the layer's full expert tensors on the host.

    The patched backend reads it from ``FLUX_MOE_SPLIT`` when a model loads (``environment()``), so llama-server
    and llama-bench get the same split from the same variable. A batch below the op-offload threshold computes
    a split layer's hot picks on the device and the rest on the host; larger batches keep the stock path.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    layers: tuple[HotExperts, ...] = Field(min_length=1, description="ascending by layer, each layer once")

    @field_validator("layers")
    @classmethod
    def _one_per_layer(cls, v: tuple[HotExperts, ...]) -> tuple[HotExperts, ...]:
        if any(b.layer <= a.layer for a, b in zip(v, v[1:], strict=False)):
            raise ValueError(f"layers must be ascending and unique, got {[h.layer for h in v]}")
        return v

    @classmethod
    def on(cls, device: str, hot: dict[int, list[int] | tuple[int, ...]]) -> ExpertSplit:
        """One device's split from ``{layer: expert ids}`` (ids sorted here; layers without ids left out)."""
        return cls(layers=tuple(HotExperts(layer=i, experts=tuple(sorted(ids)), device=device)
                                for i, ids in sorted(hot.items()) if ids))

    def hot(self, layer: int) -> tuple[int, ...]:
        """The experts of ``layer`` on a device (empty when the layer is not split)."""
        return next((h.experts for h in self.layers if h.layer == layer), ())

    def host_override(self) -> TensorOverride:
        """The override that keeps every split layer's full expert tensors on the host, where the split needs them."""
        layers = "|".join(str(h.layer) for h in self.layers)
        return TensorOverride(pattern=rf"^blk\.({layers})\.ffn_(gate|up|down)_exps\.", device="CPU")

    def env_value(self) -> str:
        """The FLUX_MOE_SPLIT value: ``DEV|L:e,e;L:e;DEV2|L:e`` (a ``DEV|`` prefix whenever the device changes)."""
        items, dev = [], None
        for h in self.layers:
            head = f"{h.device}|" if h.device != dev else ""
            items.append(f"{head}{h.layer}:{','.join(map(str, h.experts))}")
            dev = h.device
        return ";".join(items)

    @classmethod
    def from_env_value(cls, value: str) -> ExpertSplit:
        """Parse a FLUX_MOE_SPLIT value (the inverse of :meth:`env_value`); ValueError when malformed."""
        layers, dev = [], ""
        for item in value.split(";"):
            if "|" in item:
                dev, item = item.split("|", 1)
            layer, sep, ids = item.partition(":")
            if not sep or not dev:
                raise ValueError(f"FLUX_MOE_SPLIT item {item!r}: expected [DEVICE|]LAYER:ID,ID,...")
            layers.append(HotExperts(layer=int(layer), experts=tuple(int(x) for x in ids.split(",")), device=dev))
        return cls(layers=tuple(layers))


class EngineParams(BaseModel):
    """How llama.cpp loads and runs a model: the executable part of a plan."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    n_ctx: int = Field(4096, ge=16)
    n_seq_max: int = Field(1, ge=1, le=256)
    n_batch: int = Field(2048, ge=1)
    n_ubatch: int = Field(512, ge=1)
    n_threads: int = Field(1, ge=1)
    n_threads_batch: int = Field(1, ge=1)
    n_gpu_layers: int = Field(0, ge=-1)
    main_gpu: int = Field(0, ge=0)
    split_mode: Literal["none", "layer", "row"] = "layer"
    tensor_split: tuple[float, ...] | None = None
    flash_attn: bool = False
    type_k: KvType = "f16"
    type_v: KvType = "f16"
    load_mode: LoadMode = "mmap"
    no_host: bool = Field(False, description=(
        "CPU-resident weights in the CPU backend's repacked layout (llama.cpp --no-host), not in the GPU's pinned "
        "host buffer: faster CPU matmuls at batch 1, but ops on them are never offloaded to a GPU, so prefill "
        "computes them on the CPU. Without a GPU, CPU weights are repacked either way."))
    repack: bool = Field(True, description=(
        "llama.cpp's extra buffer types for CPU weights (repacked layouts, AMX tiles); False = --no-repack"))
    offload_kqv: bool = True
    op_offload: bool = True
    offload_min_batch: int | None = Field(None, ge=1, description="GGML_OP_OFFLOAD_MIN_BATCH")
    tensor_overrides: tuple[TensorOverride, ...] = ()
    expert_split: ExpertSplit | None = Field(None, description=(
        "per-expert placement (FLUX_MOE_SPLIT): hot experts copied to a GPU, the split layers' full expert "
        "tensors on the host (place them there with tensor_overrides)"))
    expert_host_sync: bool = Field(False, description=(
        "FLUX_MOE_HOST_SYNC: a split layer's host experts wait for its GPU experts instead of running meanwhile"))
    expert_mapped: bool = Field(False, description=(
        "FLUX_MOE_MAPPED (patch 0006, CUDA): the split layers' cold experts are also copied into pinned host memory "
        "that the GPU reads in place, and decode steps of up to expert_mapped_tokens tokens compute them on the GPU: no host round "
        "trip, the cold bytes cross the bus instead (host RAM: the cold experts twice)"))
    expert_mapped_tokens: int = Field(MAPPED_TOKENS_DEFAULT, ge=1, le=8, description=(
        "FLUX_MOE_MAPPED_MAX_TOKENS (patch 0006): the largest batch whose cold picks the GPU computes in place "
        "(a drafted step's verification, a few sequences' next tokens); larger batches up to the op-offload "
        "threshold compute them on the host. At most what CUDA's vector kernels take for the experts' type "
        "(:func:`mapped_batch_limit`)"))
    expert_cache: Literal["static", "adaptive"] = Field("static", description=(
        "FLUX_MOE_CACHE (patch 0007): 'adaptive' = a split's hot sets follow recent routing (picks read back every "
        "few steps, the least-picked hot experts swapped for busier cold ones; FLUX_MOE_CACHE_FREEZE=1 holds them); "
        "needs expert_mapped or the split layers' host weights in the plain layout"))
    kv_vram_cells: int | None = Field(None, ge=256, description=(
        "FLUX_KV_VRAM_CELLS (patch 0009): the KV cache split by position: the first kv_vram_cells cells of each "
        "attention layer in VRAM, every cell in pinned host memory the GPU reads in place, so a context longer than "
        "the window costs VRAM only for the window; needs flash_attn and offload_kqv (one unified cache when "
        "n_seq_max > 1: the window covers its first cells). None: the whole cache where offload_kqv puts it"))
    rpc_servers: tuple[str, ...] = Field((), description=(
        "llama.cpp RPC servers (host:port) whose devices the model may use (--rpc); their devices come first in "
        "llama.cpp's device list, named RPC0, RPC1, ... in this order, so tensor_split lists them first"))
    seed: int = 0

    @model_validator(mode="after")
    def _consistent(self) -> EngineParams:
        if self.n_ubatch > self.n_batch:
            raise ValueError(f"n_ubatch ({self.n_ubatch}) must not exceed n_batch ({self.n_batch})")
        if self.type_v != "f16" and self.type_v != "f32" and not self.flash_attn:
            raise ValueError(f"a quantized V cache (type_v={self.type_v}) needs flash_attn=True")
        if (self.expert_mapped or self.expert_cache != "static") and self.expert_split is None:
            raise ValueError("expert_mapped and an adaptive expert_cache act on a per-expert split: they need expert_split")
        if self.kv_vram_cells is not None and not (self.flash_attn and self.offload_kqv):
            raise ValueError("a KV window (kv_vram_cells) splits an offloaded cache read by flash attention: it needs "
                             "flash_attn=True and offload_kqv=True")
        return self

    @property
    def kv_unified(self) -> bool:
        """One KV cache shared by the sequences (a window splits one stream), else one stream per sequence."""
        return self.kv_vram_cells is not None and self.n_seq_max > 1

    def cli_args(self) -> list[str]:
        """The same configuration as llama.cpp command-line flags (llama-server, llama-bench)."""
        args = ["-c", str(self.n_ctx), "-b", str(self.n_batch), "-ub", str(self.n_ubatch),
                "-t", str(self.n_threads), "-tb", str(self.n_threads_batch), "-ngl", str(self.n_gpu_layers),
                "-fa", "on" if self.flash_attn else "off", "-ctk", self.type_k, "-ctv", self.type_v,
                "-sm", self.split_mode, "-mg", str(self.main_gpu)]
        if self.tensor_split:
            args += ["-ts", ",".join(f"{x:g}" for x in self.tensor_split)]
        if self.load_mode != "mmap":  # the pin's --load-mode (it has no --no-mmap/--mlock)
            args += ["-lm", _CLI_LOAD_MODES[self.load_mode]]
        if self.no_host:
            args.append("--no-host")
        if not self.repack:
            args.append("--no-repack")
        if not self.offload_kqv:
            args.append("-nkvo")
        if not self.op_offload:
            args.append("--no-op-offload")
        for o in self.tensor_overrides:
            args += ["-ot", o.as_flag()]
        if self.rpc_servers:
            args += ["--rpc", ",".join(self.rpc_servers)]
        return args

    def server_args(self) -> list[str]:
        """The same configuration as llama-server's flags: ``n_seq_max`` slots (``-np``) of ``n_ctx`` tokens each,
        which llama-server asks for as the whole ``-c`` it splits among them."""
        args = self.cli_args()
        args[args.index("-c") + 1] = str(self.n_ctx * self.n_seq_max)
        return [*args, "-np", str(self.n_seq_max), *(["--kv-unified"] if self.kv_unified else [])]

    def environment(self) -> dict[str, str]:
        """Environment variables the worker process (or llama-server, with ``cli_args``) needs for this configuration.

        The expert split travels only here: llama.cpp reads FLUX_MOE_SPLIT when it loads a model, whichever
        program loads it, so ``cli_args`` has no flag for it. The patches' variables come from their declaration
        (:mod:`artifacts.native_switches`).
        """
        env: dict[str, str] = {}
        if self.offload_min_batch is not None:
            env["GGML_OP_OFFLOAD_MIN_BATCH"] = str(self.offload_min_batch)  # llama.cpp's own, not a patch's
        if self.expert_split is not None:
            env |= sw.MOE_SPLIT.env(self.expert_split.env_value())
        if self.expert_host_sync:
            env |= sw.MOE_HOST_SYNC.env(True)
        if self.expert_mapped:
            env |= sw.MOE_MAPPED.env(True)
            if self.expert_mapped_tokens != MAPPED_TOKENS_DEFAULT:
                env |= sw.MOE_MAPPED_MAX_TOKENS.env(self.expert_mapped_tokens)
        if self.expert_cache != "static":
            env |= sw.MOE_CACHE.env(self.expert_cache)
        if self.kv_vram_cells is not None:
            env |= sw.KV_VRAM_CELLS.env(self.kv_vram_cells)
        return env
