"""Parts the race suites share (run, run --via serve, ablate): the prompts a race times, cut from the corpus
with the plan's model's tokenizer, and a summary row from a pair of ratio intervals."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from artifacts.corpus import sized_prompts
from engine_bridge.client import tokenizer
from tasks.bench.context import BenchContext
from tasks.bench.record import SummaryRow
from tasks.bench.stats import RatioCI


def tokenize_prompts(ctx: BenchContext, lengths: Sequence[int], split: str, seed: int) -> list[list[int]]:
    """Corpus prompts of ``split`` cut to exactly ``lengths`` tokens of the plan's model."""
    with tokenizer(ctx.model, ctx.worker_log, ctx.timeout_s) as tok:
        return sized_prompts(tok, list(lengths), split=split, seed=seed)


def distinct_prompts(ctx: BenchContext, lengths: Sequence[int], split: str, seed: int) -> list[list[int]]:
    """Like :func:`tokenize_prompts`, but no two prompts share a beginning, however long: each opens with its own
    number, then corpus text cut on a seed of its own. (Prompts longer than any corpus prompt are joins of corpus
    prompts, which one call joins in one order, and ``flux serve`` reuses a cached prefix whatever the request
    asks: a shared beginning would let one prompt's prefill ride on another's.) The corpus is tokenized once."""
    seen: dict[str, list[int]] = {}
    with tokenizer(ctx.model, ctx.worker_log, ctx.timeout_s) as tok:
        def cached(text: str) -> list[int]:
            if text not in seen:
                seen[text] = tok(text)
            return seen[text]

        return [(tok(f"{seed + i}: ") + sized_prompts(cached, [n], split=split, seed=seed + i)[0])[:n]
                for i, n in enumerate(lengths)]



def ratio_row(baseline: str, pre: RatioCI, dec: RatioCI, verdict: Any, detail: str,
              metrics: dict[str, Any]) -> SummaryRow:
    """A summary row from the two ratios."""
    return SummaryRow(baseline=baseline, verdict=verdict, detail=detail, ratio_prefill=pre.ratio,
                      ratio_decode=dec.ratio, ci_low=dec.low, ci_high=dec.high, prefill_ci_low=pre.low,
                      prefill_ci_high=pre.high, n_samples=min(pre.n, dec.n),
                      metrics={**metrics, "prefill": pre.model_dump(), "decode": dec.model_dump(),
                               "outcome_prefill": pre.outcome, "outcome_decode": dec.outcome})
