"""Speculation in the search (``--speculation``): drafting candidates beside the finalists, and what they measured.

A finalist ``c3`` drafting with a draft model is the candidate ``c3+draft``; drafting by prompt lookup,
``c3+ngram``: the same placement and parameters with ``draft`` set. The measure stage times them in the same
rounds as every finalist (greedy decoding of the same prompts, through the worker's ``spec_greedy``), so a
drafting candidate is kept only when it is faster; its quality is its placement's (drafted greedy output is the
model's greedy output), scored once for both. Drafting is tried on prune's :data:`MAX_BASES` best placements,
and its candidates follow their placement in the finalists' order: a budget that cannot measure every finalist
drops prune's last-ranked placements before the drafting of its best.

A model with next-token (MTP) heads drafts with them on llama-server (``--spec-type draft-mtp``): when
``--engines`` names llama-server, the best placement there gets an ``mtp`` drafting candidate
(``c3@llama-server+mtp``), measured like the others (its drafted and kept tokens from llama-server's timings).
Flux's worker does not drive the pin's MTP context, so without llama-server the heads are not measured
(:func:`mtp_note` says so).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from artifacts.engine_spec import LLAMA_SERVER, NATIVE
from artifacts.model_info import kv_cache_bytes, model_info, read_tensors, tensor_layer
from artifacts.records.evidence import MeasureSummary
from artifacts.records.hardware import HardwareReport
from artifacts.records.plan import DraftTrial, PlanRequest
from artifacts.records.search import Candidate, Finalists
from tasks.engines import on_engines
from tasks.gpu_budget import gpu_devices, gpu_limits
from tasks.gpu_memory import predicted_gpu_bytes

if TYPE_CHECKING:
    from tasks.stage import PlanContext

MAX_BASES = 1  # placements drafting is tried on, per engine that drafts: prune's best
MTP_DRAFT = 3  # tokens a next-token head proposes per step (llama-server's --spec-draft-n-max)
DRAFT_COMPUTE_BYTES = 256 * 2**20  # a draft model's compute buffer on the GPU (small models: ~100-300 MiB)
BOOTSTRAP = 2000


def drafting_for(req: PlanRequest, draft_hash: str | None, n_nextn_layers: int = 0,
                 heads_hash: str | None = None) -> tuple[Drafting, ...]:
    """The ways ``req`` asks drafting to be measured: its draft model, prompt lookup for the agent workload, and
    next-token heads when llama-server is among the engines: the model's own (``n_nextn_layers``) or those
    ``--heads`` grafts onto it."""
    if not req.speculation:
        return ()
    out = []
    if req.draft_model is not None:
        out.append(Drafting(kind="model", model=req.draft_model, model_hash=draft_hash))
    if req.workload == "agent":
        out.append(Drafting(kind="ngram"))
    if LLAMA_SERVER in req.engines and req.heads is not None:
        out.append(Drafting(kind="mtp", n_draft=MTP_DRAFT, model=req.heads, model_hash=heads_hash))
    elif n_nextn_layers and LLAMA_SERVER in req.engines:
        out.append(Drafting(kind="mtp", n_draft=MTP_DRAFT))
    return tuple(out)


def base_id(cid: str) -> str:
    """The placement a drafting candidate drafts on (``c3+draft`` -> ``c3``)."""
    return cid.split("+", 1)[0]


def mtp_block_bytes(model: Path) -> int:
    """Bytes of the next-token (MTP) blocks after the model's trunk (its tensors of blocks >= n_layer)."""
    info = model_info(model)
    if not info.n_nextn_layers:
        return 0
    layers = [(tensor_layer(t.name), t.n_bytes) for t in read_tensors(model)]
    return sum(b for i, b in layers if i is not None and i >= info.n_layer)


def draft_bytes(d: Drafting, target: EngineParams, model: str | None = None) -> int:
    """Bytes a draft model holds on its target's main GPU (:func:`artifacts.drafting.draft_params` puts the
    whole draft there when the target uses a GPU): its weights, its KV cache at the target's context, a compute
    buffer. 0 for prompt lookup and for a target on the CPU."""
    if not target.n_gpu_layers or d.kind == "ngram":
        return 0
    if d.kind == "mtp":  # the next-token block, loaded with the model (or grafted) for llama-server's MTP context
        block = Path(d.model).stat().st_size if d.model else mtp_block_bytes(Path(model)) if model else 0
        return block + DRAFT_COMPUTE_BYTES
    if d.model is None:
        return 0
    info = model_info(Path(d.model))
    kv = kv_cache_bytes(info, target.type_k, target.n_ctx, target.n_seq_max, target.n_ubatch)
    return info.file_bytes + int(kv) + DRAFT_COMPUTE_BYTES


def with_drafting(fin: Finalists, drafting: Sequence[Drafting],
                  gpu_room: Callable[[Candidate], dict[str, int]] | None = None, model: str | None = None) -> Finalists:
    """``fin`` with each way of drafting added on its first :data:`MAX_BASES` finalists of each engine that drafts
    (Flux's worker and llama-server; next-token heads on llama-server only, and no draft file beside a per-expert
    split there), each drafting candidate right after its placement, a draft model's bytes (a next-token block's)
    counted on the placement's main GPU.

    ``gpu_room(c)``: per GPU, the bytes ``c``'s budget leaves beside its predicted use; a draft model that does not
    fit there is not measured (its candidate is left out, the same way wherever the finalists are rebuilt)."""
    if not drafting:
        return fin

    def bases(engine: str) -> set[str]:
        return {c.id for c in [c for c in fin.finalists if c.engine == engine and c.draft is None][:MAX_BASES]}

    on = {NATIVE: bases(NATIVE), LLAMA_SERVER: bases(LLAMA_SERVER)}
    by_id = {p.candidate_id: p for p in fin.predictions}
    cands, preds = [], []
    for c in fin.finalists:
        cands.append(c)
        preds += [by_id[c.id]] if c.id in by_id else []
        for d in [d for d in drafting if (c.id in on[LLAMA_SERVER] and not _split_draft_file(c, d))
                  or (c.id in on[NATIVE] and d.kind != "mtp")]:
            cid = f"{c.id}+{d.label}"
            extra, dev = draft_bytes(d, c.params, model), f"CUDA{c.params.main_gpu}"
            if extra and gpu_room is not None and gpu_room(c).get(dev, extra) < extra:
                continue
            weights = {**c.weights_bytes, dev: c.weights_bytes.get(dev, 0) + extra} if extra else c.weights_bytes
            cands.append(c.model_copy(update={"id": cid, "draft": d, "weights_bytes": weights}))
            preds += [by_id[c.id].model_copy(update={"candidate_id": cid})] if c.id in by_id else []
    return fin.model_copy(update={"finalists": cands, "predictions": preds})


def _split_draft_file(c: Candidate, d: Drafting) -> bool:
    """A draft file (a draft model, grafted heads) that llama-server cannot load beside ``c``'s per-expert split:
    the patched llama.cpp applies FLUX_MOE_SPLIT to every model its process loads, and the draft has other layers.
    (Flux's worker loads a draft with its own, split-free environment.)"""
    return d.model is not None and c.params.expert_split is not None


def drafted(ctx: PlanContext, hw: HardwareReport, fin: Finalists) -> Finalists:
    """The finalists as measure, validate and persist all see them: on each engine, with drafting, a draft model
    that does not fit the GPU budget beside its placement left out."""
    limits = {name: limit for (name, _), limit in zip(gpu_devices(hw), gpu_limits(hw, ctx.req), strict=True)}

    def room(c: Candidate) -> dict[str, int]:
        return {d: limits[d] - b for d, b in predicted_gpu_bytes(c, hw).items() if d in limits}

    return with_drafting(on_engines(fin, ctx.engines), ctx.drafting, room, str(ctx.model))


def drafting_that_won(summaries: Sequence[MeasureSummary],
                      rows: Sequence[Mapping[str, object]] | None = None) -> list[MeasureSummary]:
    """``summaries`` without the drafting candidates that did not beat their placement: one whose draft proposed
    nothing (prompt lookup on prompts that never repeat: a CPU run chose `c028+ngram` at 4.73 s against its
    placement's 4.74 s, a tie of noise with no token drafted), whose median workload was not faster, or, given
    the measure stage's trial ``rows``, whose speedup's 95% interval over the paired rounds reaches 1 (a CPU run
    chose prompt lookup at 1.00x [0.97, 1.00]: it drafted, and won nothing)."""
    by_id = {s.candidate_id: s for s in summaries}

    def won(s: MeasureSummary) -> bool:
        base = by_id.get(base_id(s.candidate_id))
        if s.candidate_id == base_id(s.candidate_id):
            return True
        faster = bool(s.drafted and s.accepted and base is not None and base.workload_s is not None
                      and s.workload_s is not None and s.workload_s < base.workload_s)
        if not faster or rows is None or base is None:
            return faster
        ci = speedup_ci(_round_seconds(rows, base.candidate_id), _round_seconds(rows, s.candidate_id))
        return ci is None or ci[0] > 1.0

    return [s for s in summaries if won(s)]


def mtp_note(n_nextn_layers: int, engines: Sequence[str] = (NATIVE,)) -> list[str]:
    """A note when the model has next-token (MTP) heads (``ModelInfo.n_nextn_layers``) that planning did not
    measure (no llama-server)."""
    if not n_nextn_layers or LLAMA_SERVER in engines:
        return []
    return [f"the model has {n_nextn_layers} next-token (MTP) head layer(s); Flux drafts with them on llama-server "
            "only (its worker does not drive the pin's MTP context): `--engines native,llama-server` measures them"]


def _round_seconds(rows: Sequence[Mapping[str, object]], cid: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for r in rows:
        if r.get("candidate_id") == cid and not r.get("error"):
            rnd = int(r["round"])  # type: ignore[call-overload]
            out[rnd] = out.get(rnd, 0.0) + (float(r["prompt_ms"] or 0) + float(r["gen_ms"] or 0)) / 1e3  # type: ignore[arg-type]
    return out


def speedup_ci(base: Mapping[int, float], drafted: Mapping[int, float], seed: int = 0) -> tuple[float, float] | None:
    """95% bootstrap interval of the speedup (base seconds over drafted seconds) over the paired rounds."""
    paired = [(base[r], drafted[r]) for r in sorted(base) if r in drafted and drafted[r] > 0]
    if len(paired) < 2:
        return None
    rng = random.Random(seed)
    means = sorted(sum(b for b, _ in s) / sum(d for _, d in s)
                   for s in ([rng.choice(paired) for _ in paired] for _ in range(BOOTSTRAP)))
    return means[int(0.025 * BOOTSTRAP)], means[int(0.975 * BOOTSTRAP) - 1]


def draft_trials(finalists: Sequence[Candidate], summaries: Sequence[MeasureSummary],
                 rows: Sequence[Mapping[str, object]]) -> list[DraftTrial]:
    """Each drafting candidate beside its base, from the measure stage's summaries and trial rows."""
    by_id = {s.candidate_id: s for s in summaries}
    out = []
    for c in finalists:
        s, b = by_id.get(c.id), by_id.get(base_id(c.id))
        if c.draft is None or s is None or b is None:
            continue
        speed = b.workload_s / s.workload_s if b.workload_s and s.workload_s else None
        out.append(DraftTrial(candidate_id=c.id, base_id=b.candidate_id, kind=c.draft.kind,
                              acceptance=s.accepted / s.drafted if s.drafted and s.accepted is not None else None,
                              proposed=s.drafted,
                              workload_s=s.workload_s, base_workload_s=b.workload_s, decode_tps=s.decode_tps,
                              base_decode_tps=b.decode_tps, speedup=speed,
                              speedup_ci=speedup_ci(_round_seconds(rows, b.candidate_id), _round_seconds(rows, c.id))))
    return out


def speculation_notes(trials: Sequence[DraftTrial], winner: Candidate) -> list[str]:
    """One note per drafting candidate measured, and whether the plan drafts."""
    notes = []
    for t in trials:
        acc = t.acceptance_words()
        if t.speedup is None:
            notes.append(f"speculation {t.candidate_id}: not measured beside {t.base_id}")
            continue
        ci = f" (95% CI {t.speedup_ci[0]:.2f}-{t.speedup_ci[1]:.2f})" if t.speedup_ci else ""
        notes.append(f"speculation {t.candidate_id}: {acc}, {t.speedup:.2f}x {t.base_id}'s workload speed{ci}")
    if trials:
        notes.append(f"the plan drafts ({winner.draft.kind})" if winner.draft is not None else
                     "the plan does not draft: no drafting candidate was surely faster than its placement (its speedup's "
            "interval above 1) and the fastest that passed validation")
    return notes

