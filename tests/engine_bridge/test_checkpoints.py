"""A hybrid model (the tiny qwen3next twin: three gated delta-net layers, one attention layer) in the serving
engine: its recurrent state cannot be cut back, so the same prompt again, or a turn that re-sends the
conversation with the last reply re-templated, diverges inside the cached tokens. The engine rewinds to a
checkpoint of the recurrent state (before the last prompt's last token, or every INTERVAL prompt tokens) and
prefills only from there; the reply is the one a
cold engine gives after prefilling the whole prompt. The twin's greedy tokens hang mostly on the last token, so the
replies are compared by their tokens' log-probabilities, which a wrong recurrent state moves measurably."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifacts.engine_params import EngineParams
from artifacts.synth import synthesize
from tests.engine_bridge.sinks import Recorder, gen_args

llama_cpp = pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")

from engine_bridge.worker import checkpoints  # noqa: E402
from engine_bridge.worker.serving import ServeEngine  # noqa: E402

PARAMS = EngineParams(n_ctx=4096, n_seq_max=1, n_batch=256, n_ubatch=128, n_threads=1, n_threads_batch=1)


@pytest.fixture(scope="module")
def hybrid(models_dir: Path) -> Path:
    """tiny-qwen3next whose layer outputs matter more (as test_swa's twin): its context moves the next token."""
    path = models_dir / "tiny-qwen3next-attn.gguf"
    if not path.exists():
        synthesize("tiny-qwen3next", path, quant="Q4_0", overrides={"attn_out_std": "0.1"})
    return path


def _engine(model: Path, park_bytes: int = 64 << 20) -> tuple[ServeEngine, Recorder]:
    rec = Recorder()
    return ServeEngine(model, PARAMS, park_bytes, rec), rec


def _run(engine: ServeEngine, key: int, prompt: list[int], n: int = 8) -> None:
    engine.submit(key, gen_args(f"r{key}", prompt, n, logprobs=True))
    while engine.has_work():
        engine.step()


def _cold(model: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    """The greedy reply of a fresh engine, which prefills the whole prompt, and its tokens' log-probabilities."""
    engine, rec = _engine(model)
    _run(engine, 1, prompt)
    engine.close()
    assert rec.results[1]["cached_tokens"] == 0
    return rec.tokens[1], rec.logprobs[1]


def _same(rec: Recorder, key: int, cold: tuple[list[int], list[float]]) -> None:
    """Request ``key``'s reply is the cold engine's: the same tokens, the same log-probabilities (to 1e-3)."""
    assert rec.tokens[key] == cold[0]
    assert rec.logprobs[key] == pytest.approx(cold[1], abs=1e-3)


def _prompt(seed: int, n: int) -> list[int]:
    """``n`` token ids of the twin's 512-token vocabulary (none of its special tokens), varied by ``seed``."""
    return [16 + (seed * 131 + i * i * 7 + i * 13) % 480 for i in range(n)]


def test_a_retemplated_turn_rewinds_to_the_prompt_end(hybrid: Path) -> None:
    engine, rec = _engine(hybrid)
    assert engine.checkpoints is not None, "a hybrid model keeps checkpoints"
    p = _prompt(1, 600)
    _run(engine, 1, p)
    assert [c.n for c in engine.checkpoints.of(0)] == [len(p) - 1]
    _run(engine, 2, p)  # the same prompt again: its last token is computed again
    assert rec.results[2]["cached_tokens"] == len(p) - 1
    _same(rec, 2, (rec.tokens[1], rec.logprobs[1]))
    # the next turn re-sends the conversation with the reply re-templated (other tokens), then the user's turn
    turn = p + _prompt(2, 12) + _prompt(3, 8)
    _run(engine, 3, turn)
    assert rec.results[3]["cached_tokens"] == len(p) - 1, "the prompt was reused up to the reply that changed"
    stats = engine.stats()
    assert stats["checkpoint_restores"] == 2 and stats["checkpoint_tokens_reused"] == 2 * (len(p) - 1)
    cold = _cold(hybrid, turn)
    _same(rec, 3, cold)
    other = _cold(hybrid, p + _prompt(4, 12) + _prompt(3, 8))[1]  # the state after another reply
    assert max(abs(a - b) for a, b in zip(cold[1], other, strict=True)) > 1e-2, "the comparison has power"
    engine.close()


def test_a_divergence_inside_a_long_prompt_uses_the_interval_checkpoint(hybrid: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoints, "INTERVAL", 256)
    engine, rec = _engine(hybrid)
    p = _prompt(5, 900)
    _run(engine, 1, p)
    assert engine.checkpoints is not None
    assert [c.n for c in engine.checkpoints.of(0)] == [256, 512, 768, 899]  # chunks of n_batch 256
    turn = p[:700] + _prompt(6, 50)  # diverges at 700: the checkpoint at 512 serves
    _run(engine, 2, turn)
    assert rec.results[2]["cached_tokens"] == 512
    assert [c.n for c in engine.checkpoints.of(0)] == [256, 512, 749], "those past the cut are forgotten"
    _same(rec, 2, _cold(hybrid, turn))
    engine.close()


def test_checkpoints_that_do_not_fit_are_dropped_oldest_first(hybrid: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(checkpoints, "INTERVAL", 256)
    sizer, _ = _engine(hybrid)
    _run(sizer, 1, _prompt(9, 40))
    assert sizer.checkpoints is not None
    one = sizer.checkpoints.of(0)[0].nbytes  # a sequence's recurrent state: the same size at any length
    sizer.close()
    engine, rec = _engine(hybrid)
    assert engine.checkpoints is not None
    engine.checkpoints.limit = 2 * one + one // 2  # room for two
    p = _prompt(7, 900)
    with caplog.at_level("INFO", logger="engine_bridge.worker.checkpoints"):
        _run(engine, 1, p)
    assert [c.n for c in engine.checkpoints.of(0)] == [768, 899]
    assert engine.stats()["checkpoints_dropped"] == 2
    assert sum("dropped the recurrent checkpoint" in r.getMessage() for r in caplog.records) == 2
    turn = p[:600] + _prompt(8, 30)  # no checkpoint at or before 600 is left: prefilled whole, still right
    _run(engine, 2, turn)
    assert rec.results[2]["cached_tokens"] == 0
    _same(rec, 2, _cold(hybrid, turn))
    engine.close()


def test_a_dense_attention_model_keeps_no_checkpoints(tiny_moe: Path) -> None:
    engine, _ = _engine(tiny_moe)
    assert engine.checkpoints is None
    assert "checkpoint_restores" not in engine.stats()
    engine.close()
