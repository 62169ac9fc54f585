"""The validate stage with real workers: the fastest finalist that matches the reference wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifacts.engine_params import EngineParams, TensorOverride
from artifacts.records.evidence import MeasureSummary
from artifacts.records.search import Candidate, Placement
from engine_bridge.errors import EngineError
from tasks.cores import CoreShare
from tasks.quality_gate import Gate
from tasks.validation.gate import Cache, rank_measured, reference_params, validate
from tasks.workload import validation_prompts

PARAMS = EngineParams(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=1, n_threads_batch=1)
# A device this machine does not have: the worker cannot load the finalist (as a broken GPU placement).
BROKEN = PARAMS.model_copy(update={"tensor_overrides": (TensorOverride(pattern=r"^blk\.0\.", device="CUDA7"),)})


def cand(cid: str, params: EngineParams) -> Candidate:
    return Candidate(id=cid, family="test", placement=Placement(layer_device=["CPU"]), params=params,
                     weights_bytes={}, kv_bytes={}, compute_bytes={})


def summary(cid: str, workload_s: float) -> MeasureSummary:
    return MeasureSummary(candidate_id=cid, prefill_tps=100.0, decode_tps=10.0, workload_s=workload_s, n_trials=1)


def run(ranked: list[Candidate], tiny_moe: Path, tmp_path: Path, **kw):  # type: ignore[no-untyped-def]
    seqs, held = validation_prompts(tiny_moe, 256, 8, 0, tmp_path / "w.log")
    return validate(ranked, tiny_moe, seqs[:3], held[:1], n_tokens=8, gate=Gate(max_kl=0.01, min_top1=0.9),
                    quality_profile="reference", log_path=tmp_path / "w.log", timeout_s=120,
                    reference=reference_params(256, 1), **kw)


def test_when_the_two_fastest_fail_the_next_that_matches_wins(tiny_moe: Path, tmp_path: Path) -> None:
    report = run([cand("fast", BROKEN), cand("second", BROKEN), cand("third", PARAMS), cand("fourth", PARAMS)],
                 tiny_moe, tmp_path)
    assert report.winner_id == "third"
    assert [r.candidate_id for r in report.results] == ["fast", "second", "third"], "no finalist after the winner"
    assert [r.passed for r in report.results] == [False, False, True]


def test_the_two_fastest_are_always_both_checked(tiny_moe: Path, tmp_path: Path) -> None:
    report = run([cand("a", PARAMS), cand("b", PARAMS), cand("c", PARAMS)], tiny_moe, tmp_path)
    assert report.winner_id == "a" and [r.candidate_id for r in report.results] == ["a", "b"]


def test_none_matching_is_one_clear_error(tiny_moe: Path, tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="none of the 3 measured finalists matches"):
        run([cand("x", BROKEN), cand("y", BROKEN), cand("z", BROKEN)], tiny_moe, tmp_path)


def test_the_reference_and_the_noise_floor_are_computed_once(tiny_moe: Path, tmp_path: Path) -> None:
    cache = Cache(tmp_path / "cache", "ref-key", "floor-key")
    fa = ("flash attention", reference_params(256, 1).model_copy(update={"flash_attn": True}))
    plain = PARAMS.model_copy(update={"repack": False})  # the reference's kernels: the same outputs
    first = run([cand("a", plain)], tiny_moe, tmp_path, floor_variants=[fa], cache=cache)
    assert cache.reference().exists() and cache.floor().exists()
    assert [f.name for f in first.floor] == ["flash attention"] and first.floor[0].stats.n > 0
    before = (cache.reference().stat().st_mtime_ns, cache.floor().stat().st_mtime_ns)
    again = run([cand("a", plain)], tiny_moe, tmp_path, floor_variants=[fa], cache=cache)
    assert (cache.reference().stat().st_mtime_ns, cache.floor().stat().st_mtime_ns) == before
    assert again.floor == first.floor and again.results[0].mean_kl == first.results[0].mean_kl
    assert first.results[0].mean_kl == 0.0 and first.kl_limit == Gate().min_kl, "a tiny floor: the limit is min_kl"


def _fin(cid: str, n_ctx: int) -> Candidate:
    return cand(cid, PARAMS.model_copy(update={"n_ctx": n_ctx}))


def test_a_shorter_context_must_be_clearly_faster_to_rank_first() -> None:
    fins = [_fin("full", 4096), _fin("short", 2048), _fin("broken", 4096)]
    close = [summary("full", 1.00), summary("short", 0.97), MeasureSummary(
        candidate_id="broken", prefill_tps=None, decode_tps=None, workload_s=None, n_trials=0, error="x")]
    assert [s.candidate_id for s in rank_measured(close, fins)] == ["full", "short"]
    clear = [summary("full", 1.00), summary("short", 0.90)]
    assert [s.candidate_id for s in rank_measured(clear, fins)] == ["short", "full"]


def test_a_whole_gpu_floor_variant_runs_beside_the_host_ones(tiny_moe: Path, tmp_path: Path) -> None:
    """The floor's lanes: a variant holding every layer on a GPU (here the CPU build computes it on the host,
    which is the same code path on the Python side) runs beside the host variants, the results keep the
    variants' order and equal the sequential ones, and a variant that cannot run is left out in its lane."""
    from tasks.validation.gate import floor_results, reference_continuations

    seqs, _ = validation_prompts(tiny_moe, 256, 8, 0, tmp_path / "w.log")
    seqs_, ref = reference_continuations(tiny_moe, reference_params(256, 1), seqs[:2], 8, tmp_path / "w.log", 120,
                                         None)
    fa = reference_params(256, 1).model_copy(update={"flash_attn": True})
    gpu = fa.model_copy(update={"n_gpu_layers": -1, "n_ubatch": 32, "n_batch": 32})
    variants = [("gpu", gpu), ("fa", fa), ("broken", BROKEN), ("plain", reference_params(256, 1))]
    notes: list[str] = []
    both = floor_results(tiny_moe, variants, seqs_, ref, tmp_path / "w.log", 120, None, notes.append)
    assert [f.name for f in both] == ["gpu", "fa", "plain"]
    assert any("broken: not measured" in n for n in notes)
    alone = floor_results(tiny_moe, [("fa", fa)], seqs_, ref, tmp_path / "w.log", 120, None, notes.append)
    assert both[1].stats == alone[0].stats and both[2].stats.mean_kl == 0.0 and both[0].stats.n > 0
    # beside a routing trace the host lane's threads follow the shared cores: the same floor, the file gone after
    share = CoreShare()
    with share.busy("route", 2), share.busy("reference", 2):
        shared = floor_results(tiny_moe, variants, seqs_, ref, tmp_path / "w.log", 120, None, notes.append,
                               share.path)
    assert [f.stats for f in shared] == [f.stats for f in both] and not share.path.exists()
