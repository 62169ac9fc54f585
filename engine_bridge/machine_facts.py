"""This machine's facts, read cheaply before anything is measured (no CUDA context): what probe reports and plans
are keyed by (:mod:`artifacts.records.keys`) and what ``flux serve`` checks a plan against.

The CPU is read from the kernel (``/proc/cpuinfo``), the GPUs, driver and CUDA runtime from NVML and the library
folders (:mod:`engine_bridge.gpu_inventory`); nothing is looked up from a table of known parts.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import psutil

from artifacts.records.hardware import CpuInfo, MachineFacts
from engine_bridge.gpu_inventory import cuda_runtime_name, nvml_inventory

CPUINFO = Path("/proc/cpuinfo")
# ISA extensions llama.cpp's CPU kernels dispatch on, in report order (x86 names, then arm64 names).
ISA_OF_INTEREST: tuple[str, ...] = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16", "amx_fp16",
    "neon", "asimdhp", "asimddp", "i8mm", "bf16", "sve", "sve2", "sme",
)
_ISA_ALIASES = {"asimd": "neon"}  # arm64 kernels call NEON "asimd" in /proc/cpuinfo


def read_cpuinfo(path: Path = CPUINFO) -> list[dict[str, str]]:
    """Return /proc/cpuinfo as one dict per block (processor); empty where the file does not exist."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    blocks: list[dict[str, str]] = []
    for chunk in text.split("\n\n"):
        fields = {}
        for line in chunk.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip().lower()] = value.strip()
        if fields:
            blocks.append(fields)
    return blocks


def _cpu_model(blocks: list[dict[str, str]]) -> str:
    """The CPU's marketing name; arm64 kernels often give only implementer and part numbers."""
    for key in ("model name", "hardware", "cpu model"):
        for b in blocks:
            if b.get(key):
                return b[key]
    arm = next((b for b in blocks if "cpu implementer" in b), None)
    if arm is not None:
        return f"{platform.machine()} (implementer {arm['cpu implementer']}, part {arm.get('cpu part', '?')})"
    return platform.processor() or platform.machine() or "unknown"


def _physical_cores(blocks: list[dict[str, str]], logical: int) -> int:
    """Physical cores: psutil, else distinct (physical id, core id) pairs, else the logical count."""
    n = psutil.cpu_count(logical=False)
    if n:
        return int(n)
    pairs = {(b.get("physical id", "0"), b["core id"]) for b in blocks if "core id" in b}
    return len(pairs) or logical


def _isa(blocks: list[dict[str, str]]) -> list[str]:
    """The extensions of interest this CPU reports (x86 'flags', arm64 'features')."""
    raw = next((b.get("flags") or b.get("features") for b in blocks if b.get("flags") or b.get("features")), "")
    have = {_ISA_ALIASES.get(f, f) for f in (raw or "").split()}
    return [f for f in ISA_OF_INTEREST if f in have]


def cpu_info(cpuinfo_path: Path = CPUINFO) -> CpuInfo:
    """Identify the host CPU.

    Args:
        cpuinfo_path: the kernel's CPU description (a test may point at a saved copy).

    Returns:
        Model name, physical and logical core counts and the ISA extensions of interest.
    """
    blocks = read_cpuinfo(cpuinfo_path)
    logical = psutil.cpu_count(logical=True) or os.cpu_count() or max(len(blocks), 1)
    return CpuInfo(model=_cpu_model(blocks), physical_cores=_physical_cores(blocks, logical),
                   logical_cores=logical, isa=_isa(blocks))


def machine_facts() -> MachineFacts:
    """This machine's identity, cheaply: host, CPU, RAM, GPUs (NVML, no CUDA context), driver, CUDA."""
    nvml = nvml_inventory()
    mid = Path("/etc/machine-id")
    return MachineFacts(node=platform.node(), machine_id=mid.read_text().strip() if mid.exists() else "",
                        cpu=cpu_info(), ram_total=int(psutil.virtual_memory().total), gpus=nvml.gpus,
                        driver=nvml.driver, cuda_driver=nvml.cuda_driver,
                        cuda_runtime=cuda_runtime_name() if nvml.gpus else None)
