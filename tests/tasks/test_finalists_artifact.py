"""The Prefect `finalists` artifact labels a CPU-only candidate as the CPU it runs on, not `gpu` / `gpu-host`."""

from __future__ import annotations

from artifacts.engine_params import EngineParams
from artifacts.records.search import Candidate, Finalists, Placement, Prediction
from tasks.search.prune import STAGE


def _cand(cid: str, params: EngineParams, where: str) -> Candidate:
    return Candidate(id=cid, family="f", placement=Placement(layer_device=[where] * 2), params=params,
                     weights_bytes={where: 1 << 20}, kv_bytes={where: 1 << 10}, compute_bytes={where: 1 << 10})


def test_cpu_candidates_are_labelled_cpu_and_gpu_ones_by_their_kv_and_host_weights() -> None:
    cands = [_cand("c0", EngineParams(), "CPU"), _cand("c1", EngineParams(repack=False), "CPU"),
             _cand("c2", EngineParams(n_gpu_layers=3), "CUDA0"),
             _cand("c3", EngineParams(n_gpu_layers=3, offload_kqv=False, no_host=True), "CUDA0")]
    fin = Finalists(finalists=cands, predictions=[Prediction(candidate_id=c.id, prefill_tps=1.0, decode_tps=1.0,
                                                             score_s=1.0) for c in cands],
                    workload_prefill_tokens=1, workload_decode_tokens=1, n_ranked=4)
    assert STAGE.artifact is not None
    table = STAGE.artifact(fin).table
    assert table is not None
    assert [(r["kv"], r["host"]) for r in table] == [("cpu", "repacked"), ("cpu", "plain"), ("gpu", "gpu-host"),
                                                    ("host", "repacked")]
