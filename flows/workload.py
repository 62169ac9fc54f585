"""The planning workload: which prompts are timed and validated, sized to the budget and context.

Tokenizing needs the model's tokenizer, which only the worker has: texts go to a short-lived worker.
"""

from __future__ import annotations

from pathlib import Path

from artifacts.model_info import ModelInfo
from engine_bridge.client import WorkerClient
from engine_bridge.params import EngineParams
from tasks.corpus import conversation_text, load_conversations, sized_prompts
from tasks.costmodel import cpu_bandwidth, layer_bytes
from tasks.errors import ImpossiblePlan
from tasks.models import Candidate, HardwareReport, PlanRequest

LENGTHS = (64, 256, 1024, 2048, 4096)
N_GEN = 32
# --workload chat: a turn on a cached history times only the new message and a long reply
CHAT_LENGTHS = (64, 128, 256)
CHAT_N_GEN = 256
VALIDATION_CAP = 512  # longest validation prompt (tokens): agent chats are cut to their last part


def prompt_lengths(hw: HardwareReport, info: ModelInfo, n_ctx: int, req: PlanRequest) -> tuple[list[int], int]:
    """Prompt lengths whose visits fit the budget (from the probe's CPU kernel timing), and tokens to decode."""
    k = next((k for k in hw.kernels if k.device == "CPU"), None)
    pre_ms = k.prefill_ms_per_token if k else 1.0
    dec_ms = k.decode_ms_per_token if k else 10.0
    visit_budget_s = req.budget_s / (1.5 * req.finalists * req.repeats)
    candidates, n_gen = (CHAT_LENGTHS, CHAT_N_GEN) if req.workload == "chat" else (LENGTHS, N_GEN)
    n_gen = min(n_gen, max(1, n_ctx // 2))
    lengths: list[int] = []
    for n in candidates:
        if n + n_gen >= n_ctx:
            break
        cost_s = (sum(lengths) + n) * pre_ms / 1e3 + (len(lengths) + 1) * n_gen * dec_ms / 1e3
        if lengths and cost_s > visit_budget_s:
            break
        lengths.append(n)
    return lengths or [min(32, n_ctx // 2)], n_gen


def visit_seconds(hw: HardwareReport, lengths: list[int], n_gen: int) -> float:
    """Estimated seconds to measure one finalist once (load + warm-up + every prompt), from the probe."""
    k = next((k for k in hw.kernels if k.device == "CPU"), None)
    pre_ms = k.prefill_ms_per_token if k else 1.0
    dec_ms = k.decode_ms_per_token if k else 10.0
    return 1.0 + (sum(lengths) * pre_ms + (len(lengths) + 1) * n_gen * dec_ms) / 1e3


def check_budget(hw: HardwareReport, lengths: list[int], n_gen: int, budget_s: float) -> None:
    """Refuse a budget that cannot measure even one finalist once."""
    need = visit_seconds(hw, lengths, n_gen)
    if budget_s < need:
        raise ImpossiblePlan(
            f"--budget-s {budget_s:g} is below one finalist's measurement (~{need:.1f} s for "
            f"{len(lengths)} prompt(s) of {sum(lengths)} tokens + {n_gen} generated each)",
            f"use --budget-s {max(10, int(need * 3 + 1))} or more")


def _tokenizer_params(n_ctx: int = 256) -> EngineParams:
    return EngineParams(n_ctx=n_ctx, n_batch=64, n_ubatch=64)


def tune_prompts(model: Path, lengths: list[int], seed: int, log_path: Path) -> list[list[int]]:
    """Corpus prompts ('tune' split) cut to exactly ``lengths`` tokens of this model's tokenizer."""
    with WorkerClient(log_path=log_path) as w:
        w.call("load", {"model": str(model), "params": _tokenizer_params().model_dump()})
        return sized_prompts(lambda t: w.call("tokenize", {"text": t})["tokens"], lengths, split="tune", seed=seed)


def validation_prompts(model: Path, n_ctx: int, n_tokens: int, seed: int,
                       log_path: Path) -> tuple[list[list[int]], list[list[int]]]:
    """(validation prompts: agent conversations + held-out prompts, held-out prompts to time)."""
    cap = max(16, min(VALIDATION_CAP, n_ctx - n_tokens - 8))
    with WorkerClient(log_path=log_path) as w:
        w.call("load", {"model": str(model), "params": _tokenizer_params().model_dump()})

        def tok(text: str) -> list[int]:
            return list(w.call("tokenize", {"text": text})["tokens"])

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
