"""A plan's notes say why it does not run on the engine `--prefer-engine` asked for."""

from __future__ import annotations

from artifacts.engine_params import EngineParams
from artifacts.records.evidence import MeasureResults, MeasureSummary, ValidationReport, ValidationResult
from artifacts.records.search import Candidate, Finalists, Placement, PlacementSpace
from tasks.recording.record import plan_notes


def _cand(cid: str, engine: str = "native") -> Candidate:
    return Candidate(id=cid, family="cpu", placement=Placement(layer_device=["CPU"]), engine=engine,
                     params=EngineParams(n_ctx=512), weights_bytes={}, kv_bytes={}, compute_bytes={})


def _notes(summaries: list[MeasureSummary], results: list[ValidationResult], prefer: str | None) -> list[str]:
    cands = [_cand("c1"), _cand("c1@llama-server", "llama-server"), _cand("c2@llama-server", "llama-server")]
    space = PlacementSpace(candidates=cands, rejected={}, memory_limits={}, n_ctx=512, n_seq=1)
    fin = Finalists.model_construct(finalists=cands, predictions=[], workload_prefill_tokens=0, workload_decode_tokens=0,
                                    n_ranked=3)
    measured = MeasureResults(summaries=summaries, trials_table="t", budget_s=60, spent_s=50, stopped_by_budget=False)
    report = ValidationReport.model_construct(results=results, winner_id="c1", quality_profile="reference",
                                              reference=EngineParams())
    return plan_notes(space, fin, measured, report, prefer)


def _ok(cid: str) -> MeasureSummary:
    return MeasureSummary(candidate_id=cid, prefill_tps=100.0, decode_tps=10.0, workload_s=1.0, n_trials=4, n_rounds=2)


def test_a_preferred_engine_that_could_not_serve_is_named_with_what_became_of_each_finalist() -> None:
    summaries = [_ok("c1"), _ok("c1@llama-server"),
                 MeasureSummary(candidate_id="c2@llama-server", prefill_tps=None, decode_tps=None, workload_s=None,
                                error="engine_error: llama-server did not start", n_trials=0)]
    results = [ValidationResult(candidate_id="c1@llama-server", mean_kl=0.5, max_kl=1.0, top1_agreement=0.5,
                                n_tokens=320, passed=False, reason="mean KL 5.00e-01 > 1.00e-04"),
               ValidationResult(candidate_id="c1", mean_kl=0.0, max_kl=0.0, top1_agreement=1.0, n_tokens=320,
                                passed=True)]
    notes = _notes(summaries, results, "llama-server")
    want = ("--prefer-engine llama-server: no finalist on llama-server was measured and passed the quality gate "
            "(c1@llama-server: failed validation: mean KL 5.00e-01 > 1.00e-04; c2@llama-server: engine_error: "
            "llama-server did not start), so the plan runs on native")
    assert want in notes, notes
    assert not any(n.startswith("--prefer-engine") for n in _notes(summaries, results, None))


def test_the_flags_a_plan_shows_are_llama_servers_for_its_slots() -> None:
    """`flux show` prints flags a user can give llama-server: -c is the whole context, split among -np slots."""
    p = EngineParams(n_ctx=1024, n_seq_max=4, n_batch=512, n_ubatch=128)
    args = p.server_args()
    assert args[args.index("-c") + 1] == "4096" and args[-2:] == ["-np", "4"]
    assert p.cli_args()[p.cli_args().index("-c") + 1] == "1024"
