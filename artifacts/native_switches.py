"""The patched llama.cpp's switches: every ``FLUX_*`` environment variable Flux's patches read, declared once.

Each patch parses its own switches in C++, where it uses them (``getenv`` in ``patches/llama.cpp/*.patch``); this
declaration is the one list of them. ``EngineParams.environment()`` and ``flux rpc-server`` build their variables
through it (``MOE_SPLIT.env(value)``), so a misspelt switch is an attribute error caught by mypy and the tests,
and a value of the wrong kind is refused before any process starts. The switch table of
``patches/llama.cpp/README.md`` is generated from it (:func:`render_into`), and
``tests/engine_bridge/test_native_switches.py`` fails when the table, this list or the patches disagree (a switch
that no patch reads, or one a patch reads and this list lacks). Nothing here imports llama_cpp.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from artifacts.errors import FluxError

SwitchKind = Literal["flag", "count", "choice", "text"]
SetBy = Literal["engine-params", "rpc-server", "by-hand"]
SET_BY_TEXT: dict[SetBy, str] = {
    "engine-params": "Flux: `EngineParams.environment()`",
    "rpc-server": "Flux: `flux rpc-server`",
    "by-hand": "by hand (A/B, diagnosis, bench scripts, tests)",
}
TABLE_BEGIN = "<!-- native-switches: generated from artifacts/native_switches.py; do not edit -->"
TABLE_END = "<!-- native-switches: end -->"


class UnknownSwitch(FluxError):
    """A name that is not one of the patched backend's switches."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"{name} is not a switch of Flux's llama.cpp patches: the switches are declared in "
                         "artifacts/native_switches.py (patches/llama.cpp/README.md, \"Switches\")")


class NativeSwitch(BaseModel):
    """One environment variable a patch reads: its name, the patch that added the read, its kind and effect."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(pattern=r"^FLUX_[A-Z0-9_]+$")
    patch: str = Field(pattern=r"^\d{4}$", description="the patch that reads it first (others may read it too)")
    kind: SwitchKind = Field(description="flag: 0 or 1; count: a positive integer; choice: one of choices; text")
    default: str = Field(description="what the patched build does when the variable is unset")
    choices: tuple[str, ...] = ()
    effect: str
    set_by: SetBy
    field: str | None = Field(None, description="the EngineParams field it carries, when Flux sets it")

    def format(self, value: bool | int | str) -> str:
        """The variable's text for ``value``, checked against the switch's kind.

        Raises:
            ValueError: ``value`` is not of the switch's kind.
        """
        if self.kind == "flag" and isinstance(value, bool):
            return "1" if value else "0"
        if self.kind == "count" and isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return str(value)
        if self.kind == "choice" and isinstance(value, str) and value in self.choices:
            return value
        if self.kind == "text" and isinstance(value, str) and value:
            return value
        raise ValueError(f"{self.name} is a {self.kind} switch"
                         + (f" ({', '.join(self.choices)})" if self.choices else "") + f": not {value!r}")

    def env(self, value: bool | int | str) -> dict[str, str]:
        """``{name: text}`` for ``value`` (:meth:`format`), to merge into a process's environment."""
        return {self.name: self.format(value)}


def _switch(name: str, patch: str, kind: SwitchKind, default: str, effect: str, set_by: SetBy = "by-hand",
            field: str | None = None, choices: tuple[str, ...] = ()) -> NativeSwitch:
    return NativeSwitch(name=name, patch=patch, kind=kind, default=default, effect=effect, set_by=set_by,
                        field=field, choices=choices)


MOE_HOST_PROFILE = _switch(
    "FLUX_MOE_HOST_PROFILE", "0002", "count", "off",
    "every 64 (=1) or N graph computes, one stderr line `flux-moe-host-profile: steps=… host_experts_ms=… "
    "host_expert_splits=… overlapped_splits=… wait_ms=… compute_call_ms=… skipped_splits=…` (per step; columns "
    "below)")
MOE_SPLIT = _switch(
    "FLUX_MOE_SPLIT", "0003", "text", "no split: the stock graph",
    "per-expert placement (its syntax under \"Per-expert placement\"): hot expert copies on a device, the split "
    "graph below `GGML_OP_OFFLOAD_MIN_BATCH` tokens; a bad value fails the load in one `FLUX_MOE_SPLIT: …` line",
    "engine-params", "expert_split")
MOE_HOST_SYNC = _switch(
    "FLUX_MOE_HOST_SYNC", "0003", "flag", "0",
    "1: a split layer's host part waits for its device part (same graph, no overlap): the overlap's A/B",
    "engine-params", "expert_host_sync")
MOE_SKIP_IDLE = _switch(
    "FLUX_MOE_SKIP_IDLE", "0004", "flag", "1",
    "0: a split layer's host part runs even when all its picks are hot (the idle skip's A/B)")
BUILD_ID = _switch(
    "FLUX_BUILD_ID", "0005", "text", "empty answer",
    "the backend build id `rpc-server` answers to command 0xF1, so a client refuses a server of another build",
    "rpc-server")
MOE_MAPPED = _switch(
    "FLUX_MOE_MAPPED", "0006", "flag", "0",
    "1: a split's cold experts also copied into pinned host memory the GPU reads in place, computed on the hot "
    "device in small batches (no host part); a device that cannot read host memory fails the load",
    "engine-params", "expert_mapped")
MOE_MAPPED_MAX_TOKENS = _switch(
    "FLUX_MOE_MAPPED_MAX_TOKENS", "0006", "count", "4",
    "the largest batch whose cold picks the GPU computes in place (Flux sets what CUDA's vector kernels take for "
    "the model's types, at most 7, on Turing and newer: `mapped_batch_limit`)",
    "engine-params", "expert_mapped_tokens")
MOE_MAPPED_WC = _switch(
    "FLUX_MOE_MAPPED_WC", "0006", "flag", "0",
    "1: the mapped buffer allocated write-combined (an A/B switch: it gained nothing on the H200)")
MOE_CACHE = _switch(
    "FLUX_MOE_CACHE", "0007", "choice", "static",
    "adaptive: a split's hot sets follow recent routing (picks read back, least-picked hot experts swapped for "
    "busier cold ones); any other value fails the load",
    "engine-params", "expert_cache", ("static", "adaptive"))
MOE_CACHE_FREEZE = _switch(
    "FLUX_MOE_CACHE_FREEZE", "0007", "flag", "0", "1: an adaptive cache holds its sets (no reads, no swaps)")
MOE_CACHE_LOG = _switch(
    "FLUX_MOE_CACHE_LOG", "0007", "flag", "0",
    "1: `flux-moe-cache: round=R swapped=N swaps=TOTAL reads=K` on stderr after each swap round")
MOE_CACHE_SAMPLE = _switch(
    "FLUX_MOE_CACHE_SAMPLE", "0007", "count", "8", "an adaptive cache reads the picks back every N graph computes")
MOE_CACHE_EVERY = _switch(
    "FLUX_MOE_CACHE_EVERY", "0007", "count", "8", "an adaptive cache runs a swap round every N reads")
MOE_CACHE_SWAPS = _switch(
    "FLUX_MOE_CACHE_SWAPS", "0007", "count", "2", "at most N experts swapped per split layer and round")
CUDA_OP_PROFILE = _switch(
    "FLUX_CUDA_OP_PROFILE", "0008", "choice", "off",
    "GPU time summed per op type (1) or node name without its layer suffix (2); CUDA graphs off and each "
    "compute synchronized while on: the shares count, not the speed",
    choices=("1", "2"))
CUDA_OP_PROFILE_EVERY = _switch(
    "FLUX_CUDA_OP_PROFILE_EVERY", "0008", "count", "64",
    "the op profile prints one `flux-cuda-op-profile: computes=N gpu_ms=T OP=ms/calls …` line every N computes")
KV_VRAM_CELLS = _switch(
    "FLUX_KV_VRAM_CELLS", "0009", "count", "no window: the stock cache",
    "a KV cache split by position: every cell in host memory the GPU reads in place, the first N cells also in a "
    "VRAM window; attention reads the window alone while a sequence fits in it, else the window and the host cells "
    "after it. A cache it cannot split (KV on the host, one stream per sequence, flash attention off) stays stock, "
    "with one warning line", "engine-params", "kv_vram_cells")

SWITCHES: tuple[NativeSwitch, ...] = (
    MOE_HOST_PROFILE, MOE_SPLIT, MOE_HOST_SYNC, MOE_SKIP_IDLE, BUILD_ID, MOE_MAPPED, MOE_MAPPED_MAX_TOKENS,
    MOE_MAPPED_WC, MOE_CACHE, MOE_CACHE_FREEZE, MOE_CACHE_LOG, MOE_CACHE_SAMPLE, MOE_CACHE_EVERY, MOE_CACHE_SWAPS,
    CUDA_OP_PROFILE, CUDA_OP_PROFILE_EVERY, KV_VRAM_CELLS,
)
BY_NAME: dict[str, NativeSwitch] = {s.name: s for s in SWITCHES}
if len(BY_NAME) != len(SWITCHES):
    raise ValueError("artifacts/native_switches.py declares a switch twice")


def switch(name: str) -> NativeSwitch:
    """The declared switch called ``name``.

    Raises:
        UnknownSwitch: no patch reads a switch of that name.
    """
    try:
        return BY_NAME[name]
    except KeyError:
        raise UnknownSwitch(name) from None


def markdown_table() -> str:
    """The switch table of patches/llama.cpp/README.md, one row per switch in patch order."""
    rows = ["| variable | patch | kind | unset | effect | set by |", "|---|---|---|---|---|---|"]
    for s in sorted(SWITCHES, key=lambda s: (s.patch, SWITCHES.index(s))):
        kind = s.kind + (f" ({' / '.join(s.choices)})" if s.choices else "")
        by = SET_BY_TEXT[s.set_by] + (f", `{s.field}`" if s.field else "")
        rows.append(f"| `{s.name}` | {s.patch} | {kind} | {s.default} | {s.effect} | {by} |")
    return "\n".join(rows)


def render_into(text: str) -> str:
    """``text`` with the block between :data:`TABLE_BEGIN` and :data:`TABLE_END` replaced by :func:`markdown_table`.

    Raises:
        ValueError: ``text`` lacks the two marker lines.
    """
    start, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if start < 0 or end < start:
        raise ValueError(f"the switch table's markers are missing: {TABLE_BEGIN!r} ... {TABLE_END!r}")
    return text[:start] + TABLE_BEGIN + "\n" + markdown_table() + "\n" + text[end:]
