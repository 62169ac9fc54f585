"""``flux bench quality``: the plan against the reference placement, by KL, top-1 and perplexity.

The reference is :func:`tasks.validation.gate.reference_params` (everything on the CPU, f16 KV, no flash
attention). Two measurements, each on both configurations in fresh workers:

* Next-token agreement: on held-out corpus prompts and the bundled coding-agent conversations, the
  reference writes a greedy continuation; both configurations then score that same continuation, and
  the two next-token distributions are compared position by position (KL(ref || plan), top-1 agreement).
* Perplexity: teacher-forced log-probabilities of held-out corpus text (windows of real text, not model
  output), ``exp(mean NLL)`` for each configuration and their ratio.

Verdict: ``pass`` when mean KL <= ``[plan] max_kl`` and top-1 >= ``[plan] min_top1``; a plan made for
another quality profile (``--kv q8_0``) is allowed to differ, so its verdict is ``info``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from artifacts.corpus import conversation_text, load_conversations, sized_prompts
from artifacts.engine_params import EngineParams
from engine_bridge import ops
from engine_bridge.client import WorkerClient, tokenizer
from tasks.bench.context import BenchContext, Progress
from tasks.bench.host import load_avg
from tasks.bench.record import BenchRun, SummaryRow, Verdict
from tasks.bench.registry import Suite
from tasks.corpus_wikitext import wikitext2
from tasks.quality_gate import compare
from tasks.validation.gate import reference_params

RAW_SCHEMA = pa.schema([
    ("source", pa.string()), ("item", pa.string()), ("prompt_tokens", pa.int32()), ("n_tokens", pa.int32()),
    ("mean_kl", pa.float64()), ("max_kl", pa.float64()), ("top1", pa.float64()),
    ("nll_reference", pa.float64()), ("nll_plan", pa.float64()),
])
PROMPT_CAP = 512  # longest agreement prompt: agent conversations are cut to their last part


class QualityOptions(BaseModel):
    """How ``flux bench quality`` compares."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    n_tokens: int | None = Field(None, ge=2, description="greedy tokens compared per prompt ([plan] validate_tokens)")
    held_out: tuple[int, ...] = (128, 512)
    conversations: int = Field(8, ge=0)
    ppl_windows: int = Field(4, ge=1)
    ppl_tokens: int = Field(256, ge=8)
    seed: int = 0


@dataclass
class _Inputs:
    """Tokenized inputs: agreement prompts (source, item, tokens) and perplexity windows."""

    prompts: list[tuple[str, str, list[int]]]
    windows: list[list[int]]
    ppl_corpus: str = "bundled held-out"


def _inputs(ctx: BenchContext, opts: QualityOptions, n_tokens: int, window: int) -> _Inputs:
    """Tokenize the held-out prompts, the conversations and the perplexity text with the model's tokenizer."""
    cap = max(16, min(PROMPT_CAP, ctx.params.n_ctx - n_tokens - 8))
    wiki = wikitext2(ctx.settings.cache_dir) or []  # before the worker starts: it may wait on the network
    with tokenizer(ctx.model, ctx.worker_log, ctx.timeout_s) as tok:
        held = sized_prompts(tok, [min(cap, n) for n in opts.held_out], split="held_out", seed=opts.seed)
        convs = [(c.id, tok(conversation_text(c))[-cap:]) for c in load_conversations()[:opts.conversations]]
        windows = _wiki_windows(tok, wiki, window + 1, opts.ppl_windows)
        corpus = "WikiText-2 test" if windows else "bundled held-out"
        if not windows:
            windows = sized_prompts(tok, [window + 1] * opts.ppl_windows, split="held_out", seed=opts.seed + 1)
    prompts = [("held_out", f"held_out-{len(p)}-{i}", p) for i, p in enumerate(held)]
    prompts += [("conversation", cid, p) for cid, p in convs]
    return _Inputs(prompts=prompts, windows=windows, ppl_corpus=corpus)


def _wiki_windows(tok: Callable[[str], list[int]], paragraphs: Sequence[str], size: int, count: int) -> list[list[int]]:
    """``count`` windows of ``size`` tokens, each from consecutive paragraphs starting at points spread over the
    text (only what the windows need is tokenized); fewer when the text runs out."""
    out: list[list[int]] = []
    for start in range(0, len(paragraphs), max(1, len(paragraphs) // max(count, 1))):
        toks: list[int] = []
        for para in paragraphs[start:]:
            toks += tok(para + "\n\n")
            if len(toks) >= size:
                out.append(toks[:size])
                break
        if len(out) == count or len(toks) < size:
            break
    return out


def _logprobs(w: WorkerClient, prompt: list[int], cont: list[int], tmp: Path, timeout_s: float) -> np.ndarray:
    """Log-softmax rows before each continuation token (written by the worker as .npy)."""
    path = tmp / "lp.npy"
    w.request(ops.LOGPROBS, ops.LogprobsArgs(prompt=prompt, continuation=cont, out=str(path)), timeout_s)
    rows = np.load(path)
    path.unlink()
    return rows


def _nll(w: WorkerClient, windows: Sequence[list[int]], tmp: Path, timeout_s: float) -> list[float]:
    """Mean negative log-likelihood of each window's tokens after its first (teacher forcing)."""
    out = []
    for win in windows:
        lp = _logprobs(w, win[:1], win[1:], tmp, timeout_s)
        out.append(float(-lp[np.arange(len(win) - 1), win[1:]].mean()))
    return out


def _session(ctx: BenchContext, params: EngineParams, seqs: Sequence[tuple[list[int], list[int]]],
             windows: Sequence[list[int]], tmp: Path, greedy_n: int = 0) -> tuple[list[list[int]], list[np.ndarray], list[float]]:
    """One fresh worker: greedy continuations (when ``greedy_n``), their logprobs, window NLLs."""
    with WorkerClient(log_path=ctx.worker_log, env=params.environment()) as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(ctx.model), params=params), ctx.timeout_s)
        conts = [w.request(ops.GREEDY, ops.GreedyArgs(prompt=p, n_gen=greedy_n, stop_eog=False), ctx.timeout_s).tokens
                 for p, _ in seqs] if greedy_n else [c for _, c in seqs]
        lps = [_logprobs(w, p, c, tmp, ctx.timeout_s) for (p, _), c in zip(seqs, conts, strict=True)]
        return conts, lps, _nll(w, windows, tmp, ctx.timeout_s)


def _verdict(ctx: BenchContext, mean_kl: float, top1: float) -> tuple[Verdict, str]:
    if ctx.plan.quality_profile != "reference":
        return "info", f"quality profile {ctx.plan.quality_profile}: differences are expected, not enforced"
    max_kl, min_top1 = _limits(ctx)
    ok = mean_kl <= max_kl and top1 >= min_top1
    return ("pass" if ok else "fail"), (f"mean KL {mean_kl:.2e} (max {max_kl:.2e}), top-1 {top1:.3f} "
                                        f"(min {min_top1:.3f})")


def _limits(ctx: BenchContext) -> tuple[float, float]:
    """The limits the plan was validated with (widened to its noise floor), else the settings' own."""
    plan = ctx.plan
    if plan.kl_limit is not None and plan.top1_limit is not None:
        return plan.kl_limit, plan.top1_limit
    return ctx.settings.plan.max_kl, ctx.settings.plan.min_top1


def bench_quality(ctx: BenchContext, opts: QualityOptions, progress: Progress | None = None) -> BenchRun:
    """Compare the plan with the reference placement; one summary row (baseline ``reference``)."""
    n_tokens = opts.n_tokens or ctx.settings.plan.validate_tokens
    ref = reference_params(ctx.params.n_ctx, ctx.params.n_threads, ctx.params.seed)
    window = min(opts.ppl_tokens, ref.n_batch, ctx.params.n_batch, ctx.params.n_ctx - 2)
    t0, load0 = time.monotonic(), load_avg()
    inputs = _inputs(ctx, opts, n_tokens, window)
    seqs: list[tuple[list[int], list[int]]] = [(p, []) for _, _, p in inputs.prompts]
    with tempfile.TemporaryDirectory(prefix="flux-bench-quality-") as d:
        if progress:
            progress(f"reference: {len(seqs)} greedy continuations of {n_tokens} tokens, {len(inputs.windows)} windows")
        conts, ref_lps, ref_nll = _session(ctx, ref, seqs, inputs.windows, Path(d), greedy_n=n_tokens)
        if progress:
            progress("plan: scoring the same continuations and windows")
        _, plan_lps, plan_nll = _session(ctx, ctx.params, [(p, c) for (p, _), c in zip(seqs, conts, strict=True)],
                                         inputs.windows, Path(d))
    rows: list[dict[str, Any]] = []
    kls, agrees = [], []
    for (source, item, prompt), r, c in zip(inputs.prompts, ref_lps, plan_lps, strict=True):
        kl, agree = compare(r, c)
        kls.append(kl)
        agrees.append(agree)
        rows.append({"source": source, "item": item, "prompt_tokens": len(prompt), "n_tokens": int(kl.size),
                     "mean_kl": float(kl.mean()), "max_kl": float(kl.max()), "top1": float(agree.mean())})
    rows += [{"source": "perplexity", "item": f"window-{i}", "prompt_tokens": 1, "n_tokens": window,
              "nll_reference": a, "nll_plan": b} for i, (a, b) in enumerate(zip(ref_nll, plan_nll, strict=True))]
    kl_all, agree_all = np.concatenate(kls), np.concatenate(agrees)
    mean_kl, top1 = float(kl_all.mean()), float(agree_all.mean())
    ppl_ref, ppl_plan = float(np.exp(np.mean(ref_nll))), float(np.exp(np.mean(plan_nll)))
    verdict, detail = _verdict(ctx, mean_kl, top1)
    detail += (f"; perplexity {ppl_plan:.3f} vs reference {ppl_ref:.3f} (ratio {ppl_plan / ppl_ref:.4f}, "
               f"{inputs.ppl_corpus} text)")
    metrics = {"mean_kl": mean_kl, "max_kl": float(kl_all.max()), "top1": top1, "n_tokens": int(kl_all.size),
               "ppl_plan": ppl_plan, "ppl_reference": ppl_ref, "ppl_ratio": ppl_plan / ppl_ref,
               "ppl_tokens": window * len(inputs.windows), "ppl_corpus": inputs.ppl_corpus, "max_kl_limit": _limits(ctx)[0],
               "min_top1_limit": _limits(ctx)[1], "quality_profile": ctx.plan.quality_profile,
               "reference": ref.model_dump(mode="json"), "options": opts.model_dump(mode="json"),
               "greedy_tokens": n_tokens, "seconds": time.monotonic() - t0, "load_avg_start": load0,
               "load_avg_end": load_avg()}
    row = SummaryRow(baseline="reference", verdict=verdict, detail=detail, n_samples=int(kl_all.size), metrics=metrics)
    raw = pa.Table.from_pylist([{f.name: r.get(f.name) for f in RAW_SCHEMA} for r in rows], schema=RAW_SCHEMA)
    return BenchRun(suite="quality", ctx=ctx, rows=[row], raw=raw)


SUITE = Suite(
    name="quality", help="compare the plan with the reference placement: KL, top-1, perplexity",
    description="Greedy continuations of held-out prompts and agent conversations scored by both configurations "
                "(mean/max KL, top-1 agreement) and teacher-forced perplexity of held-out text. Pass within the "
                "limits the plan was validated with (the noise floor of correct kernels; else [plan] max_kl and "
                "min_top1); info for a non-reference quality profile. Exit 1 on fail.",
    options=QualityOptions, run=bench_quality, flags=("n_tokens", "conversations", "ppl_windows", "seed"),
    rename={"n_tokens": "--tokens"},
    help_text={"conversations": "agent conversations compared", "ppl_windows": "held-out text windows for perplexity"})
