"""A draft model's memory in the plan's fit: counted on the placement's main GPU, and a drafting candidate whose
draft does not fit the GPU budget beside its placement is not measured (nor rebuilt by validate or persist)."""

from __future__ import annotations

from pathlib import Path

from artifacts.drafting import Drafting
from artifacts.engine_params import EngineParams
from artifacts.model_info import model_info
from artifacts.records.search import Candidate, Finalists, Placement, Prediction
from artifacts.synth.draft import draft_twin
from tasks.measurement.speculation import DRAFT_COMPUTE_BYTES, draft_bytes, with_drafting


def _fin(params: EngineParams) -> Finalists:
    c = Candidate(id="c0", family="all-gpu", placement=Placement(layer_device=["CUDA0"] * 4), params=params,
                  weights_bytes={"CUDA0": 10**9}, kv_bytes={"CUDA0": 10**8}, compute_bytes={})
    p = Prediction(candidate_id="c0", prefill_tps=1000.0, decode_tps=50.0, score_s=1.0)
    return Finalists(finalists=[c], predictions=[p], workload_prefill_tokens=1, workload_decode_tokens=1, n_ranked=1)


def test_a_draft_model_counts_on_the_main_gpu_and_is_left_out_when_it_does_not_fit(tiny_moe: Path,
                                                                                  tmp_path: Path) -> None:
    draft = draft_twin(tiny_moe, tmp_path / "d.gguf", 1).path
    on_gpu = EngineParams(n_ctx=1024, n_gpu_layers=999, flash_attn=True)
    d, lookup = Drafting(kind="model", model=str(draft)), Drafting(kind="ngram")
    info = model_info(draft)
    need = draft_bytes(d, on_gpu)
    assert need == info.file_bytes + info.kv_bytes_per_token["f16"] * 1024 + DRAFT_COMPUTE_BYTES
    assert draft_bytes(lookup, on_gpu) == 0 and draft_bytes(d, on_gpu.model_copy(update={"n_gpu_layers": 0})) == 0

    roomy = with_drafting(_fin(on_gpu), (d, lookup), lambda c: {"CUDA0": need + 1})
    assert [c.id for c in roomy.finalists] == ["c0", "c0+draft", "c0+ngram"]
    assert roomy.finalists[1].weights_bytes["CUDA0"] == 10**9 + need, "the draft's bytes are in the fit"
    assert roomy.finalists[2].weights_bytes == roomy.finalists[0].weights_bytes, "prompt lookup loads nothing"
    assert len(roomy.predictions) == 3

    tight = with_drafting(_fin(on_gpu), (d, lookup), lambda c: {"CUDA0": need - 1})
    assert [c.id for c in tight.finalists] == ["c0", "c0+ngram"]
    assert [p.candidate_id for p in tight.predictions] == ["c0", "c0+ngram"]


def test_a_drafting_candidate_counts_only_when_it_drafted_and_beat_its_placement() -> None:
    """A CPU plan (tinyllama twin, chat prompts that never repeat) chose prompt lookup at 4.73 s against its
    placement's 4.74 s: nothing was drafted, the tie was noise. Such a candidate, and one slower than its
    placement, leave the ranking before validation; one that drafted and won stays."""
    from artifacts.records.evidence import MeasureSummary
    from tasks.measurement.speculation import drafting_that_won

    def s(cid: str, w: float, drafted: int | None = None, accepted: int | None = None) -> MeasureSummary:
        return MeasureSummary(candidate_id=cid, prefill_tps=1.0, decode_tps=1.0, workload_s=w, n_trials=2,
                              drafted=drafted, accepted=accepted)

    got = drafting_that_won([s("c028", 4.74), s("c028+ngram", 4.73, 0, 0), s("c028+draft", 6.40, 88, 26),
                             s("c030", 4.78), s("c030+draft", 3.10, 90, 80)])
    assert [x.candidate_id for x in got] == ["c028", "c030", "c030+draft"]

    # given the trial rows, a drafting candidate faster by its median is kept only when every resample of its
    # paired rounds is faster: prompt lookup at 1.00x [0.97, 1.00] (a CPU plan) drafted, and won nothing
    def rows(cid: str, seconds: list[float]) -> list[dict[str, object]]:
        return [{"candidate_id": cid, "round": r, "prompt_ms": 1e3 * t, "gen_ms": 0.0, "error": None}
                for r, t in enumerate(seconds)]

    summaries = [s("c028", 4.74), s("c028+ngram", 4.70, 90, 90), s("c030", 4.78), s("c030+draft", 3.10, 90, 80)]
    trials = [*rows("c028", [4.74, 4.70, 4.80]), *rows("c028+ngram", [4.60, 4.70, 4.95]),
              *rows("c030", [4.78, 4.70, 4.90]), *rows("c030+draft", [3.10, 3.30, 3.00])]
    assert [x.candidate_id for x in drafting_that_won(summaries, trials)] == ["c028", "c030", "c030+draft"]
    assert [x.candidate_id for x in drafting_that_won(summaries)] == [x.candidate_id for x in summaries]


def test_a_lookup_that_proposed_nothing_says_so() -> None:
    """H200 run 22: prompt lookup on the 30B twin's agent prompts proposed no token in 3 rounds; the plan said
    "acceptance not measured" as if it had not been counted. It was counted: zero proposals."""
    from artifacts.records.evidence import MeasureSummary
    from artifacts.records.plan import Plan
    from flows.show import speculation_lines
    from tasks.measurement.speculation import draft_trials, speculation_notes

    fin = with_drafting(_fin(EngineParams(n_ctx=1024)), [Drafting(kind="ngram"), Drafting(kind="model", model="d")])
    sums = [MeasureSummary(candidate_id=c, prefill_tps=1.0, decode_tps=1.0, workload_s=w, n_trials=3, drafted=d,
                           accepted=a) for c, w, d, a in [("c0", 6.73, None, None), ("c0+ngram", 6.70, 0, 0),
                                                          ("c0+draft", 5.0, 40, 30)]]
    rows = [{"candidate_id": c, "round": r, "prompt_ms": 1e3 * w, "gen_ms": 0.0, "error": None}
            for c, w in [("c0", 6.73), ("c0+ngram", 6.70), ("c0+draft", 5.0)] for r in range(3)]
    trials = {t.candidate_id: t for t in draft_trials(fin.finalists, sums, rows)}
    assert trials["c0+ngram"].proposed == 0 and trials["c0+ngram"].acceptance is None
    assert trials["c0+draft"].proposed == 40 and trials["c0+draft"].acceptance == 0.75
    notes = speculation_notes(list(trials.values()), fin.finalists[0])
    assert any(n.startswith("speculation c0+ngram: no token proposed, 1.00x") for n in notes), notes
    assert any(n.startswith("speculation c0+draft: 75% of proposals kept, 1.35x") for n in notes), notes
    plan = Plan.model_construct(candidate=fin.finalists[0], speculation=list(trials.values()))
    lines = speculation_lines(plan)
    assert lines[0].startswith("speculation c0+ngram: no token proposed, speedup 1.00x"), lines
    assert lines[1].startswith("speculation c0+draft: acceptance 75%, speedup 1.35x"), lines


def test_next_token_heads_draft_on_llama_server_only(tmp_path: Path) -> None:
    """A model with a next-token (MTP) block gets an ``mtp`` drafting candidate when llama-server is among the
    engines (Flux's worker does not drive the pin's MTP context), on the best llama-server placement, its block's
    bytes counted on the placement's GPU."""
    from artifacts.records.plan import PlanRequest
    from artifacts.synth import synthesize
    from tasks.engines import on_engines
    from tasks.measurement.speculation import drafting_for, mtp_block_bytes, mtp_note

    model = synthesize("tiny-qwen35moe", tmp_path / "mtp.gguf", overrides={"n_mtp": "1"}).path
    info = model_info(model)
    both = PlanRequest(model=str(model), speculation=True, engines=["native", "llama-server"])
    def kinds(req: PlanRequest, n: int) -> list[str]:
        return [d.kind for d in drafting_for(req, None, n)]

    mtp = next(d for d in drafting_for(both, None, info.n_nextn_layers) if d.kind == "mtp")
    assert mtp.label == "mtp" and mtp.server_args() == ["--spec-type", "draft-mtp", "--spec-draft-n-max", "3"]
    assert "mtp" not in kinds(both.model_copy(update={"engines": ["native"]}), info.n_nextn_layers)
    assert "mtp" not in kinds(both, 0), "no block, no drafting with it"
    assert mtp_note(info.n_nextn_layers, ["native"]) and not mtp_note(info.n_nextn_layers, ["native", "llama-server"])
    block = mtp_block_bytes(model)
    assert 0 < block < info.file_bytes and mtp_block_bytes(synthesize("tiny-qwen35moe", tmp_path / "t.gguf").path) == 0
    from artifacts.engine_spec import EngineSpec

    engines = [EngineSpec(name="native", kind="native"), EngineSpec(name="llama-server", kind="llama-server")]
    on_gpu = EngineParams(n_ctx=512, n_gpu_layers=-1)
    fin = with_drafting(on_engines(_fin(on_gpu), engines), [mtp], None, str(model))
    ids = [c.id for c in fin.finalists]
    assert ids == ["c0", "c0@llama-server", "c0@llama-server+mtp"]
    drafted = fin.finalists[-1]
    assert drafted.engine == "llama-server" and drafted.draft == mtp
    assert drafted.weights_bytes["CUDA0"] == 10**9 + block + DRAFT_COMPUTE_BYTES


def test_llama_server_drafts_the_same_ways_as_the_worker(tiny_moe: Path, tmp_path: Path) -> None:
    """With llama-server among the engines, its best placement is measured with each way of drafting too (the
    pin's own drafters), each candidate right after its placement, the draft's bytes on its GPU."""
    from artifacts.engine_spec import EngineSpec
    from tasks.engines import on_engines

    draft = draft_twin(tiny_moe, tmp_path / "d.gguf", 1).path
    d, lookup = Drafting(kind="model", model=str(draft)), Drafting(kind="ngram")
    engines = [EngineSpec(name="native", kind="native"), EngineSpec(name="llama-server", kind="llama-server")]
    on_gpu = EngineParams(n_ctx=1024, n_gpu_layers=999, flash_attn=True)
    fin = with_drafting(on_engines(_fin(on_gpu), engines), (d, lookup))
    assert [c.id for c in fin.finalists] == ["c0", "c0+draft", "c0+ngram", "c0@llama-server",
                                             "c0@llama-server+draft", "c0@llama-server+ngram"]
    served = {c.id: c for c in fin.finalists}
    assert served["c0@llama-server+draft"].engine == "llama-server"
    assert served["c0@llama-server+draft"].weights_bytes["CUDA0"] == 10**9 + draft_bytes(d, on_gpu)
    assert [p.candidate_id for p in fin.predictions] == [c.id for c in fin.finalists]


def test_llama_server_takes_no_draft_file_beside_a_per_expert_split(tiny_moe: Path, tmp_path: Path) -> None:
    """The patched llama.cpp applies FLUX_MOE_SPLIT to every model its process loads: llama-server would refuse a
    draft model (or grafted heads) of other layers beside a split placement, so none is measured there; prompt
    lookup is, and Flux's worker, which loads a draft with its own environment, drafts with the file too."""
    from artifacts.engine_params import ExpertSplit
    from artifacts.engine_spec import EngineSpec
    from tasks.engines import on_engines

    draft = draft_twin(tiny_moe, tmp_path / "d.gguf", 1).path
    d, lookup = Drafting(kind="model", model=str(draft)), Drafting(kind="ngram")
    engines = [EngineSpec(name="native", kind="native"), EngineSpec(name="llama-server", kind="llama-server")]
    split = EngineParams(n_ctx=1024, n_gpu_layers=999, expert_split=ExpertSplit.on("CUDA0", {0: [1, 2]}))
    fin = with_drafting(on_engines(_fin(split), engines), (d, lookup))
    assert [c.id for c in fin.finalists] == ["c0", "c0+draft", "c0+ngram", "c0@llama-server", "c0@llama-server+ngram"]
