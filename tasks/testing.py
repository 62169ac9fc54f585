"""Honest stand-ins for hardware that cannot run here (GPUs), and hand-built plans, shipped with the package.

CPU-only CI exercises the GPU code paths (placement, budgets, overrides, cost model) with these reports.
Their numbers are the H200 machine's measured figures (docs/gpu.md, notes on the GPU baselines), not
guesses; nothing here pretends to run a kernel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from artifacts.config import Settings
from artifacts.engine_params import EngineParams
from artifacts.records.evidence import MeasureSummary, ValidationResult
from artifacts.records.hardware import CpuInfo, GpuInfo, HardwareReport, KernelTiming
from artifacts.records.plan import Plan, PlanRequest, seal
from artifacts.records.search import Candidate, Placement, Prediction

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


def stored_plan(settings: Settings, model: Path, params: EngineParams, *, finalists: int = 1,
                key_extra: dict[str, Any] | None = None, **overrides: Any) -> Plan:
    """Store and return a plan for ``model`` with ``params``, without running the planner.

    For tests and benchmark scripts that need a plan to serve or bench, not a planning result. The plan
    carries this machine's real model hash, backend build, hardware fingerprint and driver, so ``flux
    serve`` and ``flux bench`` accept it. What only the planner knows (measurements, predictions,
    validation) is filler, saying so in its key. Fields in ``overrides`` replace the real ones. The id is
    the content id of the body, as a real plan's.
    """
    import datetime as dt

    from artifacts.filehash import model_hash
    from artifacts.records.keys import facts_fingerprint
    from artifacts.records.kinds import PLAN
    from artifacts.records.store import Records
    from engine_bridge.backend import backend_info
    from engine_bridge.machine_facts import machine_facts

    facts = machine_facts()
    fingerprint = facts_fingerprint(facts)
    mh = model_hash([model], settings.cache_dir)
    build = backend_info(settings.cache_dir).build_id
    req = PlanRequest(model=str(model), ctx=params.n_ctx, concurrency=params.n_seq_max)
    cand = Candidate(id="c000", family="hand-built", placement=Placement(layer_device=["CPU"] * 4), params=params,
                     weights_bytes={"CPU": model.stat().st_size}, kv_bytes={"CPU": 8 << 20},
                     compute_bytes={"CPU": 16 << 20})
    summaries = [MeasureSummary(candidate_id=f"c{i:03d}", prefill_tps=500.0 - 50 * i, decode_tps=50.0 - 5 * i,
                                workload_s=1.0 + i, n_trials=3) for i in range(finalists)]
    body: dict[str, Any] = {
        "key": {"model_hash": mh, "hardware": fingerprint, "backend_build": build, "driver": facts.driver,
                "flags": req.model_dump(exclude={"model"}), "settings": {"hand_built": True, **(key_extra or {})}},
        "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "model_path": str(model), "model_name": model.stem, "model_hash": mh, "hardware_fingerprint": fingerprint,
        "backend_build": build, "driver": facts.driver, "request": req.model_dump(), "candidate": cand.model_dump(),
        "measured": summaries[0].model_dump(),
        "predicted": Prediction(candidate_id=cand.id, prefill_tps=400.0, decode_tps=40.0, score_s=1.2).model_dump(),
        "validation": ValidationResult(candidate_id=cand.id, mean_kl=0.0, max_kl=0.0, top1_agreement=1.0,
                                       n_tokens=48, passed=True).model_dump(),
        "finalists": [s.model_dump() for s in summaries], "predictions": [], "median_prediction_error": None,
        "roofline_decode_tps": None, "memory_budget": {"CPU": 8 << 30}, "trials_table": "none",
        "quality_profile": "reference", "workload_prefill_share": 0.5,
    }
    body.update(overrides)
    plan = seal(body)
    Records.at(settings.data_dir).put(PLAN, plan, key=plan.id)
    return plan
