"""A split whose cold experts the GPU reads from pinned host memory (EngineParams.expert_mapped, patch 0006):
enumerated beside the host split with every layer split, its copies counted in host memory, priced by the cold
bytes crossing the bus instead of a host round trip per layer, and raced against the host split."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from artifacts.engine_params import EngineParams, ExpertSplit, mapped_batch_limit
from artifacts.model_info import ModelInfo, expert_bytes, model_info
from tasks import workload as wl
from tasks.costmodel import (
    CACHE_READ_MS,
    MAPPED_READ_SHARE,
    Workload,
    head_bytes,
    mapped_bandwidth,
    mapped_reads,
    predict,
    split_host_parts,
)
from tasks.expert_hot import block_bytes, hot_placement, mapped_bytes
from tasks.search.ranking import prune
from tasks.testing import h200_report
from tests.tasks.test_costmodel_attention import _recorded
from tests.tasks.test_expert_hot import _space, skewed
from tests.tasks.test_placement import WORK

CHAT = Workload(prefill_tokens=256, decode_tokens=256, mean_prompt_tokens=384)


@pytest.fixture(scope="module")
def moe(tiny_moe: Path) -> ModelInfo:
    return model_info(tiny_moe)


def test_the_switch_needs_a_split_and_travels_in_the_environment() -> None:
    split = ExpertSplit.on("CUDA0", {0: [1, 2]})
    assert EngineParams(expert_split=split, expert_mapped=True).environment()["FLUX_MOE_MAPPED"] == "1"
    assert "FLUX_MOE_MAPPED" not in EngineParams(expert_split=split).environment()
    with pytest.raises(ValidationError, match="need expert_split"):
        EngineParams(expert_mapped=True)
    # a batch limit other than the patch's default travels too, for a mapped split only
    env = EngineParams(expert_split=split, expert_mapped=True, expert_mapped_tokens=7).environment()
    assert env["FLUX_MOE_MAPPED_MAX_TOKENS"] == "7"
    assert "FLUX_MOE_MAPPED_MAX_TOKENS" not in EngineParams(expert_split=split, expert_mapped=True).environment()


@pytest.mark.parametrize(("types", "cc", "want"), [
    (["Q4_0", "F32"], "9.0", 7), (["Q4_K", "Q6_K", "F32"], "8.9", 7), (["Q4_K", "Q3_K"], "9.0", 5),
    (["Q2_K", "Q4_K"], "7.5", 7), (["Q4_0"], "6.1", 4), (["Q4_0"], None, 4), (["F16"], "9.0", 7)])
def test_a_mapped_split_computes_batches_up_to_what_the_vector_kernels_take(types: list[str], cc: str | None,
                                                                            want: int) -> None:
    """The pinned llama.cpp's CUDA mul_mat_id runs its vector kernels (patched to skip a negative expert id) up to
    8 tokens for most types on Turing and newer, fewer for a few (ggml-cuda/mmvq.cu), and Flux stops at 7 (8
    measured slower on the H200); an older or unknown GPU keeps the patch's default of 4: a drafted step of 4
    proposals (5 tokens) stays on the GPU where it can."""
    assert mapped_batch_limit(types, cc) == want


def test_covering_every_layer_takes_each_layers_busiest_expert_first(moe: ModelInfo) -> None:
    shares = np.full((moe.n_layer, moe.n_expert), 1.0 / moe.n_expert)  # uniform layers, and one skewed one
    shares[0] = 0.1 / (moe.n_expert - 1)
    shares[0, 3] = 0.9
    one_each = int(sum(sorted(expert_bytes(moe))[-moe.n_layer:]) * 1.01)
    budget = block_bytes(moe) + head_bytes(moe) + one_each
    hp = hot_placement(moe, shares, budget, cover_layers=True)
    assert hp is not None
    assert [h.layer for h in hp.split.layers] == list(range(moe.n_layer)), "every layer is split"
    for h in hp.split.layers:
        assert list(h.experts) == [int(np.argmax(shares[h.layer]))] or h.layer != 0 and len(h.experts) == 1
    plain = hot_placement(moe, shares, budget)
    assert plain is not None and len(plain.split.layers) < moe.n_layer, "by share alone some layers get none"


def test_mapped_candidates_split_every_layer_and_count_their_copies_in_host_memory(moe: ModelInfo) -> None:
    space = _space(moe, skewed(moe), 0.3)
    mapped = [c for c in space.candidates if c.params.expert_mapped]
    host = [c for c in space.candidates if c.params.expert_split and not c.params.expert_mapped]
    assert mapped and host and {c.family for c in mapped} == {"experts-mapped"}
    # on the H200 (compute capability 9.0) a Q4_0 twin's mapped splits compute up to 7 tokens on the GPU
    assert {c.params.expert_mapped_tokens for c in mapped} == {7}
    assert {c.params.expert_mapped_tokens for c in host} == {4}
    for c in mapped:
        split = c.params.expert_split
        assert split is not None and [h.layer for h in split.layers] == list(range(moe.n_layer))
        twin = next(h for h in host if h.params.n_threads == c.params.n_threads and h.params.n_ubatch == c.params.n_ubatch
                    and h.params.load_mode == c.params.load_mode and h.params.flash_attn == c.params.flash_attn
                    and h.params.no_host == c.params.no_host)
        assert c.weights_bytes["CPU"] == twin.weights_bytes["CPU"] + mapped_bytes(moe, split)
        assert mapped_bytes(moe, split) == sum(expert_bytes(moe)[h.layer] * (moe.n_expert - len(h.experts))
                                               for h in split.layers)


def test_prune_races_the_best_mapped_split_against_the_best_host_split(moe: ModelInfo) -> None:
    space = _space(moe, skewed(moe), 0.3)
    fin = prune(space, moe, h200_report(1), WORK, 8)
    kinds = {c.params.expert_mapped for c in fin.finalists if c.params.expert_split}
    assert kinds == {True, False}


def test_a_mapped_split_pays_its_cold_bytes_over_the_bus_instead_of_host_parts() -> None:
    """Run 11's per-expert plan (96% of the picks on GPU copies, 84.2 tok/s measured with the host split): as a
    mapped split it has no host part and no hand-over, and its cold picks cost their bytes at the bus rate."""
    info, hw, cands = _recorded("memory-qwen3-30b-a3b-skewed-14-chat-run11")
    host = cands["c208"]
    mapped = host.model_copy(update={"params": host.params.model_copy(update={"expert_mapped": True})})
    cold = mapped_reads(info, mapped)
    frac = info.n_expert_used / info.n_expert
    split = host.params.expert_split
    assert split is not None
    expected = sum((1 - host.hot_share[h.layer]) * frac * sum(info.layers[h.layer].bytes_by_role[f"experts_{p}"]
                                                              for p in ("gate", "up", "down")) for h in split.layers)
    assert cold == pytest.approx(expected)
    assert mapped_reads(info, host) == 0.0 and split_host_parts(info, host) > 10
    got_host = predict(info, hw, host, CHAT).decode_tps
    got_mapped = predict(info, hw, mapped, CHAT).decode_tps
    assert got_mapped > 1.3 * got_host, (got_mapped, got_host)
    ceiling = 1e3 / next(k.decode_ms_per_token for k in hw.kernels if k.device == "CUDA0")
    assert got_mapped < ceiling
    # each cold pick more costs its bytes at the bus rate (less the same bytes at the GPU's own rate)
    low = mapped.model_copy(update={"hot_share": [0.2] * len(host.hot_share)})
    extra_ms = 1e3 / predict(info, hw, low, CHAT).decode_tps - 1e3 / got_mapped
    assert extra_ms == pytest.approx((mapped_reads(info, low) - cold) / mapped_bandwidth(hw) * 1e3, rel=0.02)
    assert mapped_bandwidth(hw) == pytest.approx(hw.gpus[0].h2d_pinned_gbs * MAPPED_READ_SHARE * 1e9)


@pytest.mark.parametrize(("budget", "measured"), [
    (8, {"c212": 86.6, "c206": 57.6}),
    (16, {"c238": 186.1, "c226": 100.3}),
])
def test_split_plans_are_predicted_within_15_percent_of_what_run_12_measured(budget: int,
                                                                             measured: dict[str, float]) -> None:
    """Run 12 on the H200 (skewed qwen3-30b-a3b twin, `--workload chat`, recorded with its probe and model): the
    measure stage's decode of the mapped split (c212, c238) and the host split (c206, c226) at 8 and 16 GiB
    (`flux show`, docs/benchmarks/h200/run12/)."""
    info, hw, cands = _recorded(f"memory-qwen3-30b-a3b-skewed-{budget}-chat-run12")
    for cid, tps in measured.items():
        assert cands[cid].params.expert_mapped == (cands[cid].family.startswith("experts-mapped"))
        assert predict(info, hw, cands[cid], CHAT).decode_tps == pytest.approx(tps, rel=0.15), cid


@pytest.mark.parametrize(("recorded", "cid", "measured"), [
    ("skewed-12-chat-run13", "c248", 141.8), ("skewed-12-chat-run13", "c238", 95.7),
    ("skewed-8-chat-run13", "c228", 88.0),
    pytest.param("skewed-8-chat-run13", "c218", 71.6, marks=pytest.mark.xfail(strict=True, reason=(
        "a known miss: the host split at 16 threads and 31% cold picks decoded 71.6 tok/s, predicted 55.8 (-22%); "
        "run 12's same configuration (c206, also 16 threads, on a host whose RAM read faster) measured 57.6, "
        "predicted 51.5: the two runs differ by 24%, more than the model's error on either"))),
    ("uniform-10-chat-run13", "c248", 56.7), ("uniform-10-chat-run13", "c238", 47.9),
])
def test_split_plans_are_predicted_within_15_percent_of_what_run_13_measured(recorded: str, cid: str,
                                                                             measured: float) -> None:
    """Run 13 on the H200 (qwen3-30b-a3b twins, `--workload chat`, each recorded with its probe and model): the
    measure stage's decode of the mapped split (experts-mapped) and the host split (experts-hot, 16 threads)
    of each plan (`flux show`, docs/benchmarks/h200/run13/)."""
    info, hw, cands = _recorded(f"memory-qwen3-30b-a3b-{recorded}")
    assert predict(info, hw, cands[cid], CHAT).decode_tps == pytest.approx(measured, rel=0.15), cid


@pytest.mark.parametrize(("recorded", "cid", "measured"), [
    ("qwen3.6-35b-a3b-skewed-8-ctx262144-chat-run21", "c106", 66.5),
    ("qwen3.6-35b-a3b-skewed-8-ctx262144-chat-run21", "c107", 62.3),
    ("qwen3-30b-a3b-skewed-12-spec-run22", "c208", 130.0),
])
def test_split_plans_are_predicted_within_15_percent_of_what_runs_21_and_22_measured(recorded: str, cid: str,
                                                                                      measured: float) -> None:
    """Runs 21-22 on the H200 (current code): the measure stage's decode of the mapped splits, the 35B at 8 GiB and
    262,144 tokens (chat) and the 30B at 12 GiB (agent), at the prompts they were measured on (`flux show`,
    docs/benchmarks/h200/run21/ and run22/)."""
    import json

    from tasks.workload import workload

    info, hw, cands = _recorded(f"memory-{recorded}")
    doc = json.loads((Path(__file__).parent / "data" / "h200_memory" / f"memory-{recorded}.json").read_text())
    f = next(f for f in doc["finalists"] if f["candidate"]["id"] == cid)
    assert cands[cid].params.expert_mapped
    got = predict(info, hw, cands[cid], workload(f["prompt_tokens"], f["n_gen"])).decode_tps
    assert got == pytest.approx(measured, rel=0.15), (cid, got)


def test_mapped_splits_come_static_and_adaptive_and_both_are_raced(moe: ModelInfo) -> None:
    """Patch 0007's adaptive cache is enumerated beside the static hot set of every mapped split (only there),
    priced by its read-backs alone (its gain depends on the routing's locality, which the trace does not show),
    and prune keeps the best adaptive candidate among the finalists so that measurement chooses."""
    space = _space(moe, skewed(moe), 0.3)
    adaptive = [c for c in space.candidates if c.params.expert_cache == "adaptive"]
    assert adaptive and all(c.params.expert_mapped for c in adaptive)
    assert all(c.params.environment()["FLUX_MOE_CACHE"] == "adaptive" for c in adaptive)
    assert "FLUX_MOE_CACHE" not in next(c for c in space.candidates if c.params.expert_mapped
                                        and c.params.expert_cache == "static").params.environment()
    hw = h200_report(1)
    a = adaptive[0]
    s = next(c for c in space.candidates if c.params == a.params.model_copy(update={"expert_cache": "static"}))
    slower_ms = 1e3 / predict(moe, hw, a, CHAT).decode_tps - 1e3 / predict(moe, hw, s, CHAT).decode_tps
    # (scaled like the whole step when the candidate's flash attention differs from the probe's: x0.85 or /0.85)
    assert slower_ms == pytest.approx(len(a.params.expert_split.layers) * CACHE_READ_MS,  # type: ignore[union-attr]
                                      rel=0.18)
    fin = prune(space, moe, hw, WORK, 8)
    assert any(c.params.expert_cache == "adaptive" for c in fin.finalists)
    # a mapped best gets no thread sibling (its decode runs no host work), and when the budget measures three,
    # the adaptive cache is one of them: a family of its own in the measuring order, not a variant of the static
    best = fin.finalists[0]
    second = fin.finalists[1]
    assert best.params.expert_mapped and not (
        second.placement == best.placement and second.params.n_threads != best.params.n_threads
        and second.params.model_dump(exclude={"n_threads", "n_threads_batch"})
        == best.params.model_dump(exclude={"n_threads", "n_threads_batch"}))
    first3 = wl.diverse_order(fin).finalists[:3]
    assert any(c.params.expert_cache == "adaptive" for c in first3), [c.family for c in first3]
    with pytest.raises(ValidationError, match="need expert_split"):
        EngineParams(expert_cache="adaptive")


@pytest.mark.parametrize(("recorded", "cid", "measured"), [
    ("qwen3-30b-a3b-skewed-12-chat-run13", "c248", 684.8), ("qwen3-30b-a3b-skewed-8-chat-run13", "c228", 657.0),
    ("qwen3-30b-a3b-uniform-10-chat-run13", "c248", 617.9), ("qwen3-30b-a3b-skewed-10-chat-run16", "c208", 680.9),
    ("qwen3.6-35b-a3b-skewed-12-chat-run17", "c202", 551.7),
])
def test_a_mapped_splits_prefill_reads_the_expert_tensors_once_per_micro_batch(recorded: str, cid: str,
                                                                               measured: float) -> None:
    """Runs 13-17 on the H200 (`--workload chat`): a mapped split's prefill (a batch of 32 tokens or more takes
    the stock path, whose kernels read the whole expert tensors in pinned host memory over the bus) measured at
    the prompt's own batch, not the micro-batch: 256-token prompts at a 512-token micro-batch prefilled at
    618-685 tok/s, where a copy spread over 512 tokens had predicted 890."""
    import json

    from tasks.workload import workload

    info, hw, cands = _recorded(f"memory-{recorded}")
    doc = json.loads((Path(__file__).parent / "data" / "h200_memory" / f"memory-{recorded}.json").read_text())
    lengths = next(f["prompt_tokens"] for f in doc["finalists"] if f["candidate"]["id"] == cid)
    assert cands[cid].params.expert_mapped
    got = predict(info, hw, cands[cid], workload(lengths, 256)).prefill_tps
    assert got == pytest.approx(measured, rel=0.15)


@pytest.mark.parametrize(("recorded", "cid", "measured"), [
    ("qwen3.6-35b-a3b-skewed-12-ctx262144-chat-run18", "c084", 96.5),
    ("qwen3.6-35b-a3b-skewed-12-ctx262144-chat-run18", "c085", 102.1),
    ("qwen3-30b-a3b-skewed-12-spec-run18", "c207", 265.5),
])
def test_a_mapped_split_on_the_files_pages_prefills_at_the_probes_offload_rate(recorded: str, cid: str,
                                                                               measured: float) -> None:
    """Run 18 on the H200: mapped splits left on the file's pages (`load_mode` mmap) prefilled at 97-265 tok/s
    where the pinned path predicted 377-1,335. Their prefill takes the stock path, which copies the whole expert
    tensors from pageable memory each micro-batch: at the rate the probe's offloading load ran at (its read-out,
    GpuMemoryFit.step_ms_by_load), 10-11 GB/s there. The same split loaded into pinned memory keeps the pinned
    prediction, so prune now ranks it first (both were predicted alike, and the file's pages won the tie)."""
    import json

    from tasks.workload import workload

    info, hw, cands = _recorded(f"memory-{recorded}")
    doc = json.loads((Path(__file__).parent / "data" / "h200_memory" / f"memory-{recorded}.json").read_text())
    f = next(f for f in doc["finalists"] if f["candidate"]["id"] == cid)
    work = workload(f["prompt_tokens"], f["n_gen"])
    cand = cands[cid]
    assert cand.params.expert_mapped and cand.params.load_mode == "mmap"
    got = predict(info, hw, cand, work)
    assert got.prefill_tps == pytest.approx(measured, rel=0.2)
    pinned = cand.model_copy(update={"params": cand.params.model_copy(update={"load_mode": "load"})})
    assert predict(info, hw, pinned, work).prefill_tps > 3 * got.prefill_tps
    assert predict(info, hw, pinned, work).score_s < got.score_s


@pytest.mark.parametrize(("recorded", "cid", "seconds"), [
    ("qwen3.6-35b-a3b-skewed-12-ctx262144-chat-run18", "c084", 58.0),
    ("qwen3-30b-a3b-skewed-12-spec-run18", "c207", 139.0),
    ("qwen3-30b-a3b-skewed-12-spec-run18", "c165", 26.5),
    ("qwen3.6-35b-a3b-skewed-12-chat-run17", "c202", 34.4),
])
def test_a_first_visit_is_predicted_with_its_splits_expert_copies(recorded: str, cid: str, seconds: float) -> None:
    """The measure stage's visits on the H200 (plan logs of runs 17-18: a finalist's first visit, from its start
    to the next's): a split's load copies each hot expert on its own, slowly from the file's pageable pages. Without
    that term the mapped splits' visits were predicted 19-36% short (run 18: "visits took 3.2-3.3x their
    predicted time" with the old prefill too, and the budget cut their second rounds). Scored: the validation
    prompts' tokens (10 prompts of up to 256 tokens, 32 more each: 2,752)."""
    import json

    from tasks.workload import load_rates, visit_seconds, workload

    info, hw, cands = _recorded(f"memory-{recorded}")
    doc = json.loads((Path(__file__).parent / "data" / "h200_memory" / f"memory-{recorded}.json").read_text())
    f = next(f for f in doc["finalists"] if f["candidate"]["id"] == cid)
    pred = predict(info, hw, cands[cid], workload(f["prompt_tokens"], f["n_gen"]))
    got = visit_seconds(cands[cid], pred, f["prompt_tokens"], f["n_gen"], load_rates(hw, info.file_bytes), 2752)
    assert got == pytest.approx(seconds, rel=0.25)
