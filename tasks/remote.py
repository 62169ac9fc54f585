"""Placements over llama.cpp RPC servers (``flux plan --rpc``): the last layers, and the output head, on remote
devices; the rest on this machine.

llama.cpp runs a model over RPC devices as a pipeline of layers: with ``-ngl K+1`` the last K layers and the
head go to the model's devices, which list the RPC servers' devices first (``RPC0``, ``RPC1``, ... in ``--rpc``
order), each taking a run of positions by ``tensor_split``. Each boundary a token crosses costs a round trip
and its activations' bytes over the link (:func:`link_ms`), so the planner offers the fewest remote layers
that fit this machine's budget, every layer remote, and one between; measurement decides, and a plan that
needs no server does not use one (:func:`why_local`).
"""

from __future__ import annotations

import itertools

from artifacts.engine_params import EngineParams
from artifacts.model_info import ModelInfo
from artifacts.records.hardware import HardwareReport
from artifacts.records.plan import PlanRequest
from artifacts.records.search import Candidate, Placement
from tasks import layer_split
from tasks.costmodel import EXPERT_PARTS, head_bytes, layer_bytes
from tasks.gpu_memory import compute_bytes
from tasks.rpc_link import rpc_devices

GIB = 2**30
_MARGIN = 0.5  # as in tasks.layer_split: a boundary half a position below the next run's first position


def rpc_limits(hw: HardwareReport, req: PlanRequest, reserve_percent: float) -> dict[str, int]:
    """Bytes the plan may hold on each RPC device: the server's --rpc-mem-budget (shared by its devices in
    proportion to their free memory), else what the device reports free minus the host reserve."""
    budgets = req.rpc_mem_budget_gib or []
    out: dict[str, int] = {}
    for name, server, index in rpc_devices(hw):
        dev = server.devices[index]
        i = hw.rpc_servers.index(server)
        if i < len(budgets):
            total_free = sum(d.memory_free for d in server.devices) or 1
            out[name] = int(budgets[i] * GIB * dev.memory_free / total_free)
        else:
            out[name] = int(dev.memory_free * (1 - reserve_percent / 100))
    return out


def _placement(info: ModelInfo, n_remote: int, devices: list[str], limits: dict[str, int]) -> Placement:
    """The last ``n_remote`` layers and the head on ``devices``, in runs proportional to their limits."""
    n = info.n_layer
    sizes = [int(sum(layer.bytes_by_role.values())) for layer in info.layers[n - n_remote:]] + [head_bytes(info)]
    runs = layer_split.runs(sizes, [limits[d] for d in devices])
    layer_device = ["CPU"] * (n - n_remote) + [devices[j] for j in runs[:-1]]
    experts = [dict.fromkeys(EXPERT_PARTS, d) for d in layer_device] if info.n_expert else []
    return Placement(layer_device=layer_device, expert_device=experts, output_device=devices[runs[-1]])


def tensor_split(placement: Placement, devices: list[str], n_local_gpus: int) -> tuple[float, ...]:
    """``-ts`` shares over llama.cpp's devices (RPC first, then this machine's GPUs at 0) that give each offloaded
    position (the remote layers, then the head) the placement's device: a device's share ends half a position
    below the first position of the next run."""
    seq = [d for d in (*placement.layer_device, placement.output_device) if d != "CPU"]
    ends = list(itertools.accumulate(seq.count(d) for d in devices))
    n_pos = len(seq)
    cum = [1.0 if e >= n_pos else max(0.0, (e - _MARGIN) / n_pos) for e in ends[:-1]] + [1.0]
    shares = [cum[0]] + [cum[j] - cum[j - 1] for j in range(1, len(cum))]
    return tuple(round(max(0.0, s), 6) for s in shares) + (0.0,) * n_local_gpus


def _fits_host(info: ModelInfo, n_remote: int, kv_layer: float, host: int, comp: int) -> bool:
    layers = sum(sum(layer.bytes_by_role.values()) for layer in info.layers[: info.n_layer - n_remote])
    local = layers + info.bytes_by_role.get("embeddings", 0) + kv_layer * (info.n_layer - n_remote) + comp
    return local <= host


def remote_candidates(info: ModelInfo, hw: HardwareReport, req: PlanRequest, n_ctx: int, kv_layer: float,
                      host: int, limits: dict[str, int], threads: list[int], first_id: int) -> list[Candidate]:
    """Candidates with runs of the last layers on the RPC devices (none without RPC servers)."""
    devices = [name for name, _, _ in rpc_devices(hw)]
    if not devices:
        return []
    n = info.n_layer
    out: list[Candidate] = []
    endpoints = tuple(s.endpoint for s in hw.rpc_servers)
    for ub in (128, 512):  # as the CPU grid: a small micro-batch leaves this machine room for a layer more
        comp = compute_bytes(info, ub, n_ctx, True)
        fit = [k for k in range(1, n + 1) if _fits_host(info, k, kv_layer, host, comp)]
        for k in sorted({fit[0], (fit[0] + n) // 2, n}) if fit else []:
            placement = _placement(info, k, devices, limits)
            weights = {d: int(res) for d, (_, res) in layer_bytes(info, placement).items()}
            kv: dict[str, int] = {}
            for d in placement.layer_device:
                kv[d] = kv.get(d, 0) + int(kv_layer)
            comps = {"CPU": comp, **{d: comp for d in placement.gpus()}}
            if any(weights.get(d, 0) + kv.get(d, 0) + comps.get(d, 0) > limits[d] for d in placement.gpus()):
                continue
            split = tensor_split(placement, devices, len(hw.gpus))
            for t in threads:
                params = EngineParams(n_ctx=n_ctx, n_seq_max=req.concurrency, n_batch=512, n_ubatch=ub, n_threads=t,
                                      n_threads_batch=t, n_gpu_layers=k + 1, tensor_split=split, flash_attn=True,
                                      type_k=req.kv, type_v=req.kv, rpc_servers=endpoints, seed=req.seed)
                out.append(Candidate(id=f"c{first_id + len(out):03d}", family=f"rpc-layers/{k}", placement=placement,
                                     params=params, weights_bytes=weights, kv_bytes=kv, compute_bytes=comps))
    return out


def rpc_notes(hw: HardwareReport, cand: Candidate) -> list[str]:
    """For ``flux show``: the RPC servers' measured links, and which devices the plan uses or why it uses none."""
    if not hw.rpc_servers:
        return []
    links = "; ".join(f"{s.endpoint}: round trip {s.link.rtt_ms:.2f} ms, {s.link.up_gbs:.2f} GB/s up, "
                      f"{s.link.down_gbs:.2f} GB/s down" for s in hw.rpc_servers if s.link)
    if not cand.params.rpc_servers:
        return [f"RPC servers not used: this machine alone measured fastest (links: {links})"]
    remote = [d for d in cand.placement.layer_device if d.startswith("RPC")]
    return [f"RPC servers: {len(remote)} of {len(cand.placement.layer_device)} layers and the head remote "
            f"({', '.join(sorted(set(remote)))}); links: {links}"]
