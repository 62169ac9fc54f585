"""How well a draft model drafts for a target: measured, on the validation prompts, in real workers.

``agreement(target, draft, ...) -> DraftAgreement``. The target writes its greedy continuation of each prompt;
the draft scores the same tokens, and at every position its top choice either is the target's token (a draft
token greedy speculative decoding would accept) or is not. The share of accepted positions is the acceptance
rate; the mean run of accepted tokens before a miss is how far a draft gets per verification on these prompts.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from artifacts.engine_params import EngineParams
from tasks.quality_gate import compare
from tasks.validation.gate import reference_continuations, scored
from tasks.workload import validation_prompts


class DraftAgreement(BaseModel):
    """A draft against its target over ``positions`` generated tokens."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    acceptance: float
    mean_run: float
    positions: int
    prompts: int


def runs(agree: np.ndarray) -> list[int]:
    """Lengths of the runs of accepted positions, each ended by a miss or the sequence's end."""
    out, n = [], 0
    for ok in agree.tolist():
        if ok:
            n += 1
        else:
            out.append(n)
            n = 0
    out.append(n)
    return out


def agreement(target: Path, draft: Path, *, n_tokens: int = 32, n_ctx: int = 1024, threads: int = 2,
              log_path: Path, timeout_s: float = 600.0) -> DraftAgreement:
    """Measure how often ``draft``'s greedy token is ``target``'s along the target's greedy continuations."""
    params = EngineParams(n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads)
    prompts, _ = validation_prompts(target, n_ctx, n_tokens, 0, log_path)
    seqs, target_lps = reference_continuations(target, params, prompts, n_tokens, log_path, timeout_s, None)
    with tempfile.TemporaryDirectory(prefix="flux-draft-") as d:
        draft_lps = scored(draft, params, seqs, Path(d), "draft", log_path, timeout_s)
    agrees = [compare(t, c)[1] for t, c in zip(target_lps, draft_lps, strict=True)]
    flat = np.concatenate(agrees) if agrees else np.zeros(0, dtype=bool)
    all_runs = [r for a in agrees for r in runs(a)]
    return DraftAgreement(acceptance=float(flat.mean()) if flat.size else 0.0,
                          mean_run=float(np.mean(all_runs)) if all_runs else 0.0, positions=int(flat.size),
                          prompts=len(seqs))
