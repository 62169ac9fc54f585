"""Enumerate: the search space of placements and runtime knobs, checked against memory.

On a CPU-only machine the space is threads (decode and batch), n_batch/n_ubatch, flash attention,
mmap vs loaded weights and the requested KV type. With GPUs it adds where weights live: all on a GPU,
llama.cpp's last-N layers, and per-layer expert tensors (gate/up/down separately) chosen by the MILP in
:mod:`tasks.expert_select` under each GPU's budget, with pinned or repacked host weights and the offload threshold.
With several GPUs it adds llama.cpp's even layer split, and every GPU placement carries the tensor split
that makes llama.cpp put each layer's KV cache where the placement computes its attention.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from artifacts import engine_params
from artifacts.engine_params import EngineParams, ExpertSplit, LoadMode, TensorOverride
from artifacts.model_info import DEFAULT_UBATCH, ModelInfo, kv_cache_bytes
from artifacts.records.hardware import HardwareReport
from artifacts.records.plan import PlanRequest
from artifacts.records.search import Candidate, Placement, PlacementSpace
from tasks import expert_select, layer_split
from tasks.costmodel import EXPERT_PARTS, all_on, head_bytes, layer_bytes
from tasks.expert_hot import hot_placement, mapped_bytes, split_bytes
from tasks.gpu_budget import check_gpu_budgets, gpu_devices, gpu_limits, no_placement_fits
from tasks.gpu_memory import (
    DEFAULT_MARGIN,
    FILL_HEADROOM,
    SIZING_UBATCH,
    compute_bytes,
    correction,
    offloads_host_weights,
)
from tasks.prefill_ubatch import prefill_ubatches, sized_family
from tasks.remote import remote_candidates, rpc_limits
from tasks.search import kv_window
from tasks.search.context import context_cap_line, plan_host_budget, resolve_context

log = logging.getLogger(__name__)
PIPELINE_BATCH = 2048  # tokens per llama_decode call when micro-batches are pipelined over GPUs


def _thread_choices(hw: HardwareReport) -> list[int]:
    phys, logical = hw.cpu.physical_cores, hw.cpu.logical_cores
    return sorted({max(1, phys // 2), phys, logical})


def _overrides(p: Placement, gpus: list[str]) -> list[TensorOverride]:
    """tensor_buft_overrides that realise a placement when llama.cpp offloads every layer (-ngl 999).

    Under the placement's tensor split (:mod:`tasks.layer_split`) llama.cpp already puts each layer, and
    the head, on the GPU the placement gives it; only what differs is named: a layer whose block is
    elsewhere (the CPU), and an expert tensor away from its layer's block. A placement with nothing on the
    CPU over several GPUs thus has no overrides, which keeps llama.cpp's pipeline parallelism (micro-batches
    of one batch in flight on every GPU at once) that any tensor override turns off.
    """
    home = layer_split.llama_devices(p, gpus) if gpus else []
    by_dev: dict[tuple[str, str], list[int]] = {}
    for i, dev in enumerate(p.layer_device):
        parts = {q: p.expert_device[i][q] for q in EXPERT_PARTS} if p.expert_device else {}
        for q, qdev in parts.items():
            if qdev != dev:
                by_dev.setdefault((qdev, f"ffn_{q}_exps"), []).append(i)
        if home and dev != home[i]:
            by_dev.setdefault((dev, "block"), []).append(i)
    out = []
    for (dev, what), layers in sorted(by_dev.items(), key=lambda kv: (kv[0][1] == "block", kv[0])):
        ids = "|".join(str(i) for i in layers)
        pat = rf"^blk\.({ids})\." if what == "block" else rf"^blk\.({ids})\.{what}\."
        out.append(TensorOverride(pattern=pat, device=dev))
    if home and p.output_device != home[-1]:
        out.append(TensorOverride(pattern=r"^output\.", device=p.output_device))
    return out


def _memory(info: ModelInfo, p: Placement, params: EngineParams, n_seq: int,
            gpus: list[str]) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    weights = {d: int(res) for d, (_, res) in layer_bytes(info, p).items()}
    kv: dict[str, int] = {}
    window = params.kv_vram_cells
    cells, seqs = kv_window.window_cells(window, params.n_ctx, n_seq) if window else (params.n_ctx, n_seq)
    for dev in kv_placement(p, params, gpus):
        kv[dev] = kv.get(dev, 0) + int(kv_layer_bytes(info, params.type_k, cells, seqs, params.n_ubatch))
        if window and dev != "CPU":  # every cell also in pinned host memory
            kv["CPU"] = kv.get("CPU", 0) + int(kv_cache_bytes(info, params.type_k, params.n_ctx, n_seq) / info.n_layer)
    comp = {"CPU": compute_bytes(info, params.n_ubatch, params.n_ctx, params.flash_attn)}
    for d in p.gpus():
        comp[d] = compute_bytes(info, params.n_ubatch, params.n_ctx, params.flash_attn) + (
            kv_window.concat_bytes(info, params.type_k, params.n_ctx, window, n_seq) if window else 0)
    return weights, kv, comp


def modelled_load(info: ModelInfo, params: EngineParams, device: str, experts_on_host: bool) -> int:
    """The memory model's bytes on ``device`` of a load with every layer there (its experts on the host when
    ``experts_on_host``): what the probe's calibration loads are compared with (:mod:`tasks.gpu_memory`)."""
    p = all_on(info, device)
    if experts_on_host and p.expert_device:
        p = p.model_copy(update={"expert_device": [dict.fromkeys(EXPERT_PARTS, "CPU") for _ in p.expert_device]})
    weights, kv, comp = _memory(info, p, params, 1, [device])
    return weights.get(device, 0) + kv.get(device, 0) + comp.get(device, 0)


def kv_at(info: ModelInfo, n_ctx: int, n_seq: int = 1, kv_type: str = "f16", n_ubatch: int = DEFAULT_UBATCH) -> float:
    """KV cache bytes of every layer holding ``n_ctx`` tokens for each of ``n_seq`` sequences."""
    return kv_layer_bytes(info, kv_type, n_ctx, n_seq, n_ubatch) * info.n_layer


def kv_layer_bytes(info: ModelInfo, kv_type: str, n_ctx: int, n_seq: int, n_ubatch: int = DEFAULT_UBATCH) -> float:
    """KV cache bytes of one layer holding ``n_ctx`` tokens for each of ``n_seq`` sequences (a hybrid model's
    fixed recurrent state included, a sliding-window model's window-sized layers too, spread over the layers like
    its KV cache)."""
    kv = kv_cache_bytes(info, kv_type, n_ctx, n_seq, n_ubatch)
    return (kv + info.recurrent_state_bytes * n_seq) / max(1, info.n_layer)


def kv_placement(p: Placement, params: EngineParams, gpus: list[str]) -> list[str]:
    """The device of each layer's KV cache, as llama.cpp places it.

    Offloaded KV (``offload_kqv``) sits with the layer llama.cpp offloads: with ``-ngl`` above the layer
    count every layer is offloaded, to the GPU the tensor split gives it, even when a layer's weights are
    overridden to the CPU; with ``-ngl N`` only the last N-1 layers (the output head is the N-th). Without
    offloaded KV (``-nkvo``) every layer's KV cache, and its attention, is on the host.
    """
    n = len(p.layer_device)
    if params.n_gpu_layers <= 0 or not params.offload_kqv or not gpus:
        return ["CPU"] * n
    if params.n_gpu_layers > n:
        return layer_split.kv_devices(p, gpus)
    first_gpu = n + 1 - params.n_gpu_layers
    return ["CPU" if i < first_gpu else dev for i, dev in enumerate(layer_split.kv_devices(p, gpus))]


MILP_FAMILIES = (("milp-decode", 0.0, 1.0), ("milp-mixed", 0.5, 1.0), ("milp-prefill", 0.9, -1.0))


def _gpu_placements(info: ModelInfo, budgets: list[int], families: tuple[tuple[str, float, float], ...] = MILP_FAMILIES,
                    ) -> list[tuple[str, Placement]]:
    """Structural placements for the GPUs under weight budgets: all on GPU, an even layer split over several
    GPUs, MILP expert sets. A placement two families reach is kept once, under the first."""
    if not budgets:
        return []
    out: list[tuple[str, Placement]] = []
    full = all_on(info, "CUDA0")
    if sum(res for _, res in layer_bytes(info, full).values()) - info.bytes_by_role.get("embeddings", 0) <= budgets[0]:
        out.append(("all-gpu", full))
    split = _even_split(info, budgets)
    if split is not None:
        out.append(("split-layers", split))
    for name, weight, bias in families:
        out.append((name, expert_select.select(info, budgets, prefill_weight=weight, bias_late=bias)))
    unique: dict[str, tuple[str, Placement]] = {}
    for name, p in out:
        unique.setdefault(p.model_dump_json(), (name, p))
    return list(unique.values())


def _last_layers(info: ModelInfo, budget: int, kv_layer: float) -> tuple[str, Placement] | None:
    """llama.cpp's own ``-ngl``: the last layers and the head on the GPU, each layer with its KV cache, as many
    as ``budget`` holds; None when none or all fit."""
    per_layer = max(1, max(layer.total_bytes for layer in info.layers)) + kv_layer
    n_fit = min(info.n_layer, int(max(0, budget - head_bytes(info)) // per_layer))
    if not 0 < n_fit < info.n_layer:
        return None
    last = ["CPU"] * (info.n_layer - n_fit) + ["CUDA0"] * n_fit
    return f"last-{n_fit}-layers", Placement(layer_device=last, expert_device=[
        dict.fromkeys(EXPERT_PARTS, d) for d in last] if info.is_moe else [], output_device="CUDA0")


def _even_split(info: ModelInfo, budgets: list[int]) -> Placement | None:
    """Every layer on a GPU, consecutive runs in proportion to the GPUs' budgets (llama.cpp's ``-sm layer``
    with its default split by free memory); None with one GPU or when a run would exceed its budget."""
    if len(budgets) < 2 or not sum(budgets):
        return None
    sizes = expert_select.position_bytes(info)
    devs = [f"CUDA{j}" for j in layer_split.runs(sizes, budgets)]
    used = [sum(size for size, d in zip(sizes, devs, strict=True) if d == f"CUDA{j}") for j in range(len(budgets))]
    if any(u > b for u, b in zip(used, budgets, strict=True)):
        return None
    return Placement(layer_device=devs[:-1], expert_device=[dict.fromkeys(EXPERT_PARTS, d) for d in devs[:-1]]
                     if info.is_moe else [], output_device=devs[-1])


# Agent conversations reach 16-32k tokens: where the trained context is longer, a plan may hold this much
# instead, with the KV cache it frees given to weights (llama.cpp's --fit shrinks the context the same way).
WORKLOAD_DEPTH = 32768
KvMode = Literal["gpu", "host", "layers", "window"]


@dataclass(frozen=True)
class _Shape:
    """A placement with the context it holds and where its KV cache lives.

    ``kv``: "gpu" (every layer's KV on the GPU of its attention, ``-ngl 999``), "host" (``-nkvo``: KV and
    attention on the CPU), "layers" (``-ngl N``: the KV of the offloaded layers on the GPU, the rest on the host),
    "window" (every layer's first ``window`` cells on the GPU, all of them in pinned host memory: :mod:`.kv_window`).
    """

    family: str
    placement: Placement
    n_ctx: int
    kv: KvMode
    split: ExpertSplit | None = None
    hot_share: tuple[float, ...] = ()
    mapped: bool = False  # the split's cold experts read by the GPU from pinned host memory
    sized_for: tuple[int, ...] = ()  # prefill micro-batches (beyond the default grid's) its budget holds
    default_grid: bool = True  # tried at the default grid's micro-batches too (sized at SIZING_UBATCH)
    window: int | None = None  # kv "window": the cells of each layer's cache kept in VRAM


def gpu_overhead(info: ModelInfo, n_ctx: int, kv_bytes: float, margin: int = DEFAULT_MARGIN,
                 n_ubatch: int = SIZING_UBATCH) -> int:
    """What a GPU needs besides weights: ``margin`` (this machine's correction of the memory model:
    :mod:`tasks.gpu_memory`), a ``n_ubatch``-token micro-batch's compute buffer, ``kv_bytes``, and the headroom a
    placement sized to the budget leaves free."""
    return int(margin + compute_bytes(info, n_ubatch, n_ctx, True) + kv_bytes + FILL_HEADROOM)


def smallest_context(info: ModelInfo, hw: HardwareReport, req: PlanRequest, reserve_percent: float) -> int:
    """The shortest context any candidate will hold, known before the search (what the validation prompts must
    fit), after the refusals :func:`enumerate_placements` makes before it searches.

    Raises:
        ImpossiblePlan: the context or a GPU budget cannot work (the same line enumerate gives).
    """
    n_ctx, _ = resolve_context(info, hw, req, reserve_percent)
    least = min(_contexts(n_ctx, req, len(gpu_devices(hw))))
    check_gpu_budgets(info, hw, req, least)
    return least


def _contexts(n_ctx: int, req: PlanRequest, n_gpus: int) -> list[int]:
    """The contexts a plan may hold: the requested (or trained) one, and the workload's depth when shorter
    and unasked for (on GPUs, where a smaller KV cache leaves room for weights)."""
    if req.ctx is None and n_gpus and WORKLOAD_DEPTH < n_ctx:
        return [n_ctx, WORKLOAD_DEPTH]
    return [n_ctx]


def _gpu_shapes(info: ModelInfo, req: PlanRequest, per_gpu: list[int], n_ctx: int, tag: str,
                routing: NDArray[np.float64] | None = None, margins: list[int] | None = None,
                mapped_extra: int = 0) -> list[_Shape]:
    """GPU placements at one context, each with its KV placement, the KV cache taken from the weights' budget
    (a mapped split's also ``mapped_extra``, what its graph holds beyond a hybrid load's, or less)."""
    if not per_gpu:
        return []
    on_host, on_gpu = _weight_room(info, req, per_gpu, n_ctx, margins or [DEFAULT_MARGIN] * len(per_gpu))
    out = [_Shape(f + tag, pl, n_ctx, "gpu") for f, pl in _gpu_placements(info, on_gpu)]
    # single experts on the GPU, chosen by measured routing (patched backend); then the same with every layer
    # split and the cold picks read by the GPU over the bus
    for cover, fam in ((False, "experts-hot"), (True, "experts-mapped")):
        room = on_gpu[0] - (mapped_extra if cover else 0)
        hot = hot_placement(info, routing, room, cover_layers=cover) if routing is not None and len(on_gpu) == 1 else None
        if hot is not None:
            out.append(_Shape(fam + tag, hot.placement, n_ctx, "gpu", hot.split, hot.hot_share, mapped=cover))
    out += [_Shape(f + "/kv-host" + tag, pl, n_ctx, "host")
            for f, pl in _gpu_placements(info, on_host, MILP_FAMILIES[1:2])]
    last = _last_layers(info, on_host[0], kv_layer_bytes(info, req.kv, n_ctx, req.concurrency))
    if last is not None:
        out.append(_Shape(last[0] + tag, last[1], n_ctx, "layers"))
    return out


def _weight_room(info: ModelInfo, req: PlanRequest, per_gpu: list[int], n_ctx: int, margins: list[int],
                 n_ubatch: int = SIZING_UBATCH) -> tuple[list[int], list[int]]:
    """Weights' room on each GPU beside a ``n_ubatch``-token micro-batch's compute buffer: with the KV cache on the
    host, then with it on the GPUs in their runs' shares."""
    kv_total = kv_at(info, n_ctx, req.concurrency, req.kv, n_ubatch)
    on_host = [max(0, b - gpu_overhead(info, n_ctx, 0.0, m, n_ubatch)) for b, m in zip(per_gpu, margins, strict=True)]
    shares = [b / sum(on_host) for b in on_host] if sum(on_host) else [1 / len(on_host)] * len(on_host)
    return on_host, [max(0, int(b - kv_total * sh)) for b, sh in zip(on_host, shares, strict=True)]


def _sized_shapes(info: ModelInfo, req: PlanRequest, hw: HardwareReport, per_gpu: list[int], n_ctx: int, tag: str,
                  routing: NDArray[np.float64] | None) -> list[_Shape]:
    """Placements whose GPU budget holds the compute buffer of a prefill micro-batch the workload reaches
    (:func:`tasks.prefill_ubatch.prefill_ubatches`) and this machine's correction at it, tried at that micro-batch
    alone (with the default grid where one is the same placement). Without them a larger micro-batch would only
    ever run placements filled at SIZING_UBATCH, whose budget has no room for its compute buffer. The whole model on
    the GPUs where it still fits; of the whole-tensor MILPs, which leave experts on the host to be copied once per
    micro-batch (a larger one spreads the copy over more tokens), the one weighted for prefill (the most bytes
    spared a copy); and the per-expert splits (their copies of the busiest experts serve decode). Not the KV cache
    on the host (a long prompt's attention on the CPU) nor llama.cpp's -ngl N: the candidates grow by a few dozen."""
    out: list[_Shape] = []
    gpus = [name for name, _ in gpu_devices(hw)][:len(per_gpu)]
    for ub in prefill_ubatches(n_ctx, req) if per_gpu else ():
        margins = [correction(hw, g, True, ub) for g in gpus] + [DEFAULT_MARGIN] * (len(per_gpu) - len(gpus))
        on_gpu = _weight_room(info, req, per_gpu, n_ctx, margins, ub)[1]
        out += [_Shape(sized_family(fam, ub) + tag, pl, n_ctx, "gpu", sized_for=(ub,), default_grid=False)
                for fam, pl in _gpu_placements(info, on_gpu, MILP_FAMILIES[2:]) if pl.gpus()]  # not the CPU alone
        for cover, fam in ((False, "experts-hot"), (True, "experts-mapped")):
            room = on_gpu[0] - (correction(hw, gpus[0], True, ub, True) - margins[0] if cover and gpus else 0)
            hot = hot_placement(info, routing, room, cover_layers=cover) if routing is not None and len(on_gpu) == 1 \
                else None
            if hot is not None:
                out.append(_Shape(sized_family(fam, ub) + tag, hot.placement, n_ctx, "gpu", hot.split, hot.hot_share,
                                  mapped=cover, sized_for=(ub,), default_grid=False))
    return out


def _merged(have: _Shape | None, new: _Shape) -> _Shape:
    """One shape for a placement two sizings reach (a small model's placement does not change with the compute
    buffer): the first's name, every micro-batch either tries."""
    if have is None:
        return new
    return replace(have, sized_for=tuple(sorted({*have.sized_for, *new.sized_for})),
                   default_grid=have.default_grid or new.default_grid)


def enumerate_placements(info: ModelInfo, hw: HardwareReport, req: PlanRequest, reserve_percent: float,
                         routing: NDArray[np.float64] | None = None) -> PlacementSpace:
    """Every memory-feasible candidate for this model, machine and request.

    ``routing`` (each expert's share of its layer's picks on the workload, [n_layer, n_expert]) adds
    per-expert placements: single experts copied to the GPU by measured pick share.

    Raises:
        ImpossiblePlan: no candidate fits (context too large, weights beyond RAM without streaming).
    """
    n_ctx, capped = resolve_context(info, hw, req, reserve_percent)
    if capped:
        log.warning(context_cap_line(info, hw, req, reserve_percent, n_ctx))
    host = plan_host_budget(hw, req, reserve_percent)
    check_gpu_budgets(info, hw, req, min(_contexts(n_ctx, req, len(gpu_devices(hw)))))
    per_gpu = gpu_limits(hw, req)
    gpus = [name for name, _ in gpu_devices(hw)]
    limits = {"CPU": host, **{f"CUDA{i}": b for i, b in enumerate(per_gpu)}}
    shapes = [_Shape("cpu", all_on(info, "CPU"), n_ctx, "host")]
    margins = [correction(hw, name, True, SIZING_UBATCH) for name in gpus[:len(per_gpu)]]
    margins += [DEFAULT_MARGIN] * (len(per_gpu) - len(margins))
    mapped_extra = correction(hw, gpus[0], True, SIZING_UBATCH, True) - margins[0] if margins else 0
    by_ctx: dict[int, list[_Shape]] = {}
    for ctx in _contexts(n_ctx, req, len(gpus)):
        tag = "" if ctx == n_ctx else f"@{ctx}"
        by_ctx[ctx] = _gpu_shapes(info, req, per_gpu, ctx, tag, routing, margins, mapped_extra)
        shapes += by_ctx[ctx] + _sized_shapes(info, req, hw, per_gpu, ctx, tag, routing)
    if req.ctx is None:  # the whole context with a window's VRAM: the placements sized for a cache that long
        for w in kv_window.windows(n_ctx, len(per_gpu)):
            sized = by_ctx.get(w) or _gpu_shapes(info, req, per_gpu, w, f"@{w}", routing, margins, mapped_extra)
            shapes += [replace(sh, family=f"{sh.family.split('@', 1)[0]}/kv-window{w}", n_ctx=n_ctx, kv="window",
                               window=w) for sh in sized if sh.kv == "gpu"]
    unique: dict[tuple[str, int, str, str, bool, int | None], _Shape] = {}
    for sh in shapes:
        key = (sh.placement.model_dump_json(), sh.n_ctx, sh.kv, sh.split.env_value() if sh.split else "", sh.mapped,
               sh.window)
        unique[key] = _merged(unique.get(key), sh)
    rejected: dict[str, int] = {}
    cands: list[Candidate] = []
    for shape in unique.values():
        for params in _runtime_grid(info, hw, req, shape, gpus):
            weights, kv, comp = _memory(info, shape.placement, params, req.concurrency, gpus)
            for dev, b in split_bytes(info, params.expert_split).items():
                weights[dev] = weights.get(dev, 0) + b
            if params.expert_mapped:
                weights["CPU"] = weights.get("CPU", 0) + mapped_bytes(info, params.expert_split)
            over = _over_limit(limits, weights, kv, comp, params, req, hw)
            if over:
                rejected[over] = rejected.get(over, 0) + 1
                continue
            cid = f"c{len(cands):03d}"
            cands.append(Candidate(id=cid, family=shape.family, placement=shape.placement, params=params,
                                   weights_bytes=weights, kv_bytes=kv, compute_bytes=comp, hot_share=list(shape.hot_share),
                                   needs_storage_streaming=params.load_mode == "mmap" and (
                                       weights.get("CPU", 0) + kv.get("CPU", 0) + comp.get("CPU", 0) > host)))
    if hw.rpc_servers:  # runs of the last layers on llama.cpp RPC servers (tasks.remote)
        remote_limits = rpc_limits(hw, req, reserve_percent)
        limits.update(remote_limits)
        cands += remote_candidates(info, hw, req, n_ctx, kv_layer_bytes(info, req.kv, n_ctx, req.concurrency), host,
                                   remote_limits, [hw.cpu.physical_cores], len(cands))
    if not cands:
        raise no_placement_fits(info, req, rejected, limits, n_ctx, hw)
    log.info("enumerate: %d candidates (%d placements), %d rejected, n_ctx %s", len(cands), len(unique),
             sum(rejected.values()), "/".join(str(c) for c in sorted({s.n_ctx for s in unique.values()}, reverse=True)))
    return PlacementSpace(candidates=cands, rejected=rejected, memory_limits=limits, n_ctx=n_ctx,
                          n_seq=req.concurrency, ctx_capped_by_ram=capped)


def _runtime_grid(info: ModelInfo, hw: HardwareReport, req: PlanRequest, shape: _Shape,
                  gpus: list[str]) -> list[EngineParams]:
    placement, n_ctx = shape.placement, shape.n_ctx
    on_gpu = placement.gpu_layers() > 0 or placement.output_device != "CPU"
    threads = _thread_choices(hw)
    ubatches, sized = _ubatches(shape, on_gpu)
    hybrid = placement.is_hybrid()
    # (load mode, no_host): mapped, loaded into pinned host memory, or (hybrids only: without a GPU the CPU
    # weights are repacked anyway) loaded in the CPU's repacked layout: faster decode, CPU-bound prefill.
    loads: list[tuple[LoadMode, bool]] = [("mmap", False), ("load", False)]
    if hybrid:
        loads.append(("load", True))
    fas = [True, False] if req.kv in ("f16", "f32") and shape.kv != "window" else [True]  # a window needs FA
    offload = [None, 4096] if hybrid and shape.split is None else [None]
    by_layers = shape.kv == "layers"
    # -ngl N offloads the last N-1 layers and the head: llama.cpp's own placement, nothing to override.
    overrides = _overrides(placement, gpus) if on_gpu and not by_layers else []
    n_gpu_layers = (placement.gpu_layers() + 1 if by_layers else 999) if on_gpu else 0
    split = layer_split.tensor_split(placement, gpus) if on_gpu else None
    # Spread over several GPUs without overrides, llama.cpp pipelines the micro-batches of a batch: give it
    # several (its own default is -b 2048 -ub 512).
    pipelined = len(placement.gpus()) > 1 and not overrides
    out = []
    caches = ("static", "adaptive") if shape.mapped else ("static",)  # hot sets fixed, or following the routing
    # a mapped split's GPU computes the cold picks of batches up to what its vector kernels take (drafted steps)
    mapped_tokens = min((engine_params.mapped_batch_limit(info.quant_types, g.compute_capability) for g in hw.gpus
                         if shape.mapped), default=engine_params.MAPPED_TOKENS_DEFAULT)
    for t, tb, ub, (load, no_host), fa, omb, cache in itertools.product(threads, threads, ubatches, loads, fas,
                                                                       offload, caches):
        if ub > n_ctx or (on_gpu and t != tb) or (no_host and omb is not None):
            continue
        if ub in sized and (no_host or omb is not None or not fa):
            continue  # see _ubatches
        out.append(EngineParams(
            n_ctx=n_ctx, n_seq_max=req.concurrency, n_ubatch=ub,
            n_batch=max(ub, min(n_ctx, PIPELINE_BATCH) if pipelined else 512 if not on_gpu else ub),
            n_threads=t, n_threads_batch=tb, n_gpu_layers=n_gpu_layers, flash_attn=fa, type_k=req.kv,
            type_v=req.kv, load_mode=load, no_host=no_host, offload_min_batch=omb, tensor_overrides=tuple(overrides),
            tensor_split=split, offload_kqv=shape.kv != "host" or not on_gpu, expert_split=shape.split,
            expert_mapped=shape.mapped, expert_cache=cache, seed=req.seed, expert_mapped_tokens=mapped_tokens,
            kv_vram_cells=shape.window))
    return out


def _ubatches(shape: _Shape, on_gpu: bool) -> tuple[list[int], set[int]]:
    """(the shape's micro-batches, those beyond the default grid). Those are tried with flash attention only (without
    it the compute buffer holds the micro-batch's attention scores, ub x n_ctx x heads: 16 GiB at 4,096 x 32,768
    x 32), with weights llama.cpp offloads (repacked host weights never are: a larger micro-batch buys them
    nothing) and at the default threshold (a micro-batch of 4,096 or more is offloaded under either)."""
    base = ([256, 512, 2048] if on_gpu else [128, 512]) if shape.default_grid else []
    extra = [u for u in shape.sized_for if u not in base]
    return base + extra, set(extra)


def _over_limit(limits: dict[str, int], weights: dict[str, int], kv: dict[str, int], comp: dict[str, int],
                params: EngineParams, req: PlanRequest, hw: HardwareReport | None = None) -> str | None:
    """Why a candidate does not fit, or None; on a GPU the memory model's bytes plus this machine's correction
    (:func:`tasks.gpu_memory.correction`) must fit: that sum is what the measure stage will read there."""
    offloads = offloads_host_weights(params, weights)
    for dev, limit in limits.items():
        resident = kv.get(dev, 0) + comp.get(dev, 0)
        if dev != "CPU" and (weights.get(dev, 0) or kv.get(dev, 0)):
            resident += correction(hw, dev, offloads, params.n_ubatch, params.expert_mapped)
        if dev != "CPU" or params.load_mode != "mmap" or not req.allow_storage_streaming:
            resident += weights.get(dev, 0)
        if resident > limit:
            return f"{dev} memory"
    return None

