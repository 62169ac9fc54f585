"""The prune stage: the cost model ranks the space on the request's workload and keeps the finalists."""

from __future__ import annotations

from typing import Any

from artifacts.ids import content_id
from artifacts.records.hardware import HardwareReport
from artifacts.records.kinds import FINALISTS
from artifacts.records.search import Candidate, Finalists, PlacementSpace
from tasks import workload as wl
from tasks.costmodel import Workload
from tasks.search.ranking import prune
from tasks.stage import Artifact, PlanContext, Stage


def workload_for(ctx: PlanContext, space: PlacementSpace) -> Workload:
    """Token counts of the workload the plan is ranked on: every prompt of the request's workload once."""
    return wl.workload(*wl.nominal_lengths(space.n_ctx, ctx.req))


def _key(ctx: PlanContext, hw: HardwareReport, space: PlacementSpace) -> dict[str, Any]:
    work = workload_for(ctx, space)
    return {"stage": "prune", "space": content_id(space), "work": [work.prefill_tokens, work.decode_tokens],
            "n": ctx.req.finalists, "code": STAGE.code()}


def _run(ctx: PlanContext, log: Any, hw: HardwareReport, space: PlacementSpace) -> Finalists:
    return prune(space, ctx.info, hw, workload_for(ctx, space), ctx.req.finalists)


def kv_label(c: Candidate) -> str:
    """Where a finalist's KV cache lives, for the log (a CPU-only candidate has no GPU to hold it)."""
    if not any(d != "CPU" for d in (*c.weights_bytes, *c.kv_bytes)):
        return "cpu-only"
    return "kv-window" if c.params.kv_vram_cells else "kv-gpu" if c.params.offload_kqv else "kv-host"


def _report(ctx: PlanContext, log: Any, fin: Finalists, hw: HardwareReport, space: PlacementSpace) -> None:
    work = workload_for(ctx, space)
    log.info("prune: %d finalists of %d candidates for a workload of %d prompt + %d generated tokens: %s",
             len(fin.finalists), fin.n_ranked, work.prefill_tokens, work.decode_tokens, "; ".join(
                 f"{c.id} {c.family} ctx {c.params.n_ctx} ub {c.params.n_ubatch} t {c.params.n_threads} "
                 f"{kv_label(c)} predicted {p.score_s:.2f} s "
                 f"({p.prefill_tps:.0f}/{p.decode_tps:.1f} tok/s)"
                 for c, p in zip(fin.finalists, fin.predictions, strict=True)))


def _labels(c: Candidate) -> tuple[str, str]:
    """(where the KV cache lives, how host weights are laid out) for the UI: a CPU-only candidate has no GPU to hold
    either, and its weights are repacked unless --no-repack (llama.cpp's offload flags mean nothing there)."""
    if kv_label(c) == "cpu-only":
        return "cpu", "repacked" if c.params.repack else "plain"
    return ("gpu" if c.params.offload_kqv else "host"), ("repacked" if c.params.no_host else "gpu-host")


def _artifact(fin: Finalists) -> Artifact:
    return Artifact(key="finalists", description="Finalists and their predicted speed", table=[
        {"candidate": c.id, "family": c.family, "ctx": c.params.n_ctx, "kv": _labels(c)[0],
         "threads": f"{c.params.n_threads}/{c.params.n_threads_batch}",
         "ubatch": c.params.n_ubatch, "flash_attn": c.params.flash_attn, "load": c.params.load_mode,
         "host": _labels(c)[1],
         "hot_experts": sum(len(h.experts) for h in c.params.expert_split.layers) if c.params.expert_split else 0,
         "pred_workload_s": round(p.score_s, 3), "pred_prefill_tps": round(p.prefill_tps, 1),
         "pred_decode_tps": round(p.decode_tps, 1)}
        for c, p in zip(fin.finalists, fin.predictions, strict=True)])


STAGE: Stage[Finalists] = Stage(
    name="prune", version=1, result=Finalists, run=_run, kind=FINALISTS, key=_key,
    inputs=("placement space", "workload token counts", "number of finalists", "code"),
    report=_report, artifact=_artifact)
