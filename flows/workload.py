"""The planning workload: which prompts are timed and validated, sized to the budget and context.

Tokenizing needs the model's tokenizer, which only the worker has: texts go to a short-lived worker.
"""

from __future__ import annotations

from pathlib import Path

from artifacts.model_info import ModelInfo
from engine_bridge.client import tokenizer
from tasks.corpus import conversation_text, load_conversations, sized_prompts
from tasks.costmodel import Workload, cpu_bandwidth, layer_bytes
from tasks.errors import ImpossiblePlan
from tasks.plan_types import Candidate, Finalists, HardwareReport, PlanRequest, Prediction

# A coding agent's prompts, up to the depth its conversations reach (16-32k tokens): the deepest also times
# decode with a deep KV cache, which is where KV placement shows.
LENGTHS = (64, 256, 1024, 2048, 4096, 16384)
N_GEN = 32
# --workload chat: a turn on a cached history times only the new message and a long reply
CHAT_LENGTHS = (64, 128, 256)
CHAT_N_GEN = 256
VALIDATION_CAP = 512  # longest validation prompt (tokens): agent chats are cut to their last part
MIN_ROUNDS = 2  # rounds every finalist must fit in the budget: one round has no spread
# Starting a worker and its first run (process, backend init, the warm-up prompt), beyond loading weights.
VISIT_OVERHEAD_S = 1.5
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
                    mean_prompt_tokens=sum(lengths) / len(lengths))


def visit_seconds(cand: Candidate, pred: Prediction, lengths: list[int], n_gen: int) -> float:
    """Predicted seconds to measure ``cand`` once: start, load its weights, warm up, run every prompt."""
    load_s = sum(cand.weights_bytes.values()) / (LOAD_GBS * 1e9) if cand.params.load_mode != "mmap" else \
        sum(b for d, b in cand.weights_bytes.items() if d != "CPU") / (LOAD_GBS * 1e9)
    run_s = sum(lengths) / max(pred.prefill_tps, 1e-3) + len(lengths) * n_gen / max(pred.decode_tps, 1e-3)
    return VISIT_OVERHEAD_S + load_s + run_s


def round_seconds(fin: Finalists, lengths: list[int], n_gen: int) -> float:
    """Predicted seconds of one measurement round: every finalist once."""
    return sum(visit_seconds(c, p, lengths, n_gen) for c, p in zip(fin.finalists, fin.predictions, strict=True))


def measurement_lengths(fin: Finalists, n_ctx: int, req: PlanRequest) -> tuple[list[int], int]:
    """The longest prefix of the workload's prompts whose MIN_ROUNDS rounds fit the budget (at least one)."""
    ladder, n_gen = nominal_lengths(n_ctx, req)
    lengths = ladder[:1]
    for n in ladder[1:]:
        if MIN_ROUNDS * round_seconds(fin, [*lengths, n], n_gen) > req.budget_s:
            break
        lengths.append(n)
    return lengths, n_gen


def check_budget(fin: Finalists, lengths: list[int], n_gen: int, budget_s: float) -> None:
    """Refuse a budget that cannot measure every finalist MIN_ROUNDS times (no spread, no fair race)."""
    need = MIN_ROUNDS * round_seconds(fin, lengths, n_gen)
    if budget_s < need:
        raise ImpossiblePlan(
            f"--budget-s {budget_s:g} cannot measure the {len(fin.finalists)} finalists {MIN_ROUNDS} times each "
            f"(~{need:.0f} s predicted for {len(lengths)} prompt(s) of {sum(lengths)} tokens + {n_gen} generated "
            "each): one round has no spread",
            f"use --budget-s {int(need * 1.5) + 1} or more")


def tune_prompts(model: Path, lengths: list[int], seed: int, log_path: Path) -> list[list[int]]:
    """Corpus prompts ('tune' split) cut to exactly ``lengths`` tokens of this model's tokenizer."""
    with tokenizer(model, log_path) as tok:
        return sized_prompts(tok, lengths, split="tune", seed=seed)


def validation_prompts(model: Path, n_ctx: int, n_tokens: int, seed: int,
                       log_path: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(validation prompts: agent conversations + held-out prompts, held-out prompts to time)."""
    cap = max(16, min(VALIDATION_CAP, n_ctx - n_tokens - 8))
    with tokenizer(model, log_path) as tok:
        convs = [tok(conversation_text(c))[-cap:] for c in load_conversations()]
        held = sized_prompts(tok, [min(cap, n) for n in (128, 512)], split="held_out", seed=seed)
    return convs + held, held


def roofline_decode(info: ModelInfo, hw: HardwareReport, cand: Candidate) -> float | None:
    """Decode tokens/s if every device only had to read its bytes at its measured bandwidth."""
    per_dev = layer_bytes(info, cand.placement)
    cpu_read = per_dev.get("CPU", (0.0, 0.0))[0]
    seconds = cpu_read / cpu_bandwidth(hw, cand.params.n_threads) if cpu_read else 0.0
    gpu_read = sum(r for d, (r, _) in per_dev.items() if d != "CPU")
    seconds += gpu_read / 3000e9
    return 1 / seconds if seconds > 0 else None
