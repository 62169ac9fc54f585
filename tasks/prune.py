"""Prune: rank every candidate with the cost model, keep a few diverse finalists for measurement.

The cost model is good at what moves bytes (threads vs bandwidth, which tensors sit on a GPU) and blind
to knobs whose effect is kernel-specific (flash attention on a CPU, mmap vs loaded weights, micro-batch
size). So the finalists are the best-predicted candidate of each micro-batch size first (on the H200 the
same all-GPU placement prefilled at 4,500 tok/s with -ub 256 and 7,300 with -ub 512, which the model
ranked equal), then of each group of the other uncertain knobs, then the next best overall: measurement
settles what the model cannot.
"""

from __future__ import annotations

import logging

from artifacts.model_info import ModelInfo
from tasks.costmodel import Workload, predict
from tasks.models import Candidate, Finalists, HardwareReport, PlacementSpace, Prediction

log = logging.getLogger(__name__)


def _group(c: Candidate) -> tuple[object, ...]:
    """The knobs the cost model cannot rank: one finalist per combination first."""
    return (c.family, c.params.flash_attn, c.params.load_mode)


def prune(space: PlacementSpace, info: ModelInfo, hw: HardwareReport, work: Workload, n_finalists: int) -> Finalists:
    """Rank all candidates by predicted workload time and keep ``n_finalists`` diverse ones."""
    preds = {c.id: predict(info, hw, c, work) for c in space.candidates}
    ranked = sorted(space.candidates, key=lambda c: (preds[c.id].score_s, c.id))
    chosen: list[Candidate] = []
    seen: set[tuple[object, ...]] = set()
    groups_first = sorted({_group(c) for c in ranked}, key=lambda g: min(
        preds[c.id].score_s for c in ranked if _group(c) == g))
    for ub in sorted({c.params.n_ubatch for c in ranked}, key=lambda u: min(
            preds[c.id].score_s for c in ranked if c.params.n_ubatch == u)):
        if len(chosen) >= n_finalists:
            break
        best = next(c for c in ranked if c.params.n_ubatch == ub)
        chosen.append(best)
        seen.add(_group(best))
    for g in groups_first:
        if len(chosen) >= n_finalists:
            break
        if g in seen:
            continue
        best = next(c for c in ranked if _group(c) == g)
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


def all_predictions(space: PlacementSpace, info: ModelInfo, hw: HardwareReport, work: Workload) -> list[Prediction]:
    """Predictions for every candidate (for the benchmark's exhaustive grid and for ablations)."""
    return [predict(info, hw, c, work) for c in space.candidates]
