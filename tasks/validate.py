"""Validate: the top two finalists (more when both fail) against a reference placement, on held-out
prompts and agent chats.

The reference is the plainest configuration (all weights on the CPU, f16 KV, no flash attention). For
each validation sequence the reference writes a greedy continuation; both it and the candidate then
score that same continuation, and Flux compares the two next-token distributions (mean KL divergence
and top-1 agreement). A candidate must match unless the user asked for a different quality profile
(e.g. ``--kv q8_0``), in which case the numbers are recorded in the plan, not enforced.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import numpy as np

from engine_bridge.client import WorkerClient
from engine_bridge.errors import EngineError
from engine_bridge.params import EngineParams
from tasks.models import Candidate, MeasureSummary, ValidationReport, ValidationResult

log = logging.getLogger(__name__)


def reference_params(params: EngineParams) -> EngineParams:
    """The reference placement for a candidate's context: everything on the CPU, f16 KV, defaults."""
    return EngineParams(n_ctx=params.n_ctx, n_batch=512, n_ubatch=512, n_threads=params.n_threads,
                        n_threads_batch=params.n_threads_batch, n_gpu_layers=0, flash_attn=False,
                        type_k="f16", type_v="f16", load_mode="mmap", seed=params.seed)


def compare(ref: np.ndarray, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-position KL(ref || cand) and top-1 agreement of two log-softmax arrays [n, vocab]."""
    p = np.exp(ref)
    kl = np.maximum((p * (ref - cand)).sum(axis=1), 0.0)
    agree = ref.argmax(axis=1) == cand.argmax(axis=1)
    return kl, agree


def _logprobs(w: WorkerClient, seqs: list[tuple[list[int], list[int]]], tmp: Path, tag: str,
              timeout_s: float) -> list[np.ndarray]:
    out = []
    for i, (prompt, cont) in enumerate(seqs):
        path = tmp / f"{tag}-{i}.npy"
        w.call("logprobs", {"prompt": prompt, "continuation": cont, "out": str(path)}, timeout=timeout_s)
        out.append(np.load(path))
        path.unlink()
    return out


def _reference(model: Path, params: EngineParams, prompts: list[list[int]], n_tokens: int, tmp: Path,
               log_path: Path, timeout_s: float) -> tuple[list[tuple[list[int], list[int]]], list[np.ndarray]]:
    with WorkerClient(log_path=log_path) as w:
        w.call("load", {"model": str(model), "params": params.model_dump()}, timeout=timeout_s)
        seqs = [(p, w.call("greedy", {"prompt": p, "n_gen": n_tokens, "stop_eog": False}, timeout=timeout_s)["tokens"])
                for p in prompts]
        return seqs, _logprobs(w, seqs, tmp, "ref", timeout_s)


def _candidate(cand: Candidate, model: Path, seqs: list[tuple[list[int], list[int]]], held_out: list[list[int]],
               tmp: Path, log_path: Path, timeout_s: float) -> tuple[list[np.ndarray], float | None, float | None]:
    with WorkerClient(log_path=log_path, env=cand.params.environment()) as w:
        w.call("load", {"model": str(model), "params": cand.params.model_dump()}, timeout=timeout_s)
        lps = _logprobs(w, seqs, tmp, cand.id, timeout_s)
        timings = [w.call("timed_run", {"prompt": p, "n_gen": 16}, timeout=timeout_s) for p in held_out]
    pre = sum(t["prompt_tokens"] for t in timings) / max(1e-9, sum(t["prompt_ms"] for t in timings)) * 1e3 if timings else None
    dec = sum(t["gen_tokens"] for t in timings) / max(1e-9, sum(t["gen_ms"] for t in timings)) * 1e3 if timings else None
    return lps, pre, dec


def validate(ranked: list[Candidate], summaries: list[MeasureSummary], model: Path, prompts: list[list[int]],
             held_out: list[list[int]], *, n_tokens: int, max_kl: float, min_top1: float, quality_profile: str,
             log_path: Path, timeout_s: float) -> ValidationReport:
    """Check the two fastest measured finalists against the reference; the faster one that passes wins.

    When neither passes, the next finalists are checked in order until one does: a plan is the fastest
    finalist that matches the reference, not an error while a slower match exists.

    Args:
        ranked: finalists ordered fastest first by measured workload time (failed ones excluded).
        summaries: their measurements (for the log).
        prompts: validation prompts (held-out prompts + agent conversations), already tokenized.
        held_out: held-out prompts timed again on the top two.
    """
    ref_params = reference_params(ranked[0].params)
    results: list[ValidationResult] = []
    with tempfile.TemporaryDirectory(prefix="flux-validate-") as d:
        tmp = Path(d)
        seqs, ref = _reference(model, ref_params, prompts, n_tokens, tmp, log_path, timeout_s)
        for i, cand in enumerate(ranked):
            if i >= 2 and any(r.passed for r in results):
                break
            try:
                lps, pre, dec = _candidate(cand, model, seqs, held_out, tmp, log_path, timeout_s)
            except EngineError as exc:
                log.warning("validate: %s failed: %s", cand.id, exc)
                results.append(ValidationResult(candidate_id=cand.id, mean_kl=float("inf"), max_kl=float("inf"),
                                                top1_agreement=0.0, n_tokens=0, passed=False))
                continue
            kls, agrees = zip(*(compare(r, c) for r, c in zip(ref, lps, strict=True)), strict=True)
            kl, agree = np.concatenate(kls), np.concatenate(agrees)
            mean_kl, top1 = float(kl.mean()), float(agree.mean())
            ok = quality_profile != "reference" or (mean_kl <= max_kl and top1 >= min_top1)
            results.append(ValidationResult(candidate_id=cand.id, mean_kl=mean_kl, max_kl=float(kl.max()),
                                            top1_agreement=top1, n_tokens=int(kl.size), passed=ok,
                                            held_out_prefill_tps=pre, held_out_decode_tps=dec))
            log.info("validate: %s mean KL %.2e, top-1 %.3f over %d tokens -> %s", cand.id, mean_kl, top1,
                     kl.size, "pass" if ok else "FAIL")
    winner = next((r.candidate_id for r in results if r.passed), None)
    if winner is None:
        raise EngineError("validation_failed",
                          f"none of the {len(results)} measured finalists matches the reference placement's outputs "
                          f"({', '.join(f'{r.candidate_id}: KL {r.mean_kl:.2e}, top-1 {r.top1_agreement:.2f}' for r in results)}); "
                          "run `flux plan --replan` or ask for a quality profile such as --kv q8_0")
    return ValidationReport(results=results, winner_id=winner, quality_profile=quality_profile, reference=ref_params)
