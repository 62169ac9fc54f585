"""Probe: measure the machine a plan is made for, and the model's own kernels on each of its devices.

``probe(...) -> HardwareReport``. The machine's facts come from :mod:`engine_bridge.machine_facts`, host
figures from :mod:`tasks.probing.host`, copy bandwidth from :mod:`tasks.probing.gpu`; ggml devices and kernel
timings come from engine workers (only the worker links llama.cpp). The fingerprint
(:func:`artifacts.records.keys.hardware_fingerprint`) covers the stable facts only, so a plan keyed by it
survives a reboot but not a RAM, GPU or driver change. The report also records what other processes took of the
CPUs while it measured (:func:`taken_under_load`): a probe of a busy machine predicts a slow one.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from artifacts.config import Settings
from artifacts.engine_params import EngineParams
from artifacts.model_info import ModelInfo, model_info
from artifacts.records.hardware import GpuInfo, GpuMemoryFit, HardwareReport, KernelTiming, RpcServer
from artifacts.records.keys import facts_fingerprint
from engine_bridge import ops, rpc
from engine_bridge.client import HIDE_GPUS, WorkerClient
from engine_bridge.errors import EngineError
from engine_bridge.gpu_inventory import nvml_inventory
from engine_bridge.gpumem import GpuMemoryMeter, GpuReading
from engine_bridge.machine_facts import machine_facts
from tasks import gpu_memory
from tasks.expert_hot import split_bytes
from tasks.probing.gpu import host_to_device_bandwidth
from tasks.probing.host import (
    ContentionMeter,
    cpu_contention,
    ram_read_bandwidth,
    storage_read_speed,
    usable_cpus,
)
from tasks.search.space import modelled_load

log = logging.getLogger(__name__)

GIB = 2**30
PREFILL_BATCH = 64  # one prefill micro-batch of this many tokens
DECODE_TOKENS = 8
TIMED_REPEATS = 3  # after one warm-up run: the first run after a load is 20-30% slow
PROBE_CTX = 512
GPU_HEADROOM = 1 * GIB  # KV cache, compute buffers and the CUDA context besides the weights
PROMPT_TEXT = (
    "The harbour master counted the ships that came in before the storm: eleven trawlers, two ferries and "
    "a tanker that had lost its radio. Each captain reported the weather they had seen, the fuel they had "
    "left and the cargo they carried, and the clerk wrote every figure into a ledger that nobody would "
    "read until the inquiry, three winters later, asked why the lighthouse had been dark that night."
)
# The probe times the model's kernels with one thread per physical core, and llama.cpp's threads meet at a barrier
# after every op, so a step is as slow as its most preempted thread: on the 2-core development machine one
# busy-looping process made the probe's CPU decode 34-47x slower (2.8 -> 96-133 ms/token), two of them 2.5-6x, and
# issue 56's probe at a load average of ~9 predicted 1.4 tok/s where 10.3 were measured. A probe is taken under load
# when other processes kept busy, on average, more than this many CPUs beyond those its threads leave free (the CPUs
# Flux may use less the kernels' threads: the hyperthread siblings of an SMT machine, none on the 2-core one); less is
# the background every machine has. Not the load average: it lags a minute behind and counts the probe's own threads.
BUSY_MARGIN_CPUS = 0.5
QUIET_SAMPLE_S = 1.0  # how long a stored busy probe's machine is watched before it is measured again


def _with_copy_bandwidth(gpus: list[GpuInfo], bus_ids: list[str]) -> list[GpuInfo]:
    """The GPUs with their measured host-to-device bandwidth (None where it could not be measured)."""
    measured = host_to_device_bandwidth(bus_ids, timeout_s=60.0 + 15.0 * len(bus_ids))
    out = []
    for g, bus in zip(gpus, bus_ids, strict=True):
        pinned, pageable = measured.get(bus, (None, None))
        if pinned is not None:
            log.info("probe: GPU %d host-to-device %.1f GB/s pinned, %.1f GB/s pageable", g.index, pinned, pageable)
        out.append(g.model_copy(update={"h2d_pinned_gbs": pinned, "h2d_pageable_gbs": pageable}))
    return out


def _prompt(w: WorkerClient, timeout_s: float, n: int = PREFILL_BATCH) -> list[int]:
    """``n`` tokens of the fixed text (repeated as often as it takes)."""
    toks = w.tokenize(PROMPT_TEXT, special=False, timeout=timeout_s)
    if not toks:
        raise EngineError("probe_failed", "the model's tokenizer turned the probe text into no tokens")
    return (toks * (n // len(toks) + 1))[:n]


def _time_kernels(w: WorkerClient, model_path: Path, params: EngineParams, device: str, n_layer: int,
                  settings: Settings) -> KernelTiming:
    """Load on ``device`` and time a prefill micro-batch and a few decode tokens (best of the repeats)."""
    t = settings.serve.worker_timeouts
    load = w.request(ops.LOAD, ops.LoadArgs(model=str(model_path), params=params), timeout=t.load_s)
    prompt = _prompt(w, t.rpc_s)
    args = ops.TimedRunArgs(prompt=prompt, n_gen=DECODE_TOKENS)
    runs = [w.request(ops.TIMED_RUN, args, timeout=settings.plan.measure_timeout_s) for _ in range(1 + TIMED_REPEATS)]
    runs = [r for r in runs[1:] if r.prompt_tokens > 0 and r.gen_tokens > 0]
    if not runs:
        raise EngineError("probe_failed", f"llama.cpp reported no timed tokens on {device}")
    prefill = min(r.prompt_ms / r.prompt_tokens for r in runs)
    decode = min(r.gen_ms / r.gen_tokens for r in runs)
    layers = max(n_layer, 1)
    log.info("probe: %s kernels: load %.0f ms, prefill %.2f ms/token (batch %d), decode %.2f ms/token, %d threads",
             device, load.load_ms, prefill, PREFILL_BATCH, decode, params.n_threads)
    return KernelTiming(device=device, n_threads=params.n_threads, decode_ms_per_token=decode,
                        prefill_ms_per_token=prefill, prefill_batch=PREFILL_BATCH,
                        decode_ms_per_layer=decode / layers, prefill_ms_per_layer=prefill / layers,
                        flash_attn=params.flash_attn, load_ms=load.load_ms)


def _params(info: ModelInfo, threads: int, **placement: Any) -> EngineParams:
    """Small-context parameters for kernel timing."""
    n_ctx = max(PREFILL_BATCH + DECODE_TOKENS + 8, min(PROBE_CTX, info.n_ctx_train or PROBE_CTX))
    return EngineParams(n_ctx=n_ctx, n_batch=PREFILL_BATCH, n_ubatch=PREFILL_BATCH, n_threads=threads,
                        n_threads_batch=threads, **placement)


def _worker(settings: Settings, env: Mapping[str, str] | None = None) -> WorkerClient:
    return WorkerClient(log_path=settings.logs_dir / "probe-worker.log", env=env,
                        hello_timeout_s=settings.serve.worker_timeouts.hello_s)


def _gpu_kernels(w: WorkerClient, meter: GpuMemoryMeter, model_path: Path, info: ModelInfo,
                 gpus: list[dict[str, Any]], threads: int, settings: Settings) -> tuple[list[KernelTiming], list[GpuMemoryFit]]:
    """Whole-model timings on each GPU the model fits on, and the memory model's correction there from the
    calibration loads (:mod:`tasks.gpu_memory`); a failure there is logged, not raised."""
    out, fits = [], []
    for k, dev in enumerate(gpus):
        name = str(dev["name"])
        if info.file_bytes + GPU_HEADROOM > int(dev["memory_free"]):
            log.info("probe: %s has %.1f GiB free: the model (%.1f GiB) is not timed there", name,
                     int(dev["memory_free"]) / GIB, info.file_bytes / GIB)
            continue
        params = _params(info, threads, n_gpu_layers=-1, split_mode="none", main_gpu=k, flash_attn=True)
        try:
            timing = _time_kernels(w, model_path, params, name, info.n_layer, settings)
            residuals: dict[str, int] = {}
            steps: dict[str, tuple[float, float]] = {}
            for kind, load in gpu_memory.calibration_loads(info, params, name):
                try:
                    reading, step = _calibration_reading(w, meter, model_path, load, settings, first=kind == "whole")
                except EngineError as exc:
                    log.warning("probe: %s memory, %s load failed (its correction is left out): %s", name, kind, exc)
                    continue
                if step is not None:  # the hybrid shape's own step, for the cost model to be checked against
                    steps[kind] = step
                    log.info("probe: %s %s load: prefill %.2f ms/token (%d tokens), decode %.2f ms/token", name,
                             kind, step[0], gpu_memory.CALIBRATION_PROMPT, step[1])
                if reading is None:
                    break
                held = reading.per_gpu[k] if k < len(reading.per_gpu) else max(reading.per_gpu)
                model = modelled_load(info, load, name, experts_on_host=kind != "whole") + split_bytes(
                    info, load.expert_split).get(name, 0)
                residuals[kind] = held - model
                if kind == "whole":
                    timing = timing.model_copy(update={"gpu_bytes": held, "gpu_bytes_predicted": model})
                log.info("probe: %s memory, %s load: measured %.2f GiB (%s), memory model %.2f GiB", name, kind,
                         held / GIB, reading.method, model / GIB)
            out.append(timing)
            if residuals:
                fits.append(gpu_memory.fit(name, residuals, steps))
        except EngineError as exc:
            log.warning("probe: kernel timing on %s failed: %s", name, exc)
    return out, fits


def _calibration_reading(w: WorkerClient, meter: GpuMemoryMeter, model_path: Path, load: EngineParams,
                         settings: Settings, first: bool) -> tuple[GpuReading | None, tuple[float, float] | None]:
    """The GPU memory a calibration load holds after one run (None: NVML has no reading) and that run's
    (prefill, decode) ms per token (None for the first: the load the kernels were timed on, read after their
    runs). A per-expert split, read from the environment when a model loads, gets a worker of its own."""
    env = load.environment()
    own = _worker(settings, env) if env.get("FLUX_MOE_SPLIT") else None
    step = None
    try:
        if own is not None:
            own.start()
        use = own or w
        if not first:
            t = settings.serve.worker_timeouts
            use.request(ops.LOAD, ops.LoadArgs(model=str(model_path), params=load), timeout=t.load_s)
            run = ops.TimedRunArgs(prompt=_prompt(use, t.rpc_s, gpu_memory.CALIBRATION_PROMPT),
                                   n_gen=gpu_memory.CALIBRATION_GEN)
            tm = use.request(ops.TIMED_RUN, run, timeout=settings.plan.measure_timeout_s)  # read as finalists are
            if tm.prompt_tokens and tm.gen_tokens:
                step = (tm.prompt_ms / tm.prompt_tokens, tm.gen_ms / tm.gen_tokens)
        reading = meter.read(use.pid)
    finally:
        if own is not None:
            own.close(timeout=5)
    if own is not None and reading is not None and reading.method != "per-process":
        return None, step  # a device-wide delta would count the first worker's load too (it is the last load)
    return reading, step


def engine_probe(model_path: Path, info: ModelInfo, threads: int,
                 settings: Settings) -> tuple[list[dict[str, object]], list[KernelTiming], list[GpuMemoryFit]]:
    """ggml's devices and the model's kernels timed on each (CPU first), through engine workers.

    Args:
        model_path: the model to time.
        info: its header summary (layer count, file size).
        threads: CPU threads for decode and batch (the physical core count).
        settings: worker log location and timeouts.

    Raises:
        EngineError: the worker failed to start, or the model could not be loaded or run on the CPU.
    """
    meter = GpuMemoryMeter()  # its baseline before the worker starts: a device delta is the worker's
    with _worker(settings) as w:
        devices = [d.model_dump() for d in w.request(ops.DEVICES, timeout=settings.serve.worker_timeouts.rpc_s).devices]
        gpus = [d for d in devices if d.get("kind") == "gpu"]
        log.info("probe: ggml devices: %s", ", ".join(f"{d['name']} ({d['kind']})" for d in devices))
        if not gpus:  # nothing to hide: this worker times the CPU too
            return devices, [_time_kernels(w, model_path, _params(info, threads), "CPU", info.n_layer, settings)], []
        kernels, fits = _gpu_kernels(w, meter, model_path, info, gpus, threads, settings)
    with _worker(settings, env=HIDE_GPUS) as w:  # CPU kernels timed as a CPU-only plan runs them
        cpu = _time_kernels(w, model_path, _params(info, threads), "CPU", info.n_layer, settings)
    return devices, [cpu, *kernels], fits


def probe(model_path: Path, model_hash: str, settings: Settings, backend_build: str,
          rpc_servers: Sequence[RpcServer] = ()) -> HardwareReport:
    """Measure this machine for planning ``model_path``.

    Args:
        model_path: the model file (its drive is read, its kernels are timed).
        model_hash: the model's content hash (recorded in the report).
        settings: the process's settings (worker logs and timeouts).
        backend_build: the backend build id (recorded in the report).
        rpc_servers: the llama.cpp RPC servers the plan may use (identified): their links are measured.

    Returns:
        CPU, RAM, storage, GPUs, ggml devices and kernel timings, with the hardware fingerprint.

    Raises:
        ModelFileError: the model file cannot be read.
        EngineError: the engine worker could not load or run the model on the CPU.
    """
    info = model_info(model_path)
    facts = machine_facts().model_copy(update={"rpc": list(rpc_servers)})
    cpu = facts.cpu
    vm = psutil.virtual_memory()
    meter = ContentionMeter()
    ram = ram_read_bandwidth(int(vm.available), threads=usable_cpus())
    storage = storage_read_speed(model_path)
    nvml = nvml_inventory()
    gpus = _with_copy_bandwidth(nvml.gpus, nvml.bus_ids) if nvml.gpus else []
    devices, kernels, fits = engine_probe(model_path, info, cpu.physical_cores, settings)
    load = meter.read()
    report = HardwareReport(
        fingerprint=facts_fingerprint(facts), cpu=cpu,
        ram_total=facts.ram_total, ram_available=int(vm.available), ram_read_gbs=ram.gbs,
        ram_read_gbs_1thread=ram.gbs_1thread, storage_read_gbs=storage.gbs, storage_method=storage.method,
        gpus=gpus, driver=facts.driver, ggml_devices=devices, kernels=kernels, model_hash=model_hash,
        backend_build=backend_build, gpu_memory=fits, rpc_servers=[rpc.measure(r) for r in rpc_servers],
        others_cpus=round(load.others_cpus, 3), load_avg_1m=load.load_avg_1m, usable_cpus=usable_cpus())
    log.info("probe: fingerprint %s (%s, %d cores, %d GiB, %d GPU(s)); %s", report.fingerprint[:12], cpu.model,
             cpu.logical_cores, round(vm.total / GIB), len(gpus), load_words(report))
    return report


def spare_cpus(hw: HardwareReport) -> int:
    """CPUs the probe's CPU kernels left free: those Flux could use less the kernels' threads."""
    threads = max((k.n_threads for k in hw.kernels if k.device == "CPU"), default=hw.cpu.physical_cores)
    return max(0, (hw.usable_cpus or hw.cpu.logical_cores) - threads)


def busy_limit(hw: HardwareReport) -> float:
    """Other processes' CPUs above which ``hw``'s machine was busy (see BUSY_MARGIN_CPUS)."""
    return spare_cpus(hw) + BUSY_MARGIN_CPUS


def taken_under_load(hw: HardwareReport) -> bool:
    """Whether the probe was taken while other processes kept more CPUs busy than its threads left free (False for
    a probe stored before this was measured: unknown)."""
    return hw.others_cpus is not None and hw.others_cpus > busy_limit(hw)


def load_words(hw: HardwareReport, during: str = "while it ran") -> str:
    """What other processes took of the CPUs while ``hw`` was probed, for people (``during``: how the sentence
    names the probe)."""
    if hw.others_cpus is None:
        return "the CPUs' use by other processes was not measured (a probe stored by an older Flux)"
    avg = f", at a load average of {hw.load_avg_1m:.1f}" if hw.load_avg_1m is not None else ""
    return (f"other processes kept {hw.others_cpus:.1f} of {hw.usable_cpus or hw.cpu.logical_cores} CPUs busy "
            f"{during}{avg}")


def quiet_now(hw: HardwareReport, seconds: float = QUIET_SAMPLE_S) -> tuple[bool, float]:
    """(whether other processes now keep no more CPUs busy than ``hw``'s busy limit, the CPUs they keep busy),
    watched for ``seconds``."""
    others = cpu_contention(seconds).others_cpus
    return others <= busy_limit(hw), others
