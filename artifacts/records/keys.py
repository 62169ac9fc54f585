"""The keys records are found by, shared by the planner and the server: the hardware fingerprint (plans), the
probe key (probe reports) and the plan key (a stored plan reused for the same request on the same machine).

A plan's own id is the content id of its body (:func:`artifacts.records.plan.plan_id`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from artifacts.ids import content_id
from artifacts.records.hardware import CpuInfo, GpuInfo, HardwareReport, MachineFacts
from artifacts.records.plan import PlanRequest

GIB = 2**30


def hardware_fingerprint(cpu: CpuInfo, ram_total: int, gpus: Sequence[GpuInfo], driver: str | None) -> str:
    """Content id of the machine's stable facts (no free memory, no measured speed).

    Args:
        cpu: the CPU (its model and logical core count).
        ram_total: RAM bytes (rounded to GiB, so a kernel reserving a little more does not change it).
        gpus: the GPUs (name, total memory, compute capability).
        driver: the NVIDIA driver version, or None.
    """
    return content_id({
        "cpu_model": cpu.model, "logical_cores": cpu.logical_cores, "ram_gib": round(ram_total / GIB),
        "gpus": [{"name": g.name, "memory_total": g.memory_total, "compute_capability": g.compute_capability}
                 for g in gpus],
        "driver": driver,
    })


def facts_fingerprint(facts: MachineFacts) -> str:
    """The hardware fingerprint of ``facts`` (see :func:`hardware_fingerprint`); with RPC servers, their
    identities too (endpoint, build, device sizes): a plan spanning them is valid only with them."""
    local = hardware_fingerprint(facts.cpu, facts.ram_total, facts.gpus, facts.driver)
    return content_id({"local": local, "rpc": [s.identity() for s in facts.rpc]}) if facts.rpc else local


def probe_key(facts: MachineFacts, model_hash: str, backend_build: str, code: str | None = None) -> dict[str, Any]:
    """Key of the probe report: everything a measurement of this machine depends on, read before measuring.

    Host (name, machine id, CPU, RAM), every GPU (name, UUID, memory, compute capability), the driver,
    the CUDA driver and runtime versions, the model and the backend build: a swapped GPU, a new driver or
    another build is a new probe, so ``flux plan --replan`` never reuses a stale one; so is another planner
    (``code``, :func:`artifacts.code_id.code_id`), whose probe may measure differently.
    """
    key: dict[str, Any] = {"code": code} if code is not None else {}
    return key | {"stage": "probe", "model": model_hash, "backend": backend_build, "host": {
        "node": facts.node, "machine_id": facts.machine_id, "cpu": facts.cpu.model,
        "cpus": facts.cpu.logical_cores, "ram_gib": round(facts.ram_total / GIB),
        "gpus": [{"name": g.name, "uuid": g.uuid, "memory_total": g.memory_total,
                  "compute_capability": g.compute_capability} for g in facts.gpus],
        "driver": facts.driver, "cuda_driver": facts.cuda_driver, "cuda_runtime": facts.cuda_runtime}} | (
        {"rpc": [s.identity() for s in facts.rpc]} if facts.rpc else {})


def plan_key(model_hash: str, hw: HardwareReport, backend_build: str, req: PlanRequest,
             settings_view: dict[str, Any], routing: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The facts a plan is valid for (its identity minus the time it was made).

    ``routing``: the id of the routing trace that chose a per-expert placement's experts; another workload
    routes differently and is another plan. ``code``: the planner's code id
    (:func:`artifacts.code_id.code_id`): a planner that changed makes new plans. ``--gpu-mem-budget`` on a machine
    where llama.cpp sees no GPU shapes nothing: it is left out, so the plan of the same request without it is found.
    """
    flags = req.model_dump(exclude={"model"})
    if not any(d.get("kind") == "gpu" for d in hw.ggml_devices):
        flags["gpu_mem_budget_gib"] = None
    key = {"model_hash": model_hash, "hardware": hw.fingerprint, "backend_build": backend_build,
           "driver": hw.driver, "flags": flags, "settings": settings_view}
    if code is not None:
        key["planner_code"] = code
    return {**key, "routing": routing} if routing is not None else key
