"""What the GPU record says of a plan made with ``flux plan --speculation``: how it drafts, and what drafting did.

A record pair may ask for drafting: ``MODEL:BUDGET[...]+spec`` plans with ``--speculation`` (prompt lookup on
the agent workload, next-token heads where the engines allow), ``+draftK`` also with ``--draft-model`` of a draft
twin made of the model's first K layers (``flux synth --draft-of``). The plan's own measurement raced each
drafter against its placement without drafting in the same paired rounds (``Plan.speculation``);
:func:`speculation_facts` puts that race and the plan's choice into the row.
"""

from __future__ import annotations

from typing import Any

from artifacts.records.plan import Plan


def speculation_facts(plan: Plan) -> dict[str, Any]:
    """The plan's drafting (``plan_draft``: model, ngram, mtp or None) and, for the best drafter its measurement
    raced, the share of proposals kept, its decode against the placement's and the speedup of the workload with
    its 95% interval. Empty for a plan made without ``--speculation``."""
    if not plan.request.speculation:
        return {}
    draft = plan.candidate.draft
    out: dict[str, Any] = {"plan_draft": draft.kind if draft else None, "spec_trials": len(plan.speculation)}
    trials = [t for t in plan.speculation if t.speedup is not None]
    best = max(trials, key=lambda t: t.speedup or 0.0, default=None)
    if best is None:
        return out
    ci = best.speedup_ci or (None, None)
    return {**out, "spec_kind": best.kind, "spec_candidate": best.candidate_id, "spec_acceptance": best.acceptance,
            "spec_decode_tps": best.decode_tps, "spec_base_decode_tps": best.base_decode_tps,
            "spec_speedup": best.speedup, "spec_speedup_lo": ci[0], "spec_speedup_hi": ci[1]}
