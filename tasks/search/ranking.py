"""Prune: rank every candidate with the cost model, keep a few diverse finalists for measurement.

The cost model is good at what moves bytes (threads vs bandwidth, which tensors sit on a GPU) and blind
to knobs whose effect is kernel-specific (flash attention on a CPU, mmap vs loaded weights, micro-batch
size) and to how many threads a hybrid GPU+CPU placement wants: its CPU speed is calibrated on CPU-only
kernels (repacked weights), not on a hybrid's small expert matmuls between GPU hand-overs (on the H200,
16 threads decoded 1.3-1.5x faster than 8 there; the model predicted 1.07-1.17x). So the finalists are
the best-predicted candidate, then (when it is hybrid) the same candidate with the next thread count, its
placement family sized for the other kind of micro-batch (a large prefill one's, :mod:`tasks.prefill_ubatch`, against
the default grid's: faster prefill for slower decode, priced by a copy bound no finalist has measured yet) and
the best hybrid with the other host-weight layout (pinned for offloaded prefill, or repacked for CPU decode:
the model predicts which the workload's mix favours, measurement confirms), then, with several GPUs, the
best placement spread over another number of GPUs (the model cannot price the hand-overs of llama.cpp's
layer pipeline between GPUs against one GPU's bandwidth), then the best of each
micro-batch size (on the H200 the same all-GPU placement prefilled at 4,500 tok/s
with -ub 256 and 7,300 with -ub 512, which the model ranked equal), then of each group of the other
uncertain knobs, then the next best overall: measurement settles what the model cannot. Diversity stops
at candidates predicted more than ``PLAUSIBLE`` times slower than the best: the model is never that
wrong, and on the H200 a CPU-only finalist of a 17 GB model (its workload measured 10-28x slower than
the best) spent half of each planning run.
"""

from __future__ import annotations

import logging

from artifacts.model_info import ModelInfo
from artifacts.records.hardware import HardwareReport
from artifacts.records.search import Candidate, Finalists, PlacementSpace
from tasks.costmodel import Workload, predict
from tasks.prefill_ubatch import sizing

log = logging.getLogger(__name__)
PLAUSIBLE = 3.0  # diversity picks only candidates predicted within this factor of the best workload time


def _group(c: Candidate) -> tuple[object, ...]:
    """The knobs the cost model cannot rank: one finalist per combination first."""
    return (c.family, c.params.flash_attn, c.params.load_mode, c.params.no_host)


def _hybrid(c: Candidate) -> bool:
    """A GPU placement that leaves per-token weights to the CPU (:meth:`Placement.is_hybrid`)."""
    return c.placement.is_hybrid()


def _gpus_used(c: Candidate) -> int:
    """How many GPUs hold a part of the placement."""
    return len(c.placement.gpus())


def _thread_siblings(best: Candidate, ranked: list[Candidate]) -> list[Candidate]:
    """``best`` with each other thread count and every other knob equal, best-predicted first."""
    same = best.params.model_dump(exclude={"n_threads", "n_threads_batch"})
    seen = {best.params.n_threads}
    out = []
    for c in ranked:
        if (c.placement == best.placement and c.params.n_threads not in seen
                and c.params.model_dump(exclude={"n_threads", "n_threads_batch"}) == same):
            seen.add(c.params.n_threads)
            out.append(c)
    return out


def _other_sizing(best: Candidate, ranked: list[Candidate]) -> Candidate | None:
    """The best of ``ranked`` in ``best``'s placement family and context sized for the other kind of micro-batch:
    a prefill micro-batch's (:func:`tasks.prefill_ubatch.sizing`) where ``best`` has the default grid's, and the
    reverse."""
    family, ub = sizing(best.family)
    return next((c for c in ranked if sizing(c.family)[0] == family and (sizing(c.family)[1] is None) != (ub is None)),
                None)


def prune(space: PlacementSpace, info: ModelInfo, hw: HardwareReport, work: Workload, n_finalists: int) -> Finalists:
    """Rank all candidates by predicted workload time and keep ``n_finalists`` diverse ones."""
    preds = {c.id: predict(info, hw, c, work) for c in space.candidates}
    ranked = sorted(space.candidates, key=lambda c: (preds[c.id].score_s, c.id))
    chosen: list[Candidate] = []
    seen: set[tuple[object, ...]] = set()
    best_s = preds[ranked[0].id].score_s if ranked else 0.0
    plausible = [c for c in ranked if preds[c.id].score_s <= PLAUSIBLE * best_s]
    groups_first = sorted({_group(c) for c in plausible}, key=lambda g: min(
        preds[c.id].score_s for c in plausible if _group(c) == g))

    def take(c: Candidate | None) -> None:
        if c is not None and c not in chosen and len(chosen) < n_finalists:
            chosen.append(c)
            seen.add(_group(c))

    if ranked:
        take(ranked[0])
    # another thread count of the best, unless its cold experts are read by the GPU (a mapped split's decode
    # runs no host work: run 13's t 16 siblings were predicted and would measure the same as t 8)
    if ranked and _hybrid(ranked[0]) and n_finalists >= 3 and not ranked[0].params.expert_mapped:
        take(next(iter(_thread_siblings(ranked[0], ranked)), None))
    if ranked and _hybrid(ranked[0]):  # a larger micro-batch's placement holds fewer experts' copies: measured
        take(_other_sizing(ranked[0], plausible))
    by_ub = [next(c for c in plausible if c.params.n_ubatch == ub) for ub in sorted(
        {c.params.n_ubatch for c in plausible}, key=lambda u: min(preds[c.id].score_s for c in plausible
                                                                 if c.params.n_ubatch == u))]
    for c in by_ub[:2]:
        take(c)
    if ranked and _hybrid(ranked[0]):  # pinned against repacked host weights (a mapped split's experts are neither)
        take(next((c for c in plausible if _hybrid(c) and c.params.no_host != ranked[0].params.no_host
                   and not c.params.expert_mapped), None))
    if any(c.params.expert_split for c in ranked):  # per-expert split against the best whole-tensor placement
        first = next((c for c in ranked if c.params.expert_split), None)
        take(first)  # and the best split whose cold experts run elsewhere (host / GPU over the bus): measured
        take(next((c for c in ranked if c.params.expert_split and first is not None
                   and c.params.expert_mapped != first.params.expert_mapped), None))
        take(next((c for c in ranked if c.params.expert_cache == "adaptive"), None))  # static or adaptive: measured
        take(next((c for c in plausible if _hybrid(c) and not c.params.expert_split), None))
    if ranked and _gpus_used(ranked[0]):
        take(next((c for c in plausible if _gpus_used(c) not in (0, _gpus_used(ranked[0]))), None))
    for n_ctx in sorted({c.params.n_ctx for c in plausible}, reverse=True):  # every context a plan may hold
        take(next(c for c in plausible if c.params.n_ctx == n_ctx))
    for kv in (True, False):  # KV cache on the GPU and on the host
        take(next((c for c in plausible if _gpus_used(c) and c.params.offload_kqv == kv), None))
    for c in by_ub[2:]:
        take(c)
    for g in groups_first:
        if len(chosen) >= n_finalists:
            break
        if g in seen:
            continue
        best = next(c for c in plausible if _group(c) == g)
        chosen.append(best)
        seen.add(g)
    for c in ranked:
        if len(chosen) >= n_finalists:
            break
        if c not in chosen:
            chosen.append(c)
    chosen.sort(key=lambda c: preds[c.id].score_s)
    log.info("prune: kept %d of %d candidates; best predicted %s (%.1f prefill / %.1f decode tok/s)",
             len(chosen), len(ranked), chosen[0].id, preds[chosen[0].id].prefill_tps, preds[chosen[0].id].decode_tps)
    return Finalists(finalists=chosen, predictions=[preds[c.id] for c in chosen],
                     workload_prefill_tokens=work.prefill_tokens, workload_decode_tokens=work.decode_tokens,
                     n_ranked=len(ranked))

