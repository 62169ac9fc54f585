"""The cost model: predicted prefill and decode speed of a candidate from the probe's numbers.

It ranks and prunes; it never decides. Decode at batch 1 is modelled as a fixed per-token cost plus the
bytes each device reads per token over that device's measured bandwidth; prefill as compute scaled from
the model's own prefill kernel timed by the probe, plus PCIe copies of host-resident weights for
micro-batches that llama.cpp offloads to a GPU (``GGML_OP_OFFLOAD_MIN_BATCH``). Host weights in the CPU's
repacked layout (``no_host``) decode faster and are never offloaded: their prefill is CPU compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from artifacts.model_info import KV_TYPES, ModelInfo, head_bytes
from artifacts.records.hardware import HardwareReport
from artifacts.records.search import Candidate, Placement, Prediction
from tasks.gpu_memory import offload_step
from tasks.kv_traffic import kv_bus_reads, kv_reads, state_reads
from tasks.rpc_link import link_ms

EXPERT_PARTS = ("gate", "up", "down")
GPU_HBM_GBS = 3000.0  # used only until a GPU kernel timing calibrates it (H200: 4.8 TB/s nominal)
GPU_TOKEN_OVERHEAD_MS = 3.0  # measured on the H200: batch-1 decode is bound by per-token launch cost
HYBRID_LAYER_SYNC_MS = 0.05  # per host<->GPU hand-over in a layer (notes: ~0.48 ms per CPU expert layer)
DEFAULT_OFFLOAD_MIN_BATCH = 32
# CPU matmuls on weights in the GPU's host buffer (pinned or mapped: the plain layout) against the CPU
# backend's repacked layout, which the probe's CPU-only kernel timing uses (notes: 23.0 vs 30.5 tok/s on the
# H200 box with every weight on the CPU). Hybrids with ``no_host`` get the repacked speed.
PLAIN_LAYOUT_SLOWDOWN = 30.5 / 23.0
# Attention that decodes on the host (its KV cache there: -nkvo, or layers left on the CPU) is bound by compute,
# not by reading the cache: each query head multiplies every cached key and value (GQA reads a KV head once per
# query head). Measured on the H200 host (run 9, 16 threads on 16 cores): a plan with 26 layers' KV on the host
# decoded 38.3 tok/s at a 64-token depth and 8.3 at 16,384, 94 ms more per token for 7.0 GFLOP of attention =
# 74 GFLOPS, 6x what the cache's bytes cost at the CPU's read bandwidth.
HOST_ATTN_GFLOPS_PER_CORE = 4.6
# Prefill of a hybrid with op offload copies its host weights to the GPU once per micro-batch (a prompt shorter
# than the micro-batch is a micro-batch of its own) at the probe's copy rate, then computes the micro-batch there;
# the two do not overlap. The GPU's compute per token is the probe's whole-model prefill (timed at 64 tokens),
# cheaper at larger batches by (64 / batch) ** 0.2: on the H200 run 9b's pinned hybrids (512-token micro-batches)
# measured 1,547 and 1,585 tok/s (predicted 1,748 and 1,594), run 13's host splits on 256-token prompts 620-676
# (predicted 629-664). A copy alone at the probe's rate had predicted 2,560-3,090 for run 9b.
GPU_PREFILL_BATCH_EXP = 0.2
# Beyond 512 tokens a micro-batch's compute per token keeps falling, faster: on the H100 (issue 50, the skewed
# qwen3-30b-a3b twin) the whole model on the GPU prefilled 7.3-8.3k tok/s (0.12-0.14 ms a token, where 512 tokens at
# the exponent above give 0.30 ms on the H200's probe), and a hybrid plan prefilled 1.5x faster at -ub 4096 than at
# 2048, which 0.30 ms of compute a token beside the copy would have held to 1.2x. Not assumed past 4,096 (measured).
GPU_PREFILL_LARGE_BATCH_EXP = 0.5
GPU_PREFILL_LARGEST_BATCH = 4096.0
# Prefill of a hybrid whose host computes its experts (no op offload, or repacked --no-host weights) is slower
# than the probe's whole-model CPU rate per byte says: on the H200 (runs 16-17, qwen3next and qwen35moe twins,
# 64-256-token prompts) four such finalists measured 90-308 tok/s where that rate predicted 2.02-2.20x as much.
# The probe's rate averages the dense weights, which a batch reuses across its tokens, with the experts, which
# see 1-2 tokens each (10 of 512, 8 of 256 experts per token); a hybrid leaves the host only the experts.
HYBRID_HOST_PREFILL_SLOWDOWN = 2.1
# A per-expert split layer (patches 0003-0004) pays its host round trip every step, priced like any hybrid layer
# (two hand-overs at HYBRID_LAYER_SYNC_MS: 0.10 ms against the 0.096 ms per layer the H200 anatomy measured,
# patches/llama.cpp/README.md), and its host part runs only on a step where one of its picks is cold (the idle
# host part is skipped): each host part that runs costs this much beyond the cold experts' bytes (the anatomy's
# A/B at 90% and 97% hot, 16 threads: 12.5 and 27 host parts per step, 8.96 and 11.24 ms a step).
SPLIT_HOST_PART_MS = 0.034
# A mapped split (patch 0006, EngineParams.expert_mapped) computes its cold picks on the GPU, whose kernels read
# those experts' bytes from pinned host memory over the bus, at this share of the probe's pinned copy rate, and each
# of its split layers adds its parts' kernels to the step's one graph. Fitted to the H200 anatomy of 2026-12-03
# (patches/llama.cpp/README.md; qwen3-30b-a3b twin, every layer split, 73/90/97% of the picks hot): the step grew
# over the whole model on the GPU by 0.98 ms + cold bytes at 47.6 GB/s, against the probe's 55.3 GB/s copies.
MAPPED_READ_SHARE = 0.86
MAPPED_LAYER_MS = 0.0204
# An adaptive expert cache (patch 0007) reads each split layer's picks back every FLUX_MOE_CACHE_SAMPLE (8) steps:
# one small device-to-host copy and sync per layer (~10 us, the anatomy's copy timings), an eighth of it a step.
# Its gain, a hot set that follows the routing, is not priced: measurement decides between static and adaptive.
CACHE_READ_MS = 0.010 / 8


@dataclass(frozen=True)
class Workload:
    """Token counts of the workload a plan optimises (prefill-heavy for coding agents).

    ``prompt_lengths``: each prompt's tokens, when known: prefill is then priced prompt by prompt (a prompt pays
    one copy of the host weights per micro-batch it spans, :func:`micro_batches`); else at the mean prompt.
    """

    prefill_tokens: int
    decode_tokens: int
    mean_prompt_tokens: float
    prompt_lengths: tuple[int, ...] = ()

    @property
    def prefill_share(self) -> float:
        """Fraction of the workload's tokens that are prompt tokens."""
        total = self.prefill_tokens + self.decode_tokens
        return self.prefill_tokens / total if total else 0.0


def layer_bytes(info: ModelInfo, placement: Placement) -> dict[str, tuple[float, float]]:
    """Per device: (bytes read per decoded token, bytes resident).

    Routed experts are read in proportion n_used / n_expert; everything else whole.
    """
    frac = info.n_expert_used / info.n_expert if info.n_expert else 1.0
    out: dict[str, list[float]] = {}

    def add(dev: str, read: float, resident: float) -> None:
        cur = out.setdefault(dev, [0.0, 0.0])
        cur[0] += read
        cur[1] += resident

    for layer in info.layers:
        roles = layer.bytes_by_role
        dense = sum(v for k, v in roles.items() if not k.startswith("experts_"))
        add(placement.layer_device[layer.index], dense, dense)
        for part in EXPERT_PARTS:
            b = roles.get(f"experts_{part}", 0)
            if b:
                dev = placement.expert_device[layer.index][part] if placement.expert_device else placement.layer_device[layer.index]
                add(dev, b * frac, b)
    head = head_bytes(info)
    add(placement.output_device, head, head)
    emb = info.bytes_by_role.get("embeddings", 0)
    add("CPU", 0.0, emb)  # the token embedding stays on the host; one row per token is read
    return {k: (v[0], v[1]) for k, v in out.items()}


def cpu_bandwidth(hw: HardwareReport, threads: int) -> float:
    """Measured host read bandwidth in bytes/s for ``threads`` threads (linear until it saturates)."""
    return min(hw.ram_read_gbs_1thread * threads, max(hw.ram_read_gbs, hw.ram_read_gbs_1thread)) * 1e9


def effective_cores(hw: HardwareReport, threads: int) -> float:
    """Compute a thread count buys: full physical cores, a fifth of a core per extra hyperthread."""
    t = min(threads, hw.cpu.logical_cores)
    return min(t, hw.cpu.physical_cores) + 0.2 * max(0, t - hw.cpu.physical_cores)


def _cpu_calibration(info: ModelInfo, hw: HardwareReport) -> tuple[float, float, int]:
    """(decode efficiency vs bandwidth bound, prefill ms per active byte, threads) from the CPU kernel timing."""
    k = next((k for k in hw.kernels if k.device == "CPU"), None)
    read_all = sum(r for r, _ in layer_bytes(info, all_on(info, "CPU")).values())
    if k is None or k.decode_ms_per_token <= 0:
        return 0.5, 0.0, hw.cpu.physical_cores
    bound_ms = read_all / cpu_bandwidth(hw, k.n_threads) * 1e3
    eff = min(1.0, bound_ms / k.decode_ms_per_token)
    return max(eff, 0.05), k.prefill_ms_per_token / max(read_all, 1.0), k.n_threads


def all_on(info: ModelInfo, device: str) -> Placement:
    """Every weight on one device."""
    return Placement(layer_device=[device] * info.n_layer,
                     expert_device=[dict.fromkeys(EXPERT_PARTS, device) for _ in range(info.n_layer)] if info.is_moe else [],
                     output_device=device)


def _gpu_bandwidth(hw: HardwareReport, info: ModelInfo | None = None) -> tuple[float, float]:
    """(GPU bytes/s, fixed ms per token) from a GPU kernel timing when the probe has one: the fixed cost is the
    probe's whole-model step less what its bytes take at that bandwidth, so a placement of every weight on the
    GPU predicts the step the probe timed (a fifth of it is bytes when the model is not known)."""
    k = next((k for k in hw.kernels if k.device != "CPU"), None)
    if k is None:
        return GPU_HBM_GBS * 1e9, GPU_TOKEN_OVERHEAD_MS
    if info is None:
        return GPU_HBM_GBS * 1e9, max(0.2, k.decode_ms_per_token * 0.8)
    whole = sum(r for r, _ in layer_bytes(info, all_on(info, k.device)).values())
    return GPU_HBM_GBS * 1e9, max(0.2, k.decode_ms_per_token - whole / (GPU_HBM_GBS * 1e9) * 1e3)


def split_host_parts(info: ModelInfo, cand: Candidate) -> float:
    """Expected host parts of a per-expert split that run in one decode step: a layer's runs unless all its
    ``n_expert_used`` picks are hot (picks taken as independent draws at the layer's hot share)."""
    if cand.params.expert_split is None or not cand.hot_share:
        return 0.0
    k = max(1, info.n_expert_used)
    return sum(1.0 - min(1.0, max(0.0, share)) ** k for share in cand.hot_share)


def _gpu_probe_fa(hw: HardwareReport) -> bool:
    """Whether the probe timed the GPU with flash attention (older probes did not)."""
    return next((k.flash_attn for k in hw.kernels if k.device != "CPU"), False)


def _transitions(placement: Placement) -> int:
    """Device hand-overs per token along the layer sequence, host<->GPU or GPU<->GPU (each a synchronisation)."""
    seq: list[str] = []
    for i, dev in enumerate(placement.layer_device):
        seq.append(dev)
        if placement.expert_device:
            seq.extend(placement.expert_device[i][p] for p in EXPERT_PARTS)
    seq.append(placement.output_device)
    return sum(1 for a, b in zip(seq, seq[1:], strict=False) if a != b)


def _picked_expert_bytes(info: ModelInfo, layer: int) -> float:
    """Expert bytes one token reads in ``layer`` (``n_used / n_expert`` of its expert tensors)."""
    frac = info.n_expert_used / info.n_expert if info.n_expert else 0.0
    return frac * sum(info.layers[layer].bytes_by_role.get(f"experts_{p}", 0) for p in EXPERT_PARTS)


def split_reads(info: ModelInfo, cand: Candidate) -> float:
    """Expert bytes a decoded token reads from GPU copies instead of the host (a per-expert split).

    Each split layer reads ``n_used / n_expert`` of its expert bytes per token, a ``hot_share`` of which
    come from its experts' copies on the GPU (the measured routing's share of picks).
    """
    if cand.params.expert_split is None or not cand.hot_share:
        return 0.0
    return sum(share * _picked_expert_bytes(info, i) for i, share in enumerate(cand.hot_share[:len(info.layers)]))


def mapped_reads(info: ModelInfo, cand: Candidate) -> float:
    """Expert bytes a decoded token of a mapped split reads over the bus: its split layers' cold picks."""
    split = cand.params.expert_split
    if split is None or not cand.params.expert_mapped:
        return 0.0
    shares = list(cand.hot_share) + [0.0] * len(info.layers)
    return sum((1.0 - shares[h.layer]) * _picked_expert_bytes(info, h.layer) for h in split.layers)


def mapped_bandwidth(hw: HardwareReport) -> float:
    """Bytes/s at which a GPU kernel reads pinned host memory (:data:`MAPPED_READ_SHARE` of the pinned copy rate)."""
    gpu = next((g for g in hw.gpus), None)
    return ((gpu.h2d_pinned_gbs if gpu else None) or 45.0) * MAPPED_READ_SHARE * 1e9


def _mapped_placement(cand: Candidate) -> Placement:
    """The placement as a mapped split runs it at decode: a split layer's experts on its layer's device."""
    split, pl = cand.params.expert_split, cand.placement
    if split is None or not cand.params.expert_mapped or not pl.expert_device:
        return pl
    layers = {h.layer for h in split.layers}
    return pl.model_copy(update={"expert_device": [
        dict.fromkeys(EXPERT_PARTS, pl.layer_device[i]) if i in layers else e for i, e in enumerate(pl.expert_device)]})


def _host_attention_layers(cand: Candidate) -> int:
    """Layers whose weights are on a GPU but whose KV cache (and so attention) is on the host."""
    p, devs = cand.params, cand.placement.layer_device
    first_offloaded = 0 if p.n_gpu_layers > len(devs) else len(devs) + 1 - p.n_gpu_layers
    return sum(1 for i, d in enumerate(devs) if d != "CPU" and (not p.offload_kqv or i < first_offloaded))


def decode_reads(info: ModelInfo, cand: Candidate, depth: float = 0.0) -> tuple[float, float]:
    """(host, GPU) bytes one decoded token reads under ``cand``: weights where the placement puts them, the
    expert picks a per-expert split serves from GPU copies moved to the GPU, the KV cache at ``depth`` and a
    hybrid model's recurrent state."""
    per_dev = layer_bytes(info, cand.placement)
    cpu_read = per_dev.get("CPU", (0.0, 0.0))[0]
    gpu_read = sum(r for d, (r, _) in per_dev.items() if d != "CPU")
    kv_cpu, kv_gpu = kv_reads(info, cand, depth)
    st_cpu, st_gpu = state_reads(info, cand)
    moved = split_reads(info, cand)
    return cpu_read + kv_cpu + st_cpu - moved - mapped_reads(info, cand), gpu_read + kv_gpu + st_gpu + moved


def host_attention_ms(info: ModelInfo, hw: HardwareReport, cand: Candidate, kv_cpu_bytes: float,
                      eff: float = 1.0) -> float:
    """Milliseconds a decoded token spends in attention over ``kv_cpu_bytes`` of KV cache on the host: the
    slower of reading those bytes and the query heads' multiply-adds over them (HOST_ATTN_GFLOPS_PER_CORE)."""
    if kv_cpu_bytes <= 0:
        return 0.0
    per_elem = KV_TYPES.get(cand.params.type_k, 2.0)
    flops = kv_cpu_bytes / per_elem * 2 * info.n_head / max(1, info.n_head_kv)
    rate = HOST_ATTN_GFLOPS_PER_CORE * 1e9 * effective_cores(hw, cand.params.n_threads)
    return max(kv_cpu_bytes / (cpu_bandwidth(hw, cand.params.n_threads) * eff), flops / rate) * 1e3


def roofline_decode(info: ModelInfo, hw: HardwareReport, cand: Candidate, depth: float = 0.0) -> float | None:
    """Decode tokens/s if every device only had to read its bytes per token (:func:`decode_reads`, the
    plan's split and the KV cache at ``depth`` tokens included) at its bandwidth: the host's measured for the
    plan's threads, the GPU's, and the bus's for what the GPU reads from pinned host memory (a mapped split's
    cold picks, a KV window's cells past the window)."""
    cpu_read, gpu_read = decode_reads(info, cand, depth)
    seconds = cpu_read / cpu_bandwidth(hw, cand.params.n_threads) if cpu_read > 0 else 0.0
    seconds += gpu_read / _gpu_bandwidth(hw)[0] if gpu_read > 0 else 0.0
    seconds += (mapped_reads(info, cand) + kv_bus_reads(info, cand, depth)) / mapped_bandwidth(hw)
    return 1 / seconds if seconds > 0 else None


def all_gpu_decode(hw: HardwareReport) -> tuple[str, float] | None:
    """(GPU, tokens/s) of the whole model decoding on one GPU, as the probe timed it (same engine and build;
    only when the model fit there): the practical ceiling of any placement of it."""
    k = next((k for k in hw.kernels if k.device != "CPU" and k.decode_ms_per_token > 0), None)
    return (k.device, 1e3 / k.decode_ms_per_token) if k else None


def predict(info: ModelInfo, hw: HardwareReport, cand: Candidate, work: Workload) -> Prediction:
    """Predicted prefill/decode tokens per second of ``cand`` and seconds for ``work``."""
    eff, prefill_ms_per_byte, probe_threads = _cpu_calibration(info, hw)
    per_dev = layer_bytes(info, cand.placement)
    gpu_bw, gpu_fixed = _gpu_bandwidth(hw, info)
    p = cand.params
    if p.rpc_servers:
        return _predict_remote(info, hw, cand, work, eff, prefill_ms_per_byte, probe_threads)
    cpu_read, gpu_read = decode_reads(info, cand, work.mean_prompt_tokens)
    kv_cpu = kv_reads(info, cand, work.mean_prompt_tokens)[0]
    decode_ms = (cpu_read - kv_cpu) / (cpu_bandwidth(hw, p.n_threads) * eff) * 1e3
    if gpu_read and not p.no_host:
        decode_ms *= PLAIN_LAYOUT_SLOWDOWN
    decode_ms += host_attention_ms(info, hw, cand, kv_cpu, eff)
    if gpu_read:
        syncs = _transitions(_mapped_placement(cand)) + 2 * _host_attention_layers(cand)
        decode_ms += gpu_fixed + gpu_read / gpu_bw * 1e3 + syncs * HYBRID_LAYER_SYNC_MS
        if p.expert_mapped:
            decode_ms += mapped_reads(info, cand) / mapped_bandwidth(hw) * 1e3
            decode_ms += len(p.expert_split.layers) * MAPPED_LAYER_MS if p.expert_split else 0.0
        else:
            decode_ms += split_host_parts(info, cand) * SPLIT_HOST_PART_MS
        if p.expert_cache == "adaptive" and p.expert_split:
            decode_ms += len(p.expert_split.layers) * CACHE_READ_MS
        decode_ms += kv_bus_reads(info, cand, work.mean_prompt_tokens) / mapped_bandwidth(hw) * 1e3
    if gpu_read and p.flash_attn != _gpu_probe_fa(hw):  # flash attention: ~15% off a GPU step (notes)
        decode_ms *= 0.85 if p.flash_attn else 1 / 0.85
    lengths = work.prompt_lengths or (work.mean_prompt_tokens,)
    prefill_ms = sum(n * _prefill_ms(info, hw, cand, per_dev, prefill_ms_per_byte, probe_threads, n)
                     for n in lengths) / max(1e-9, sum(lengths))
    decode_tps, prefill_tps = 1e3 / max(decode_ms, 1e-6), 1e3 / max(prefill_ms, 1e-6)
    score = work.prefill_tokens / prefill_tps + work.decode_tokens / decode_tps
    return Prediction(candidate_id=cand.id, prefill_tps=prefill_tps, decode_tps=decode_tps, score_s=score)


def _predict_remote(info: ModelInfo, hw: HardwareReport, cand: Candidate, work: Workload, eff: float,
                    ms_per_byte: float, probe_threads: int) -> Prediction:
    """A placement over RPC servers: every layer priced at this host's CPU speed wherever it runs (an RPC
    server's own speed is unknown before it is measured), plus what the links cost per decode step and per
    prefill micro-batch (:func:`tasks.remote.link_ms`)."""
    p = cand.params
    per_dev = layer_bytes(info, cand.placement)
    read = sum(r for r, _ in per_dev.values()) + kv_reads(info, cand, work.mean_prompt_tokens)[0]
    decode_ms = read / (cpu_bandwidth(hw, p.n_threads) * eff) * 1e3 + link_ms(info, hw, cand, 1)
    scale = effective_cores(hw, probe_threads) / effective_cores(hw, p.n_threads_batch)
    prefill_ms = read * ms_per_byte * scale + link_ms(info, hw, cand, p.n_ubatch) / p.n_ubatch
    decode_tps, prefill_tps = 1e3 / max(decode_ms, 1e-6), 1e3 / max(prefill_ms, 1e-6)
    score = work.prefill_tokens / prefill_tps + work.decode_tokens / decode_tps
    return Prediction(candidate_id=cand.id, prefill_tps=prefill_tps, decode_tps=decode_tps, score_s=score)


def micro_batches(prompt_tokens: float, n_ubatch: int) -> int:
    """Micro-batches llama.cpp splits a prompt into: a prompt shorter than the micro-batch is one of its own, a
    longer one ends in a partial one (a 16,384-token prompt is 32 micro-batches of 512 and 2 of 8,192)."""
    return max(1, math.ceil(max(1.0, prompt_tokens) / max(1, n_ubatch)))


def _prefill_ms(info: ModelInfo, hw: HardwareReport, cand: Candidate, per_dev: dict[str, tuple[float, float]],
                ms_per_byte: float, probe_threads: int, prompt_tokens: float) -> float:
    """Prefill ms per token of a ``prompt_tokens`` prompt: CPU compute scaled by threads; host weights copied once
    per offloaded micro-batch (the bytes each micro-batch moves: the copy bound of a hybrid's prefill)."""
    p = cand.params
    cpu_read = per_dev.get("CPU", (0.0, 0.0))[0]
    gpu_resident = sum(res for d, (_, res) in per_dev.items() if d != "CPU")
    scale = effective_cores(hw, probe_threads) / effective_cores(hw, p.n_threads_batch)
    cpu_ms = cpu_read * ms_per_byte * scale * (512 / max(64, min(p.n_ubatch, 512))) ** 0.1
    if not gpu_resident:
        return cpu_ms
    host_resident = per_dev.get("CPU", (0.0, 0.0))[1] - info.bytes_by_role.get("embeddings", 0)
    tokens = max(1.0, prompt_tokens)
    batch = min(p.n_ubatch, tokens)  # a prompt shorter than the micro-batch is one of its own
    per_token = micro_batches(tokens, p.n_ubatch) / tokens  # copies of the host weights per prompt token
    pinned = p.load_mode != "mmap"
    if p.expert_mapped and pinned:  # the whole expert tensors read over the bus from the pinned host buffer: once
        # per micro-batch, offload or not (runs 13-17 within 3-13%; -ub 2048 -> 4096 predicts issue 50's 1.5x), and
        # never faster than the whole model on the GPU (a 32k prompt at -ub 8192 had predicted more)
        return max(0.08 + host_resident / mapped_bandwidth(hw) * 1e3 * per_token, _gpu_prefill_ms(hw, batch))
    threshold = p.offload_min_batch or DEFAULT_OFFLOAD_MIN_BATCH
    # llama.cpp offloads a micro-batch of at least the threshold's tokens (a prompt shorter than it stays on the
    # host); repacked host weights never
    if not p.expert_mapped and (batch < threshold or not p.op_offload or p.no_host):
        return cpu_ms * HYBRID_HOST_PREFILL_SLOWDOWN + 0.02
    # an offloaded micro-batch copies the host weights (a mapped split's prefill takes this stock path too: its
    # pinned copies of the cold experts serve decode only, the whole tensors stay in the file's pageable pages)
    return host_resident / _copy_rate(info, hw, pinned) * 1e3 * per_token + _gpu_prefill_ms(hw, batch)


def _copy_rate(info: ModelInfo, hw: HardwareReport, pinned: bool) -> float:
    """Bytes/s at which an offloaded micro-batch copies host weights to the GPU: the probe's pinned copy rate
    from pinned memory; from the file's pageable pages, the rate the probe's offloading load ran at (its routed
    experts' bytes over its read-out's prefill time per micro-batch, the GPU's compute taken off), else the
    probe's pageable copy rate. On the H200 (run 18) the offload loads ran at 10-11 GB/s against 7.3 GB/s
    pageable copies, and mapped splits on the file's pages prefilled at 97-265 tok/s where the pinned rate
    predicted 377-1,335."""
    gpu = next((g for g in hw.gpus), None)
    if pinned:
        return ((gpu.h2d_pinned_gbs if gpu else None) or 45.0) * 1e9
    step = offload_step(hw)
    if step is not None:
        tokens, ms = step
        copy_s = (ms - _gpu_prefill_ms(hw, tokens)) * tokens / 1e3
        experts = sum(layer.expert_bytes for layer in info.layers)
        if copy_s > 0 and experts:
            return experts / copy_s
    return ((gpu.h2d_pageable_gbs if gpu else None) or 7.5) * 1e9


def _gpu_prefill_ms(hw: HardwareReport, batch: float) -> float:
    """GPU compute per prompt token of the whole model at ``batch`` tokens a micro-batch: the probe's (timed at
    its small batch), cheaper per token as the batch grows (:data:`GPU_PREFILL_BATCH_EXP`, and past 512 tokens
    :data:`GPU_PREFILL_LARGE_BATCH_EXP`)."""
    k = next((k for k in hw.kernels if k.device != "CPU" and k.prefill_ms_per_token > 0), None)
    if k is None:
        return 0.08
    large = (512.0 / min(max(batch, 512.0), GPU_PREFILL_LARGEST_BATCH)) ** GPU_PREFILL_LARGE_BATCH_EXP
    return (k.prefill_ms_per_token * (k.prefill_batch / max(k.prefill_batch, min(batch, 512.0))) ** GPU_PREFILL_BATCH_EXP
            * large)
