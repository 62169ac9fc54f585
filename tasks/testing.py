"""Honest stand-ins for hardware that cannot run here (GPUs), shipped with the package.

CPU-only CI exercises the GPU code paths (placement, budgets, overrides, cost model) with these reports.
Their numbers are the H200 machine's measured figures (docs/gpu.md, notes on the GPU baselines), not
guesses; nothing here pretends to run a kernel.
"""

from __future__ import annotations

from tasks.models import CpuInfo, GpuInfo, HardwareReport, KernelTiming

H200_MEMORY = 143_771 * 2**20


def h200_report(n_gpus: int = 1, model_hash: str = "test", free_gib: float | None = None) -> HardwareReport:
    """The H200 machine as its probe saw it (16 vCPU Emerald Rapids, 126 GiB RAM, PCIe Gen5 x16)."""
    free = int(free_gib * 2**30) if free_gib is not None else H200_MEMORY - 600 * 2**20
    gpus = [GpuInfo(index=i, name="NVIDIA H200", memory_total=H200_MEMORY, memory_free=free, pcie_gen=5,
                    pcie_width=16, compute_capability="9.0", h2d_pinned_gbs=55.5, h2d_pageable_gbs=8.2)
            for i in range(n_gpus)]
    return HardwareReport(
        fingerprint=f"h200x{n_gpus}", cpu=CpuInfo(model="Intel Xeon (Emerald Rapids)", physical_cores=8,
                                                     logical_cores=16, isa=["avx2", "avx512f", "amx_tile"]),
        ram_total=126 * 2**30, ram_available=120 * 2**30, ram_read_gbs=94.0, ram_read_gbs_1thread=12.0,
        storage_read_gbs=2.0, storage_method="fake", gpus=gpus, driver="580.159.04",
        ggml_devices=[{"name": "CPU", "kind": "cpu"}] + [{"name": f"CUDA{i}", "kind": "gpu", "memory_free": free,
                                                         "memory_total": H200_MEMORY} for i in range(n_gpus)],
        kernels=[KernelTiming(device="CPU", n_threads=16, decode_ms_per_token=32.8, prefill_ms_per_token=12.1,
                              prefill_batch=512, decode_ms_per_layer=0.68, prefill_ms_per_layer=0.25)],
        model_hash=model_hash, backend_build="fake")
