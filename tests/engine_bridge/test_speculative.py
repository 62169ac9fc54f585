"""Greedy speculative decoding in the worker, on twins: the output is the model's greedy output token for token,
with a draft twin that agrees often, with one that agrees less (a model's single layer), at several draft lengths;
acceptance is counted; bad drafts are refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifacts.engine_params import EngineParams
from artifacts.synth import synthesize
from artifacts.synth.draft import draft_twin
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.errors import EngineError

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")

PARAMS = EngineParams(n_ctx=512, n_batch=64, n_ubatch=64, n_threads=2, n_threads_batch=2)
PROMPTS = [list(range(3, 40)), [7, 300, 12, 99, 5, 5, 5, 18, 201, 77]]


@pytest.fixture(scope="module")
def drafts(tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    d = tmp_path_factory.mktemp("drafts")
    return {k: draft_twin(tiny_moe, d / f"d{k}.gguf", k).path for k in (1, 3)}


def test_drafted_greedy_output_is_the_models_greedy_output(tiny_moe: Path, drafts: dict[int, Path]) -> None:
    with WorkerClient() as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(tiny_moe), params=PARAMS))
        for prompt in PROMPTS:
            plain = w.request(ops.GREEDY, ops.GreedyArgs(prompt=prompt, n_gen=48, stop_eog=False)).tokens
            for layers, draft in drafts.items():
                for n_draft in (1, 4, 8):
                    got = w.request(ops.SPEC_GREEDY, ops.SpecGreedyArgs(prompt=prompt, n_gen=48, draft_model=str(draft),
                                                                        n_draft=n_draft))
                    assert got.tokens == plain, (layers, n_draft)
                    assert 0 <= got.accepted <= got.drafted and got.steps >= 1
                    # after the prefill's token, every step keeps its accepted proposals and one token of its own
                    assert got.accepted + got.steps >= 47 and got.steps <= 47


def test_a_model_drafting_for_itself_is_always_accepted(tiny_moe: Path) -> None:
    with WorkerClient() as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(tiny_moe), params=PARAMS))
        got = w.request(ops.SPEC_GREEDY, ops.SpecGreedyArgs(prompt=PROMPTS[0], n_gen=33, draft_model=str(tiny_moe),
                                                            n_draft=4))
    # 32 tokens after the prefill's: six steps of 4 accepted + 1, then one of 2 + 1
    assert got.accepted == got.drafted == 26 and got.steps == 7


def test_a_draft_of_another_vocabulary_or_missing_is_refused(tiny_moe: Path, tmp_path: Path) -> None:
    other = synthesize("tiny-dense", tmp_path / "o.gguf", quant="Q4_0", overrides={"n_vocab": "640"}).path
    with WorkerClient() as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(tiny_moe), params=PARAMS))
        with pytest.raises(EngineError, match="must share the model's tokenizer"):
            w.request(ops.SPEC_GREEDY, ops.SpecGreedyArgs(prompt=PROMPTS[0], n_gen=8, draft_model=str(other)))
        with pytest.raises(EngineError, match="is not a file") as err:
            w.request(ops.SPEC_GREEDY, ops.SpecGreedyArgs(prompt=PROMPTS[0], n_gen=8, draft_model=str(tmp_path / "x")))
        assert err.value.code == "model_missing"


def test_prompt_lookup_drafting_is_the_models_greedy_output(tiny_moe: Path) -> None:
    looped = PROMPTS[0][:12] * 3
    with WorkerClient() as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(tiny_moe), params=PARAMS))
        for prompt in (*PROMPTS, looped):
            plain = w.request(ops.GREEDY, ops.GreedyArgs(prompt=prompt, n_gen=40, stop_eog=False)).tokens
            for n in (2, 3):
                got = w.request(ops.SPEC_GREEDY, ops.SpecGreedyArgs(prompt=prompt, n_gen=40, ngram=n, n_draft=4))
                assert got.tokens == plain, (prompt[:4], n)
                assert got.accepted <= got.drafted and got.accepted + got.steps >= 39
        with pytest.raises(EngineError, match="give a draft_model or an ngram length"):
            w.request(ops.SPEC_GREEDY, ops.SpecGreedyArgs.model_construct(prompt=[1, 2], n_gen=4, draft_model=None,
                                                                          ngram=0, n_draft=4, stop_eog=False))


def test_verification_batches_run_on_the_decode_thread_count(tiny_moe: Path) -> None:
    """A plan with more batch threads than decode threads (-t 1 -tb 2) verified each draft, a small batch, on the
    batch count: the second thread's wake-up every step cost more than the draft won. The verifications now run
    on the decode count, the prompt on the batch count, and the context is given back as it was."""
    import llama_cpp

    from artifacts.drafting import draft_params
    from engine_bridge.worker.native import NativeModel
    from engine_bridge.worker.speculative import ModelDrafter, speculative_greedy

    m = NativeModel(tiny_moe, PARAMS.model_copy(update={"n_threads": 1, "n_threads_batch": 2}))
    d = NativeModel(tiny_moe, draft_params(m.params))  # the model drafting for itself: every proposal kept
    seen: list[tuple[int, int]] = []

    class Watching(ModelDrafter):
        def propose(self, history: list[int], pos: int, k: int) -> list[int]:
            seen.append((llama_cpp.llama_n_threads(m.ctx), llama_cpp.llama_n_threads_batch(m.ctx)))
            return super().propose(history, pos, k)

    try:
        plain = m.greedy(PROMPTS[0], 24, stop_eog=False)
        got = speculative_greedy(m, Watching(m, d), PROMPTS[0], 24, 4)
        assert got.tokens == plain and got.accepted == got.drafted > 0
        assert seen and set(seen) == {(1, 1)}
        assert (llama_cpp.llama_n_threads(m.ctx), llama_cpp.llama_n_threads_batch(m.ctx)) == (1, 2)
    finally:
        d.close()
        m.close()
