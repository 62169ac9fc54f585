"""The probe stage on this machine: real CPU/RAM/storage measurements, real NVML and CUDA runtime calls
(which find no GPU here), and the tiny model's kernels timed by a real llama.cpp worker."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from artifacts.config import Settings, load_settings
from artifacts.ids import content_id
from artifacts.model_info import model_info
from artifacts.records.hardware import CpuInfo, GpuInfo, HardwareReport, MachineFacts
from artifacts.records.keys import facts_fingerprint, hardware_fingerprint, probe_key
from engine_bridge.gpu_inventory import nvml_inventory
from engine_bridge.machine_facts import cpu_info, machine_facts, read_cpuinfo
from tasks.probing.gpu import host_to_device_bandwidth, load_cudart, measure_all, normalize_bus_id
from tasks.probing.host import GIB, MIB, ram_buffer_bytes, ram_read_bandwidth, storage_read_speed
from tasks.probing.machine import PREFILL_BATCH, probe

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")

HAS_GPU = bool(nvml_inventory().gpus)
no_gpu_here = pytest.mark.skipif(HAS_GPU, reason="this machine has an NVIDIA GPU")
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU")


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    home = tmp_path_factory.mktemp("probe-home")
    return load_settings({"HOME": str(home), "XDG_DATA_HOME": str(home / "data"),
                          "XDG_CACHE_HOME": str(home / "cache")})


@pytest.fixture(scope="module")
def report(tiny_moe: Path, settings: Settings) -> HardwareReport:
    return probe(tiny_moe, "model-hash-1", settings, "build-1")


# -- the whole probe -----------------------------------------------------------------------------------
def test_host_figures_are_plausible(report: HardwareReport) -> None:
    cpu = report.cpu
    assert cpu.model and cpu.model != "unknown"
    assert 1 <= cpu.physical_cores <= cpu.logical_cores
    assert 0 < report.ram_available <= report.ram_total
    assert report.ram_read_gbs > 0.1 and report.ram_read_gbs_1thread > 0.1
    assert report.storage_read_gbs > 0.001
    assert report.model_hash == "model-hash-1" and report.backend_build == "build-1"


def test_storage_method_is_recorded_and_flags_a_small_file(report: HardwareReport) -> None:
    assert report.storage_method.split()[0] in ("o_direct", "fadvise_dontneed", "buffered")
    assert "small file" in report.storage_method  # the tiny model is ~2 MiB


def test_isa_comes_from_proc_cpuinfo(report: HardwareReport) -> None:
    blocks = read_cpuinfo()
    if not blocks:
        pytest.skip("no /proc/cpuinfo")
    flags = set((blocks[0].get("flags") or blocks[0].get("features") or "").split())
    flags |= {"neon"} if "asimd" in flags else set()
    assert set(report.cpu.isa) <= flags
    assert report.cpu.isa == [f for f in report.cpu.isa if f in flags]
    if "avx2" in flags:
        assert "avx2" in report.cpu.isa


def test_cpu_kernels_are_timed(report: HardwareReport, tiny_moe: Path) -> None:
    cpu = [k for k in report.kernels if k.device == "CPU"]
    assert len(cpu) == 1
    k = cpu[0]
    n_layer = model_info(tiny_moe).n_layer
    assert k.decode_ms_per_token > 0 and k.prefill_ms_per_token > 0
    assert k.prefill_batch == PREFILL_BATCH and k.n_threads == report.cpu.physical_cores
    assert k.decode_ms_per_layer == pytest.approx(k.decode_ms_per_token / n_layer)
    assert k.prefill_ms_per_layer == pytest.approx(k.prefill_ms_per_token / n_layer)


def test_ggml_devices_come_from_the_worker(report: HardwareReport) -> None:
    kinds = {str(d["name"]): d["kind"] for d in report.ggml_devices}
    assert kinds.get("CPU") == "cpu"
    assert all(int(str(d["memory_total"])) > 0 for d in report.ggml_devices)


@no_gpu_here
def test_no_gpus_and_no_driver_here(report: HardwareReport) -> None:
    assert report.gpus == [] and report.driver is None
    assert [k.device for k in report.kernels] == ["CPU"]


def test_fingerprint_is_stable_across_probes(report: HardwareReport, tiny_moe: Path, settings: Settings) -> None:
    again = probe(tiny_moe, "model-hash-2", settings, "build-2")
    assert again.fingerprint == report.fingerprint
    assert again.cpu == report.cpu and again.ram_total == report.ram_total


# -- the fingerprint -----------------------------------------------------------------------------------
CPU = CpuInfo(model="Some CPU", physical_cores=8, logical_cores=16, isa=["avx2"])
GPU = GpuInfo(index=0, name="NVIDIA H200", memory_total=150_000_000_000, memory_free=140_000_000_000,
              pcie_gen=5, pcie_width=16, compute_capability="9.0")


def test_fingerprint_ignores_free_memory_and_measured_speeds() -> None:
    base = hardware_fingerprint(CPU, 64 * GIB, [GPU], "580.1")
    busy = GPU.model_copy(update={"memory_free": 3 * GIB, "h2d_pinned_gbs": 55.0, "h2d_pageable_gbs": 8.0})
    assert hardware_fingerprint(CPU, 64 * GIB + 100 * MIB, [busy], "580.1") == base


VARIANTS: dict[str, tuple[CpuInfo, int, list[GpuInfo], str | None]] = {
    "cpu": (CPU.model_copy(update={"model": "Other CPU"}), 64 * GIB, [GPU], "580.1"),
    "cores": (CPU.model_copy(update={"logical_cores": 32}), 64 * GIB, [GPU], "580.1"),
    "ram": (CPU, 128 * GIB, [GPU], "580.1"),
    "gpu": (CPU, 64 * GIB, [GPU.model_copy(update={"name": "NVIDIA H100"})], "580.1"),
    "gpu-memory": (CPU, 64 * GIB, [GPU.model_copy(update={"memory_total": 80 * GIB})], "580.1"),
    "cc": (CPU, 64 * GIB, [GPU.model_copy(update={"compute_capability": "9.1"})], "580.1"),
    "driver": (CPU, 64 * GIB, [GPU], "575.4"),
    "no-gpu": (CPU, 64 * GIB, [], None),
}


@pytest.mark.parametrize("change", sorted(VARIANTS))
def test_fingerprint_changes_with_the_hardware(change: str) -> None:
    base = hardware_fingerprint(CPU, 64 * GIB, [GPU], "580.1")
    assert hardware_fingerprint(*VARIANTS[change]) != base


# -- host parts ----------------------------------------------------------------------------------------
def test_ram_bandwidth_one_and_two_threads() -> None:
    bw = ram_read_bandwidth(GIB, threads=2, repeats=2)
    assert bw.gbs > 0.1 and bw.gbs_1thread > 0.1 and bw.threads == 2
    assert bw.buffer_bytes == 128 * MIB  # capped at an eighth of the available RAM it was given


def test_ram_buffer_size_rules() -> None:
    assert ram_buffer_bytes(24 * GIB, 32 * MIB) == 256 * MIB
    assert ram_buffer_bytes(24 * GIB, 105 * MIB) == 840 * MIB
    assert ram_buffer_bytes(64 * GIB, 320 * MIB) == GIB
    assert ram_buffer_bytes(GIB, 32 * MIB) == 128 * MIB
    assert ram_buffer_bytes(10 * MIB, 0) == 16 * MIB


def test_storage_fallback_and_a_large_file(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    with path.open("wb") as f:
        for _ in range(9):
            f.write(bytes(range(256)) * (32 * 1024))  # 8 MiB each
    direct = storage_read_speed(path, limit=64 * MIB)
    assert direct.method in ("o_direct", "fadvise_dontneed") and direct.gbs > 0.001
    assert direct.bytes_read == 64 * MIB
    dropped = storage_read_speed(path, direct=False)
    assert dropped.method == "fadvise_dontneed" and dropped.bytes_read == 72 * MIB and dropped.gbs > 0.001


def test_arm64_cpuinfo_is_understood(tmp_path: Path) -> None:
    text = ("processor\t: 0\nBogoMIPS\t: 2000.00\nFeatures\t: fp asimd evtstrm aes asimdhp asimddp sve i8mm bf16\n"
            "CPU implementer\t: 0x41\nCPU architecture: 8\nCPU part\t: 0xd4f\n\n"
            "processor\t: 1\nFeatures\t: fp asimd evtstrm aes asimdhp asimddp sve i8mm bf16\n"
            "CPU implementer\t: 0x41\nCPU part\t: 0xd4f\n")
    (tmp_path / "cpuinfo").write_text(text)
    cpu = cpu_info(tmp_path / "cpuinfo")
    assert cpu.isa == ["neon", "asimdhp", "asimddp", "i8mm", "bf16", "sve"]
    assert "0x41" in cpu.model and "0xd4f" in cpu.model


# -- GPU parts without a GPU ---------------------------------------------------------------------------
def test_nvml_absent_means_no_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # how Python spells "not installed"
    assert nvml_inventory() == ([], None, [], None)


@no_gpu_here
def test_nvml_without_a_driver_means_no_gpus() -> None:
    assert nvml_inventory() == ([], None, [], None)


@no_gpu_here
def test_copy_bandwidth_without_a_gpu_is_none() -> None:
    assert load_cudart() is None
    assert measure_all(["00000000:3B:00.0"]) == {}
    assert host_to_device_bandwidth(["00000000:3B:00.0"], timeout_s=60) == {}  # the child process too
    assert host_to_device_bandwidth([]) == {}


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7))
def test_nvml_and_cuda_bus_ids_normalize_alike(domain: int, bus: int, dev: int, fn: int) -> None:
    nvml = f"{domain:08X}:{bus:02X}:{dev:02X}.{fn}"
    cuda = f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}"
    assert normalize_bus_id(nvml) == normalize_bus_id(cuda)


# -- with a GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_gpu
def test_gpus_are_probed(report: HardwareReport) -> None:
    assert report.driver and report.gpus
    for g in report.gpus:
        assert g.memory_total >= g.memory_free > 0 and g.compute_capability
        assert g.h2d_pinned_gbs is not None and g.h2d_pinned_gbs > 1.0
        assert g.h2d_pageable_gbs is not None and g.h2d_pageable_gbs > 0.5
    gpu_kernels = [k for k in report.kernels if k.device != "CPU"]
    assert gpu_kernels and all(k.decode_ms_per_token > 0 for k in gpu_kernels)


# -- the probe report's key -------------------------------------------------------------------------------
FACTS = MachineFacts(node="box", machine_id="m1", cpu=CPU, ram_total=64 * GIB,
                     gpus=[GPU.model_copy(update={"uuid": "GPU-aaaa"})], driver="580.1", cuda_driver="13.0",
                     cuda_runtime="libcudart.so.13.0.96")
FACT_CHANGES: dict[str, dict[str, object]] = {
    "gpu-name": {"gpus": [FACTS.gpus[0].model_copy(update={"name": "NVIDIA H100"})]},
    "gpu-uuid": {"gpus": [FACTS.gpus[0].model_copy(update={"uuid": "GPU-bbbb"})]},
    "gpu-memory": {"gpus": [FACTS.gpus[0].model_copy(update={"memory_total": 80 * GIB})]},
    "second-gpu": {"gpus": [*FACTS.gpus, FACTS.gpus[0].model_copy(update={"index": 1, "uuid": "GPU-cccc"})]},
    "no-gpu": {"gpus": []},
    "driver": {"driver": "575.4"},
    "cuda-driver": {"cuda_driver": "12.8"},
    "cuda-runtime": {"cuda_runtime": "libcudart.so.12.8.90"},
    "ram": {"ram_total": 128 * GIB},
    "host": {"node": "other-box"},
}


@pytest.mark.parametrize("change", sorted(FACT_CHANGES))
def test_probe_key_changes_with_the_gpus_driver_and_cuda(change: str) -> None:
    base = content_id(probe_key(FACTS, "model", "build"))
    changed = FACTS.model_copy(update=FACT_CHANGES[change])
    assert content_id(probe_key(changed, "model", "build")) != base


def test_probe_key_changes_with_the_backend_build_and_model() -> None:
    base = content_id(probe_key(FACTS, "model", "build"))
    assert content_id(probe_key(FACTS, "model", "build-2")) != base
    assert content_id(probe_key(FACTS, "model-2", "build")) != base


def test_probe_key_ignores_free_memory_and_measured_speeds() -> None:
    busy = FACTS.gpus[0].model_copy(update={"memory_free": 3 * GIB, "h2d_pinned_gbs": 55.0})
    assert probe_key(FACTS.model_copy(update={"gpus": [busy]}), "m", "b") == probe_key(FACTS, "m", "b")


def test_machine_facts_on_this_machine_match_the_probe(report: HardwareReport) -> None:
    facts = machine_facts()
    assert facts_fingerprint(facts) == report.fingerprint
    assert facts.cpu == report.cpu and facts.driver == report.driver


def test_each_calibration_load_is_read_and_a_failed_mapped_load_is_left_out(
        tiny_moe: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's memory calibration with real workers and loads. NVML's per-process answer (no GPU here) is
    replaced by a fixed figure. The mapped split's load gets a worker of its own, started with the split in its
    environment; this CPU build refuses a split onto CUDA0 (the H200 run reads it), so its correction is left
    out in one warning and the other loads' residuals stand, the timing with them."""
    import logging

    import psutil

    from engine_bridge.gpumem import GpuMemoryMeter, GpuReading
    from tasks.probing.machine import _gpu_kernels, _params, _worker
    from tasks.search.space import modelled_load

    monkeypatch.setattr(GpuMemoryMeter, "read", lambda self, pid: GpuReading(per_gpu=(2 * GIB,), method="per-process"))
    info = model_info(tiny_moe)
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # other tests' servers may run
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]  # the CLI's log set-up may stop propagation
    logging.getLogger("tasks.probing.machine").addHandler(handler)
    w = _worker(settings)
    w.start()
    try:
        timings, (fit,) = _gpu_kernels(w, GpuMemoryMeter(), tiny_moe, info,
                                       [{"name": "CUDA0", "memory_free": 64 * GIB}], 1, settings)
    finally:
        w.close(timeout=5)
        logging.getLogger("tasks.probing.machine").removeHandler(handler)
    assert [t.device for t in timings] == ["CUDA0"] and timings[0].gpu_bytes == 2 * GIB
    assert set(fit.residuals) == {"whole", "offload@256", "offload@512", "offload"} and not fit.mapped_by_ubatch
    # each hybrid load was read after a run of its own, whose step is kept (the whole load's is its kernel timing)
    assert set(fit.step_ms_by_load) == {"offload@256", "offload@512", "offload"}
    assert all(prefill > 0 and decode > 0 for prefill, decode in fit.step_ms_by_load.values())
    base = _params(info, 1, n_gpu_layers=-1, split_mode="none", main_gpu=0, flash_attn=True)
    assert fit.base_bytes == 2 * GIB - modelled_load(info, base, "CUDA0", experts_on_host=False)
    (warning,) = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert "mapped@512 load failed (its correction is left out)" in warning and "not in this build" in warning
    assert not [p for p in psutil.Process().children(recursive=True)
                if p.pid not in before and p.is_running() and p.status() != "zombie"], "a worker was left running"
