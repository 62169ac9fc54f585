"""Real llama.cpp loads the synthetic twins, generates finite, peaked logits and chats (ChatML)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from artifacts.synth import QUANTS, Quant, synthesize

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
from llama_cpp import Llama  # noqa: E402  # after the skip: only a built backend has it


def _load(path: Path, logits_all: bool = False) -> Llama:
    return Llama(str(path), n_ctx=256, n_threads=2, verbose=False, logits_all=logits_all, seed=0)


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_every_quant_loads_and_generates(tmp_path: Path, preset: str, quant: Quant) -> None:
    llm = _load(synthesize(preset, tmp_path / "m.gguf", quant=quant).path)
    out = llm("The quick brown fox", max_tokens=4, temperature=0.0)
    assert isinstance(out, dict)  # not a stream
    assert out["usage"]["completion_tokens"] >= 1
    assert isinstance(out["choices"][0]["text"], str)
    assert llm.metadata["general.name"] == f"flux-synth-{preset}-{quant}"


@pytest.mark.parametrize("fixture", ["tiny_dense", "tiny_moe"])
def test_logits_are_finite_and_peaked(fixture: str, request: pytest.FixtureRequest) -> None:
    llm = _load(request.getfixturevalue(fixture), logits_all=True)
    tokens = llm.tokenize(b"Seven engineers argued about steel prices near the harbour.", add_bos=False)
    llm.eval(tokens)
    logits = np.asarray(llm.scores[: llm.n_tokens])
    assert np.isfinite(logits).all()
    # near-uniform logits would make KL between configs insensitive (notes/llama-cpp.md)
    assert 1.0 < float(logits.std(axis=1).mean()) < 20.0


@pytest.mark.parametrize("fixture", ["tiny_dense", "tiny_moe"])
def test_chat_completion_uses_chatml(fixture: str, request: pytest.FixtureRequest) -> None:
    llm = _load(request.getfixturevalue(fixture))
    assert llm.tokenize(b"<|im_start|>", add_bos=False, special=True) == [llm.n_vocab() - 2]
    reply = llm.create_chat_completion(
        messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=0.0
    )
    assert isinstance(reply, dict)  # not a stream
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
