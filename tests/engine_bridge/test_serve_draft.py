"""Drafting in the serving engine, in-process on twins: greedy requests decoded with a draft twin or with prompt
lookup give the tokens (and logprobs) plain decoding gives, several at once and one alone; proposals are
accepted; sampled and penalized requests are not drafted; a draft of another vocabulary is refused at load.

Flash attention on: the verification evaluates k+1 tokens of a sequence at once, and without flash attention
the CPU's repacked Q4_0 path rounds such a batch differently from one token, which flips this twin's near-ties
(logprob gaps under 0.004, docs/speculation.md); with it (or without repacking) the two agree token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_batch import PARAMS as BATCH_PARAMS
from test_batch import Recorder, ctx_model, text  # noqa: F401  (the fixture)

from artifacts.drafting import Drafting, ngram_proposals
from artifacts.synth import synthesize
from artifacts.synth.draft import draft_twin
from engine_bridge.errors import EngineError
from engine_bridge.worker.serving import ServeEngine
from tests.engine_bridge.sinks import WHOLE_VOCABULARY, gen_args

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
PARAMS = BATCH_PARAMS.model_copy(update={"flash_attn": True})


@pytest.fixture(scope="module")
def draft_of(ctx_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    return draft_twin(ctx_model, tmp_path_factory.mktemp("draft") / "d.gguf", 1).path


def _run_all(model: Path, drafting: Drafting | None, prompts: list[list[int]], n: int = 40,
             **kw: Any) -> tuple[ServeEngine, Recorder]:
    rec = Recorder()
    engine = ServeEngine(model, PARAMS, 0, rec, drafting)
    for i, p in enumerate(prompts):
        engine.submit(i, gen_args(f"r{i}", p, n, **kw))
    while engine.has_work():
        engine.step()
    return engine, rec


@pytest.mark.parametrize("kind", ["model", "ngram"])
def test_drafted_greedy_serving_is_plain_greedy(ctx_model: Path, draft_of: Path, kind: str) -> None:  # noqa: F811
    plain, prec = _run_all(ctx_model, None, [])
    prompts = [plain.vocab.tokenize(text(i, 12 + 9 * i)) for i in range(3)]
    prompts.append(prompts[0][:20] * 3)  # a prompt that repeats itself: prompt lookup finds it
    plain.close()
    plain, prec = _run_all(ctx_model, None, prompts, logprobs=True, top_logprobs=2)
    drafting = Drafting(kind=kind, model=str(draft_of) if kind == "model" else None, n_draft=4, ngram=3)  # type: ignore[arg-type]
    fast, frec = _run_all(ctx_model, drafting, prompts, logprobs=True, top_logprobs=2)
    for i in range(len(prompts)):
        assert frec.tokens(i) == prec.tokens(i), i
        assert [e["logprob"] for e in frec.events[i]] == pytest.approx([e["logprob"] for e in prec.events[i]], abs=1e-3)
        assert frec.results[i]["finish_reason"] == prec.results[i]["finish_reason"]
    stats = fast.stats()
    assert stats["drafted"] > 0 and 0 < stats["draft_accepted"] <= stats["drafted"], stats
    assert stats["steps"] < plain.stats()["steps"], "accepted proposals save steps"
    solo, srec = _run_all(ctx_model, None, prompts[1:2], n=33)
    alone, arec = _run_all(ctx_model, drafting, prompts[1:2], n=33)  # a draft cut short by max_tokens
    assert arec.tokens(0) == srec.tokens(0) and arec.results[0]["completion_tokens"] == 33
    for e in (plain, fast, solo, alone):
        e.close()


def test_sampled_and_grammar_requests_are_not_drafted(ctx_model: Path, draft_of: Path) -> None:  # noqa: F811
    rec = Recorder()
    engine = ServeEngine(ctx_model, PARAMS, 0, rec, Drafting(kind="model", model=str(draft_of)))
    p = engine.vocab.tokenize(text(3, 20))
    engine.submit(1, gen_args("a", p, 16, temperature=0.8, seed=3, **WHOLE_VOCABULARY))
    engine.submit(2, gen_args("b", p, 16, presence_penalty=0.5))
    while engine.has_work():
        engine.step()
    assert len(rec.tokens(1)) == len(rec.tokens(2)) == 16 and engine.stats()["drafted"] == 0
    engine.close()


def test_a_draft_of_another_vocabulary_is_refused_at_load(ctx_model: Path, tmp_path: Path) -> None:  # noqa: F811
    other = synthesize("tiny-dense", tmp_path / "o.gguf", quant="Q4_0", overrides={"n_vocab": "640"}).path
    with pytest.raises(EngineError, match="must share the model's tokenizer"):
        ServeEngine(ctx_model, PARAMS, 0, Recorder(), Drafting(kind="model", model=str(other)))


def test_prompt_lookup_proposes_what_followed_the_last_match() -> None:
    assert ngram_proposals([1, 2, 3, 9, 8, 1, 2, 3], 3, 2) == [9, 8]
    assert ngram_proposals([5, 1, 2, 7, 1, 2, 6, 6, 1, 2], 3, 4) == [6, 6, 1, 2]  # the latest match, 2 tokens
    assert ngram_proposals([1, 2, 3, 4], 3, 4) == [] and ngram_proposals([7], 3, 4) == []
    assert ngram_proposals([4, 4, 4], 2, 3) == [4]
