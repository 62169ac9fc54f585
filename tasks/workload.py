"""The planning workload: which prompts are timed and validated, sized to the budget and context.

Tokenizing needs the model's tokenizer, which only the worker has: texts go to a short-lived worker.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict

from artifacts.corpus import (
    conversation_text,
    load_conversations,
    parse_domains,
    sized_prompts,
)
from artifacts.engine_params import ExpertSplit
from artifacts.records.evidence import MeasureSummary
from artifacts.records.hardware import HardwareReport
from artifacts.records.plan import PlanRequest
from artifacts.records.search import Candidate, Finalists, Prediction
from engine_bridge.client import tokenizer
from tasks.costmodel import Workload
from tasks.errors import ImpossiblePlan
from tasks.measurement.speculation import base_id

# A coding agent's prompts, up to the depth its conversations reach (16-32k tokens): the deepest also times
# decode with a deep KV cache, which is where KV placement shows, and prefill over many micro-batches, which is
# where the micro-batch's size shows (a hybrid copies its host weights once per micro-batch: tasks.prefill_ubatch).
# Only those that fit the context (nominal_lengths) and the budget (measurement_lengths) are timed.
LENGTHS = (64, 256, 1024, 2048, 4096, 16384, 32768)
N_GEN = 32
# --workload chat: a turn on a cached history times only the new message and a long reply
CHAT_LENGTHS = (64, 128, 256)
CHAT_N_GEN = 256
VALIDATION_CAP = 256  # longest validation prompt (tokens): agent chats are cut to their last part
MIN_ROUNDS = 2  # rounds every finalist must fit in the budget: one round has no spread
KEEP_FINALISTS = 2  # finalists measured however small the budget (a race needs two)
# The shallowest prompt measured however small the budget: decode after 64 tokens hides what a KV cache on the
# host costs (run 8: 44 tok/s there, 25 at a 512-token depth, 8 at 16k).
MIN_DEPTH = 1024
# The shortest decode window a visit times after each prompt: a slow model's window shrinks to it before the
# plan's budget is overrun (a decode reading of 16 tokens still has a spread over rounds).
MIN_GEN = 16
VISIT_ERROR = 1.5  # prompts are sized as if visits took this much longer than predicted (run 9: up to 1.9x)
# Starting a worker and its first run (process, backend init, the warm-up prompt), beyond loading weights.
VISIT_OVERHEAD_S = 1.5
# A per-expert split's load copies each hot expert to the GPU on its own: from the file's pageable pages ~9 ms an
# expert on the H200 (run 18: mapped splits of 2,680 and 2,892 copies ran 15 and 35 s beyond their visits' other
# terms at their measured speeds), from pinned memory ~1.3 ms (run 17: 5,445 copies, 7 s beyond them).
SPLIT_COPY_S = {"mmap": 0.0088, "pinned": 0.0013}
LOAD_GBS = 6.0  # weights read into (or copied to) their device while loading, GB/s


def nominal_lengths(n_ctx: int, req: PlanRequest) -> tuple[list[int], int]:
    """The workload's prompt lengths that fit the context, and tokens decoded after each (prune's mix)."""
    candidates, n_gen = (CHAT_LENGTHS, CHAT_N_GEN) if req.workload == "chat" else (LENGTHS, N_GEN)
    n_gen = min(n_gen, max(1, n_ctx // 2))
    lengths = [n for n in candidates if n + n_gen < n_ctx]
    return lengths or [min(32, n_ctx // 2)], n_gen


def workload(lengths: list[int], n_gen: int) -> Workload:
    """Token counts of running every prompt once."""
    return Workload(prefill_tokens=sum(lengths), decode_tokens=n_gen * len(lengths),
                    mean_prompt_tokens=sum(lengths) / len(lengths), prompt_lengths=tuple(lengths))


# The share of --budget-s that measuring keeps however much of it the stages before spent: never measure in nothing.
MIN_MEASURE_SHARE = 0.5
# A model's first plan computes its routing trace and reference once (later plans reuse them): up to this many
# of those seconds are not taken from measuring. Run 12 on the H200: a first plan with --budget-s 150 had spent
# 73 s on them and refused to measure 2 finalists twice in the 77 s left.
FIRST_PLAN_GRACE_S = 75.0
# A first plan's target: B + this, in wall time from the command's start. What ran outside the budget before it
# (the process's start, the probe) and the tail after it (validate, persist) come out of it first, so the grace
# is what is left of it: run 13 (probe 33 s, start 12 s) gave 75 s of grace and took B + 120 s.
FIRST_PLAN_SLACK_S = 90.0


def measure_budget(budget_s: float, spent_s: float, one_time_s: float = 0.0, outside_s: float = 0.0) -> float:
    """Seconds the measure stage may use: what ``--budget-s`` has left after the stages before it (all but the
    probe, :class:`tasks.clock.StageClock`), plus a grace for ``one_time_s`` (seconds spent computing the model's
    routing trace and reference, 0 when they were reused) of at most FIRST_PLAN_GRACE_S and at most what
    FIRST_PLAN_SLACK_S leaves after ``outside_s`` (seconds outside the budget: start, probe, tail); never less
    than MIN_MEASURE_SHARE of the budget."""
    grace = min(FIRST_PLAN_GRACE_S, max(0.0, one_time_s), max(0.0, FIRST_PLAN_SLACK_S - outside_s))
    return max(budget_s - spent_s + grace, MIN_MEASURE_SHARE * budget_s)


# Validation and persisting after measuring, beyond the budget (the mixtral twin's took under 2 s).
TAIL_S = 5.0


def first_plan_left(budget_s: float, command_s: float) -> float:
    """Seconds measuring may take for the plan to end within ``budget_s`` + FIRST_PLAN_SLACK_S of the command's
    start, ``command_s`` seconds ago (the tail after it kept)."""
    return budget_s + FIRST_PLAN_SLACK_S - command_s - TAIL_S


def load_rates(hw: HardwareReport, model_bytes: int) -> tuple[float, float]:
    """(GPU, host) bytes/s a load moves, from the probe's timed whole-model loads (LOAD_GBS without them)."""
    gpu = next((k.load_ms for k in hw.kernels if k.device != "CPU" and k.load_ms), None)
    cpu = next((k.load_ms for k in hw.kernels if k.device == "CPU" and k.load_ms), None)
    return (model_bytes / (gpu / 1e3) if gpu else LOAD_GBS * 1e9), (model_bytes / (cpu / 1e3) if cpu else LOAD_GBS * 1e9)


def visit_seconds(cand: Candidate, pred: Prediction, lengths: list[int], n_gen: int,
                  rates: tuple[float, float] = (LOAD_GBS * 1e9, LOAD_GBS * 1e9), score_tokens: int = 0) -> float:
    """Predicted seconds to measure ``cand`` once: start, load its weights (at the probe's rates) and a split's
    expert copies, warm up, run every prompt, and on a first visit score ``score_tokens`` tokens for validation."""
    gpu_rate, cpu_rate = rates
    gpu = sum(b for d, b in cand.weights_bytes.items() if d != "CPU")
    host = cand.weights_bytes.get("CPU", 0) if cand.params.load_mode != "mmap" else 0
    run_s = (sum(lengths) + score_tokens) / max(pred.prefill_tps, 1e-3) + len(lengths) * n_gen / max(pred.decode_tps, 1e-3)
    split = cand.params.expert_split
    copies = sum(len(h.experts) for h in split.layers) if split else 0
    copy_s = copies * SPLIT_COPY_S["mmap" if cand.params.load_mode == "mmap" else "pinned"]
    return VISIT_OVERHEAD_S + gpu / gpu_rate + host / cpu_rate + copy_s + run_s


def round_seconds(fin: Finalists, lengths: list[int], n_gen: int,
                  rates: tuple[float, float] = (LOAD_GBS * 1e9, LOAD_GBS * 1e9)) -> float:
    """Predicted seconds of one measurement round: every finalist once."""
    return sum(visit_seconds(c, p, lengths, n_gen, rates) for c, p in zip(fin.finalists, fin.predictions, strict=True))


def measurement_lengths(fin: Finalists, n_ctx: int, req: PlanRequest, budget_s: float | None = None,
                        rates: tuple[float, float] = (LOAD_GBS * 1e9, LOAD_GBS * 1e9)) -> tuple[list[int], int]:
    """The workload's prompts whose MIN_ROUNDS rounds of the KEEP_FINALISTS best (:func:`diverse_order`) fit the
    budget (with VISIT_ERROR to spare): the deepest that fits first (at least MIN_DEPTH where the context and
    the budget as predicted hold it, else the shortest), then shorter ones while they fit, in the ladder's
    order; :func:`fitting_finalists` then keeps as many finalists as those prompts leave room for.

    Deepest first because the mix's time is mostly its long prompts, and a deep KV cache is where KV placement and
    the per-token cost of attention show: run 8 on the H200 measured only a 64-token prompt at an 8 GiB budget and
    chose a KV-on-host plan that decoded 44 tok/s there and 25 tok/s at a 512-token depth; sized for all six
    finalists, the prompts shrank to that 64-token one again at 10 GiB (run 9a).

    The tokens generated after each prompt scale with the model's speed (:func:`decode_window`): a slow model's
    visits decode a shorter window rather than the plan being refused (the mixtral twin at 12 GiB decodes ~10
    tok/s, and 256 generated tokens a visit did not fit a 240 s budget)."""
    budget = req.budget_s if budget_s is None else budget_s
    ladder, nominal_gen = nominal_lengths(n_ctx, req)
    racers = _first(diverse_order(fin), min(KEEP_FINALISTS, len(fin.finalists)))
    n_gen = decode_window(racers, ladder[0], nominal_gen, budget, rates)

    def fits(lengths: list[int]) -> bool:
        return MIN_ROUNDS * VISIT_ERROR * round_seconds(racers, lengths, n_gen, rates) <= budget

    floor = max((n for n in ladder if n <= MIN_DEPTH), default=ladder[0])
    if MIN_ROUNDS * round_seconds(racers, [floor], n_gen, rates) > budget:
        floor = ladder[0]  # a budget that cannot hold it even as predicted: the shortest, rather than no plan
    chosen = [next((n for n in reversed(ladder) if n >= floor and fits([n])), floor)]
    for n in reversed(ladder):
        if n < chosen[0] and fits([*chosen, n]):
            chosen.append(n)
    return sorted(chosen), n_gen


def decode_window(racers: Finalists, shortest: int, n_gen: int, budget_s: float,
                  rates: tuple[float, float]) -> int:
    """Tokens generated after each prompt: ``n_gen``, halved (down to MIN_GEN) while MIN_ROUNDS rounds of the
    ``racers`` on the ``shortest`` prompt do not fit ``budget_s`` with VISIT_ERROR to spare."""
    while n_gen > MIN_GEN and MIN_ROUNDS * VISIT_ERROR * round_seconds(racers, [shortest], n_gen, rates) > budget_s:
        n_gen = max(MIN_GEN, n_gen // 2)
    return n_gen


def family_key(cand: Candidate) -> str:
    """A placement family without its context variant ('milp-mixed/kv-host@32768' -> 'milp-mixed/kv-host'); an
    adaptive expert cache is a family of its own (run 13 measured the static and the host split of each plan
    and dropped the adaptive one, a variant of the static's family, for lack of budget)."""
    return cand.family.split("@", 1)[0] + ("/adaptive" if cand.params.expert_cache == "adaptive" else "")


def diverse_order(fin: Finalists) -> Finalists:
    """The finalists reordered so each placement family's best-ranked comes before any family's second: when the
    budget measures only some, it races different placements rather than variants of one (run 8 raced two
    context variants of the same KV-on-host split and never measured the KV-on-GPU one). A drafting candidate
    (``--speculation``) stays right behind its placement: asked for, it is measured whenever its placement is (run 20
    measured three placements and dropped the 30B's prompt lookup, fourth in this order, for the budget)."""
    seen: dict[str, int] = {}
    rank = []
    drafts: dict[str, list[int]] = {}
    for i, c in enumerate(fin.finalists):
        if c.draft is not None:
            drafts.setdefault(base_id(c.id), []).append(i)
            continue
        k = family_key(c)
        rank.append((seen.get(k, 0), i))
        seen[k] = seen.get(k, 0) + 1
    order = [j for _, i in sorted(rank) for j in [i, *drafts.pop(fin.finalists[i].id, [])]]
    order += [j for js in drafts.values() for j in js]  # a drafting candidate whose placement is not here
    return fin.model_copy(update={"finalists": [fin.finalists[i] for i in order],
                                  "predictions": [fin.predictions[i] for i in order]})


def fitting_finalists(fin: Finalists, lengths: list[int], n_gen: int, budget_s: float,
                      rates: tuple[float, float], keep: int = KEEP_FINALISTS) -> Finalists:
    """The finalists (:func:`diverse_order`), the last dropped until MIN_ROUNDS rounds of the rest fit
    ``budget_s`` (at least ``keep``): every finalist measured gets a spread, rather than half of them one round
    each. A budget that holds fewer than ``keep`` placements with the drafting candidates among them races
    ``keep`` placements without drafting."""
    fin = diverse_order(fin)
    n = len(fin.finalists)
    while n > keep and MIN_ROUNDS * round_seconds(_first(fin, n), lengths, n_gen, rates) > budget_s:
        n -= 1
    kept = _first(fin, n)
    if sum(c.draft is None for c in kept.finalists) >= min(keep, sum(c.draft is None for c in fin.finalists)):
        return kept
    # too tight for drafting beside a race of placements: the placements race, as without --speculation
    return _first(_placements(fin), keep)


def _placements(fin: Finalists) -> Finalists:
    keep = [i for i, c in enumerate(fin.finalists) if c.draft is None]
    return fin.model_copy(update={"finalists": [fin.finalists[i] for i in keep],
                                  "predictions": [fin.predictions[i] for i in keep]})


def _first(fin: Finalists, n: int) -> Finalists:
    return fin.model_copy(update={"finalists": fin.finalists[:n], "predictions": fin.predictions[:n]})


def overrun_note(fin: Finalists, lengths: list[int], n_gen: int, budget_s: float,
                 rates: tuple[float, float] = (LOAD_GBS * 1e9, LOAD_GBS * 1e9)) -> str | None:
    """What a budget too short to measure every finalist MIN_ROUNDS times means, or ``None`` when it is not.

    Never a refusal: a budget that truly cannot hold two finalists twice is refused right after the probe
    (:func:`check_feasible`); past that point the finalists are measured twice however long it takes, and the
    plan ends later than ``--budget-s`` asked (a loaded machine gives a slower plan, not a refusal)."""
    need = MIN_ROUNDS * round_seconds(fin, lengths, n_gen, rates)
    if budget_s >= need:
        return None
    return (f"the {max(0.0, budget_s):.0f} s left for measuring are less than the ~{need:.0f} s predicted to "
            f"measure {len(fin.finalists)} finalists {MIN_ROUNDS} times each ({len(lengths)} prompt(s) of "
            f"{sum(lengths)} tokens + {n_gen} generated each): every one is measured {MIN_ROUNDS} times all the same, "
            "and the plan ends later than --budget-s")


def fastest_kernels(hw: HardwareReport) -> tuple[float, float, float]:
    """(load s, prefill s per token, decode s per token) of the fastest device the probe timed the whole model
    on: no placement within a budget beats the whole model on its fastest device, so these bound from below."""
    ks = [k for k in hw.kernels if k.decode_ms_per_token > 0]
    if not ks:
        return 0.0, 0.0, 0.0
    best = min(ks, key=lambda k: k.decode_ms_per_token)
    loads = [k.load_ms for k in ks if k.load_ms]
    return (min(loads) / 1e3 if loads else 0.0), best.prefill_ms_per_token / 1e3, best.decode_ms_per_token / 1e3


def least_measure_seconds(hw: HardwareReport, n_ctx: int, req: PlanRequest) -> float:
    """A lower bound on measuring KEEP_FINALISTS finalists MIN_ROUNDS times: every visit loads the whole model
    and runs the shortest prompt and MIN_GEN tokens as fast as the probe's fastest device did."""
    load_s, prefill_s, decode_s = fastest_kernels(hw)
    shortest = nominal_lengths(n_ctx, req)[0][0]
    visit = VISIT_OVERHEAD_S + load_s + shortest * prefill_s + MIN_GEN * decode_s
    return KEEP_FINALISTS * MIN_ROUNDS * visit


def check_feasible(hw: HardwareReport, n_ctx: int, req: PlanRequest, one_time_s: float = 0.0) -> None:
    """Refuse, right after the probe, a ``--budget-s`` that cannot measure two finalists twice even at the
    fastest this machine ran the model (:func:`least_measure_seconds`) after ``one_time_s`` of the model's
    one-time stages (their least, 0 when stored): a refusal that comes before the budget is spent, naming one
    that works. Any budget above it plans, at worst later than asked."""
    need = least_measure_seconds(hw, n_ctx, req) + one_time_s
    if req.budget_s >= need:
        return
    raise ImpossiblePlan(
        f"--budget-s {req.budget_s:g} cannot measure the {KEEP_FINALISTS} finalists {MIN_ROUNDS} times each: "
        f"even at this machine's fastest (the probe's whole-model load and kernels) that takes ~{need:.0f} s",
        f"use --budget-s {int(need * VISIT_ERROR * 2) + 1} or more")


# The share of --budget-s a model's one-time stages (routing trace, reference and noise floor) are sized for:
# they run beside each other, and what they leave is measuring's (the mixtral twin's first plan on the H100 at B = 240:
# 102 s of them left 138 s, too few to measure two finalists twice at a fixed workload).
ONE_TIME_SHARE = 0.3


def one_time_scale(predicted_s: float, budget_s: float) -> float:
    """The factor (at most 1) a one-time stage's work is scaled by so that ``predicted_s`` fits its share of
    ``budget_s`` (ONE_TIME_SHARE)."""
    if predicted_s <= 0:
        return 1.0
    return min(1.0, ONE_TIME_SHARE * budget_s / predicted_s)


def tune_prompts(model: Path, lengths: list[int], seed: int, log_path: Path,
                 domains: tuple[str, ...] = ()) -> list[list[int]]:
    """Corpus prompts ('tune' split; of ``domains`` only, when given) cut to exactly ``lengths`` tokens of this
    model's tokenizer."""
    with tokenizer(model, log_path) as tok:
        return sized_prompts(tok, lengths, split="tune", seed=seed, domains=domains)


def trace_domains(domains: str | None) -> tuple[str, ...]:
    """The domains the routing trace is taken on (``--domains`` TRACE; empty: the whole corpus)."""
    return parse_domains(domains).trace if domains else ()


def measured_domains(domains: str | None) -> tuple[str, ...]:
    """The domains the measured rounds run (``--domains`` MEASURE, else TRACE; empty: the whole corpus)."""
    return parse_domains(domains).measure if domains else ()


def hot_sets(counts: NDArray[np.int64], fraction: float) -> list[list[int]]:
    """Each layer's busiest ``fraction`` of experts in ``counts`` [n_layer, n_expert] (what a split keeps on the GPU
    from that trace), busiest first."""
    n = max(1, round(fraction * counts.shape[1]))
    return [np.argsort(-row, kind="stable")[:n].tolist() for row in counts]


def hot_share(counts: NDArray[np.int64], hot: list[list[int]]) -> float:
    """The share of all picks in ``counts`` [n_layer, n_expert] that hit the ``hot`` experts of their layer."""
    total = counts.sum()
    hit = sum(int(counts[layer, experts].sum()) for layer, experts in enumerate(hot))
    return hit / total if total else 0.0


class ShiftedShare(BaseModel):
    """The hot copies' share of the picks on the traced traffic and on the measured (a domain shift lowers it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    trace: float
    measured: float


def split_shift(traced: NDArray[np.int64], measured: NDArray[np.int64] | None,
                split: ExpertSplit | None) -> ShiftedShare | None:
    """The share of the picks a split's GPU copies serve on the traced traffic and on the measured rounds' (``flux
    plan --domains TRACE:MEASURE``); None without a split or a trace of the measured traffic."""
    if split is None or measured is None:
        return None
    return shifted_share(traced, measured, [list(split.hot(layer)) for layer in range(traced.shape[0])])


def cache_note(candidates: list[Candidate], summaries: list[MeasureSummary], winner_id: str,
               domains: str | None) -> list[str]:
    """Which expert cache won the measured rounds of a shifted mix (``--domains TRACE:MEASURE``) and why: the static
    split (the trace's hot set, fixed) or the adaptive one (``FLUX_MOE_CACHE=adaptive``, following the routing it
    sees), the same placement otherwise; nothing without a shift or a split."""
    win = next((c for c in candidates if c.id == winner_id), None)
    if not domains or win is None or win.params.expert_split is None or not parse_domains(domains).shifts:
        return []
    mix = parse_domains(domains)
    where = f"on the measured rounds ({'+'.join(mix.measure)}; its hot experts were traced on {'+'.join(mix.trace)})"
    mine = win.params.expert_cache
    other = "static" if mine == "adaptive" else "adaptive"
    twin = next((c for c in candidates if c.params == win.params.model_copy(update={"expert_cache": other})), None)
    sums = {s.candidate_id: s for s in summaries}
    a, b = sums.get(win.id), sums.get(twin.id) if twin else None
    if a is None or b is None or not (a.workload_s and b.workload_s and a.decode_tps and b.decode_tps):
        return [f"the {mine} expert cache was measured {where}; the {other} one of the same placement was not, so "
                "the two did not race"]
    return [f"the {mine} expert cache took {a.workload_s:.2f} s (decode {a.decode_tps:.1f} tok/s) {where}, the "
            f"{other} one of the same placement {b.workload_s:.2f} s ({b.decode_tps:.1f} tok/s): measurement kept the "
            f"{mine}"]


def shifted_share(traced: NDArray[np.int64], measured: NDArray[np.int64], hot: list[list[int]]) -> ShiftedShare:
    """How much of the picks the ``hot`` experts (chosen on ``traced``) serve on the traced and the measured traffic."""
    return ShiftedShare(trace=hot_share(traced, hot), measured=hot_share(measured, hot))


def validation_prompts(model: Path, n_ctx: int, n_tokens: int, seed: int, log_path: Path,
                       scale: float = 1.0) -> tuple[list[list[int]], list[list[int]]]:
    """(validation prompts: agent conversations + held-out prompts, held-out prompts to time); ``scale`` < 1
    (:func:`validation_shape`) keeps fewer conversations, cut shorter."""
    cap_at, n_convs = validation_shape(scale)
    cap = max(16, min(cap_at, n_ctx - n_tokens - 8))
    with tokenizer(model, log_path) as tok:
        convs = [tok(conversation_text(c))[-cap:] for c in load_conversations()[:n_convs]]
        held = sized_prompts(tok, [min(cap, n) for n in (128, 512)], split="held_out", seed=seed)
    return convs + held, held


# The least a scaled reference keeps: the quality gate still compares this many conversations of this many tokens.
MIN_VALIDATION_CAP = 64
MIN_CONVERSATIONS = 3


def validation_shape(scale: float) -> tuple[int, int]:
    """(longest validation prompt in tokens, agent conversations kept) at ``scale`` of the full reference."""
    s = max(0.0, min(1.0, scale))
    cap = max(MIN_VALIDATION_CAP, int(VALIDATION_CAP * s) // 16 * 16)
    return cap, max(MIN_CONVERSATIONS, round(len(load_conversations()) * s))
