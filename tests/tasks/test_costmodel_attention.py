"""Decode attention over a KV cache on the host is priced by its multiply-adds, as the H200 measured it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from artifacts.engine_params import EngineParams
from artifacts.model_info import ModelInfo, model_info
from artifacts.records.hardware import HardwareReport
from artifacts.records.search import Candidate, Placement
from tasks.costmodel import Workload, all_on, host_attention_ms, predict
from tasks.testing import h200_report

# qwen3-30b-a3b's attention: 32 query heads over 4 KV heads of 128 (f16 K and V: 2 KiB per token and layer)
QWEN3_30B = {"n_head": 32, "n_head_kv": 4, "key_length": 128, "value_length": 128}
KV_PER_TOKEN_LAYER = 4 * (128 + 128) * 2
RECORDED = Path(__file__).parent / "data" / "h200_memory"


@pytest.fixture(scope="module")
def moe(tiny_moe: Path) -> ModelInfo:
    return model_info(tiny_moe).model_copy(update=QWEN3_30B)


def _cand(placement: Placement, kv: dict[str, int], n_ctx: int = 32768) -> Candidate:
    return Candidate(id="c", family="t", placement=placement,
                     params=EngineParams(n_ctx=n_ctx, n_threads=16, n_threads_batch=16, flash_attn=True),
                     weights_bytes={}, kv_bytes=kv, compute_bytes={})


def _recorded(name: str) -> tuple[ModelInfo, HardwareReport, dict[str, Candidate]]:
    doc = json.loads((RECORDED / f"{name}.json").read_text())
    cands = {f["candidate"]["id"]: Candidate.model_validate(f["candidate"]) for f in doc["finalists"]}
    return ModelInfo.model_validate(doc["model"]), HardwareReport.model_validate(doc["hardware"]), cands


def test_predicted_decode_by_depth_matches_what_run_9_measured() -> None:
    """Run 9b on the H200 (skewed qwen3-30b-a3b twin at 10 GiB, `flux show 58f5d37e0b9e`, recorded with its
    probe and model): c253 (-ngl 23: 26 layers' KV on the host) decoded 38.3 tok/s at a 64-token depth and 8.3
    at 16,384; c121 (every layer's KV on the host) 7.9 over one 64- and one 16,384-token prompt."""
    info, hw, cands = _recorded("memory-qwen3-30b-a3b-skewed-10-run9b")

    def decode(cid: str, depth: int) -> float:
        return predict(info, hw, cands[cid], Workload(prefill_tokens=depth, decode_tokens=32,
                                                      mean_prompt_tokens=depth)).decode_tps

    assert decode("c253", 64) == pytest.approx(38.3, rel=0.15)
    assert decode("c253", 16384) == pytest.approx(8.3, rel=0.15)
    both = 2 / (1 / decode("c121", 64) + 1 / decode("c121", 16384))  # 32 tokens at each depth
    assert both == pytest.approx(7.9, rel=0.2)


def test_the_rate_is_the_measured_flops(moe: ModelInfo) -> None:
    kv = 26 * (16384 - 64) * KV_PER_TOKEN_LAYER  # 7.0 GFLOP of attention for 32 query heads over 4 KV heads
    _, hw, _ = _recorded("memory-qwen3-30b-a3b-skewed-10-run9b")
    ms = host_attention_ms(moe, hw, _cand(all_on(moe, "CPU"), {"CPU": kv}), kv)
    assert ms == pytest.approx(94.4, rel=0.05)


def test_a_kv_on_host_plan_slows_with_depth_and_a_kv_on_gpu_plan_does_not(moe: ModelInfo) -> None:
    hw = h200_report()
    gpu = all_on(moe, "CUDA0")
    n_ctx = 32768
    kv_all = moe.n_layer * n_ctx * KV_PER_TOKEN_LAYER

    def decode(kv_device: str, depth: int) -> float:
        cand = _cand(gpu, {kv_device: kv_all}, n_ctx)
        work = Workload(prefill_tokens=depth, decode_tokens=32, mean_prompt_tokens=depth)
        return predict(moe, hw, cand, work).decode_tps

    assert decode("CUDA0", 16384) > 0.9 * decode("CUDA0", 64)
    host_ratio = decode("CPU", 16384) / decode("CPU", 64)
    assert host_ratio < 0.5, f"KV on the host at 16k decodes {host_ratio:.2f}x its 64-token speed"


def test_predicted_prefill_of_pinned_hybrids_matches_run_9() -> None:
    """Run 9b measured c121 (kv-host split) at 1,547 and c253 (last-22-layers) at 1,585 tok/s of prefill, both
    with pinned host weights; the probe's pinned copy rate alone predicted 3,089 and 2,678."""
    info, hw, cands = _recorded("memory-qwen3-30b-a3b-skewed-10-run9b")
    work = Workload(prefill_tokens=16448, decode_tokens=64, mean_prompt_tokens=8224)
    for cid, measured in (("c121", 1547.0), ("c253", 1585.0)):
        assert predict(info, hw, cands[cid], work).prefill_tps == pytest.approx(measured, rel=0.2), cid


def test_a_per_expert_split_plan_is_predicted_within_15_percent_of_what_the_h200_measured() -> None:
    """Run 11 on the H200 (skewed qwen3-30b-a3b twin, 14 GiB, `--workload chat`, plan 83137dd4e4bd, recorded
    with its probe and model): the per-expert split c208 (3,708 experts copied, 96% of the traced picks, 8
    threads) decoded 84.2 tok/s over 256-token prompts in the measure stage (`flux show`, two rounds). Its 48
    split layers pay the round trip each step; about 13 of their host parts run (a cold pick)."""
    from tasks.costmodel import split_host_parts

    info, hw, cands = _recorded("memory-qwen3-30b-a3b-skewed-14-chat-run11")
    c208 = cands["c208"]
    assert 10 < split_host_parts(info, c208) < 16  # the anatomy counted 12.5 a step at 97% hot
    got = predict(info, hw, c208, Workload(prefill_tokens=256, decode_tokens=256, mean_prompt_tokens=384)).decode_tps
    assert got == pytest.approx(84.2, rel=0.15)


def test_the_whole_model_on_the_gpu_is_predicted_at_the_probes_step() -> None:
    """The GPU's fixed cost per token is what the probe's whole-model step leaves after its bytes."""
    info, hw, _ = _recorded("memory-qwen3-30b-a3b-skewed-14-chat-run11")
    whole = Candidate(id="w", family="all-gpu", placement=all_on(info, "CUDA0"),
                      params=EngineParams(n_ctx=4096, n_gpu_layers=999, n_threads=16, n_threads_batch=16, flash_attn=True),
                      weights_bytes={}, kv_bytes={"CUDA0": 1}, compute_bytes={})
    probe_step = next(k.decode_ms_per_token for k in hw.kernels if k.device == "CUDA0")
    got = predict(info, hw, whole, Workload(prefill_tokens=64, decode_tokens=32, mean_prompt_tokens=64)).decode_tps
    assert got == pytest.approx(1e3 / probe_step, rel=0.05)


@pytest.mark.parametrize(("recorded", "cid", "measured"), [
    ("qwen3-next-80b-a3b-skewed-16-chat-run17", "c175", 90.2),
    ("qwen3-next-80b-a3b-skewed-16-chat-run17", "c143", 124.5),
    ("qwen3.6-35b-a3b-skewed-12-chat-run16", "c167", 308.2),
    ("qwen3.6-35b-a3b-skewed-8-chat-run16", "c187", 223.7),
])
def test_a_hybrids_host_computed_prefill_matches_what_runs_16_and_17_measured(recorded: str, cid: str,
                                                                               measured: float) -> None:
    """Runs 16-17 on the H200 (qwen3next and qwen35moe twins, `--workload chat`): finalists whose host computes
    its experts at prefill (repacked ``--no-host`` weights, never offloaded) measured at half the rate the probe's
    whole-model CPU prefill gave per byte; the measure stage's prompts (64-256 tokens) with the recorded probe."""
    info, hw, cands = _recorded(f"memory-{recorded}")
    c = cands[cid]
    assert c.params.no_host and any(d != "CPU" for d in c.weights_bytes), "a hybrid with repacked host weights"
    work = Workload(prefill_tokens=256, decode_tokens=256, mean_prompt_tokens=149)
    assert predict(info, hw, c, work).prefill_tps == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize(("recorded", "cid", "measured"), [
    ("qwen3-30b-a3b-skewed-12-chat-run13", "c238", 672.9), ("qwen3-30b-a3b-skewed-8-chat-run13", "c218", 675.6),
    ("qwen3-30b-a3b-uniform-10-chat-run13", "c238", 620.1),
])
def test_an_offloading_hybrids_prefill_on_a_prompt_shorter_than_its_micro_batch(recorded: str, cid: str,
                                                                                measured: float) -> None:
    """Run 13 on the H200: host splits with pinned whole expert tensors and op offload, 256-token prompts at a
    512-token micro-batch. Each prompt is one micro-batch of 256 tokens, so each pays a whole copy of the host
    weights: a copy spread over 512 tokens at half the copy rate had predicted 892 (1.3-1.4x)."""
    info, hw, cands = _recorded(f"memory-{recorded}")
    c = cands[cid]
    assert c.params.op_offload and not c.params.expert_mapped and c.params.n_ubatch == 512
    got = predict(info, hw, c, Workload(prefill_tokens=256, decode_tokens=256, mean_prompt_tokens=256)).prefill_tps
    assert got == pytest.approx(measured, rel=0.15)
