"""Draft twins: a target's first layers, head and tokenizer, loaded by llama.cpp, with their agreement measured."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader

from artifacts.synth import synthesize
from artifacts.synth.draft import draft_twin
from tasks.measurement.draft import agreement, runs


def test_a_draft_is_the_targets_first_layers_with_its_tokenizer(tiny_moe: Path, tmp_path: Path) -> None:
    res = draft_twin(tiny_moe, tmp_path / "d.gguf", 1)
    target, draft = GGUFReader(tiny_moe), GGUFReader(res.path)
    assert (res.target_layers, res.n_layer) == (4, 1) and int(draft.fields["qwen3moe.block_count"].contents()) == 1
    assert draft.fields["tokenizer.ggml.tokens"].contents() == target.fields["tokenizer.ggml.tokens"].contents()
    names = {t.name for t in draft.tensors}
    assert "blk.0.ffn_up_exps.weight" in names and not any(n.startswith("blk.1.") for n in names)
    same = {t.name: bytes(t.data) for t in target.tensors if t.name in names}
    assert all(bytes(t.data) == same[t.name] for t in draft.tensors), "the draft's tensors are the target's bytes"


def test_the_agreement_is_measured_in_real_workers(tiny_moe: Path, tmp_path: Path) -> None:
    draft = draft_twin(tiny_moe, tmp_path / "d.gguf", 2).path
    got = agreement(tiny_moe, draft, n_tokens=8, n_ctx=512, log_path=tmp_path / "w.log")
    assert got.positions == 8 * got.prompts and 0.0 < got.acceptance <= 1.0 and got.mean_run > 0
    same = agreement(tiny_moe, tiny_moe, n_tokens=8, n_ctx=512, log_path=tmp_path / "w.log")
    assert same.acceptance == 1.0, "a model drafting for itself is always accepted"


def test_runs_of_accepted_tokens() -> None:
    import numpy as np

    assert runs(np.array([True, True, False, True, False, False])) == [2, 1, 0, 0]
    assert runs(np.array([True, True])) == [2]


@pytest.mark.parametrize("n", [0, 4, 9])
def test_a_draft_takes_fewer_layers_than_its_target(tiny_moe: Path, tmp_path: Path, n: int) -> None:
    with pytest.raises(ValueError, match="takes 1 to 3 of its 4 layers"):
        draft_twin(tiny_moe, tmp_path / "d.gguf", n)


def test_a_hybrid_draft_keeps_a_full_attention_layer(tmp_path: Path) -> None:
    hybrid = synthesize("tiny-qwen3next", tmp_path / "h.gguf", quant="Q4_0").path
    with pytest.raises(ValueError, match="full-attention layer every 4 layers"):
        draft_twin(hybrid, tmp_path / "d.gguf", 2)


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        draft_twin(bad, tmp_path / "d.gguf", 1)


def test_a_layer_skipping_draft_keeps_the_targets_last_layers_renumbered(tiny_moe: Path, tmp_path: Path) -> None:
    """`flux synth --draft-of T --layers 2 --last 1`: the target's layer 0 and its last layer (3), as the draft's
    layers 0 and 1, which llama.cpp loads and which drafts tokens the agreement can measure."""
    res = draft_twin(tiny_moe, tmp_path / "d.gguf", 2, last=1)
    target, draft = GGUFReader(tiny_moe), GGUFReader(res.path)
    assert int(draft.fields["qwen3moe.block_count"].contents()) == 2
    assert int(draft.fields["flux.draft.last_layers"].contents()) == 1
    theirs = {t.name: bytes(t.data) for t in target.tensors}
    ours = {t.name: bytes(t.data) for t in draft.tensors}
    assert ours["blk.0.ffn_up_exps.weight"] == theirs["blk.0.ffn_up_exps.weight"]
    assert ours["blk.1.ffn_up_exps.weight"] == theirs["blk.3.ffn_up_exps.weight"], "the last layer, renumbered"
    assert ours["blk.1.attn_q.weight"] == theirs["blk.3.attn_q.weight"]
    assert not any(n.startswith(("blk.2.", "blk.3.")) for n in ours)
    got = agreement(tiny_moe, res.path, n_tokens=8, n_ctx=512, log_path=tmp_path / "w.log")
    assert got.positions == 8 * got.prompts and 0.0 <= got.acceptance <= 1.0


@pytest.mark.parametrize(("n", "last", "says"), [(2, 3, "keeps 0 to 2 of the model's last layers"),
                                                 (2, -1, "keeps 0 to 2 of the model's last layers")])
def test_a_draft_keeps_no_more_last_layers_than_it_has(tiny_moe: Path, tmp_path: Path, n: int, last: int,
                                                       says: str) -> None:
    with pytest.raises(ValueError, match=says):
        draft_twin(tiny_moe, tmp_path / "d.gguf", n, last=last)


def test_a_hybrid_draft_keeps_its_last_layers_in_whole_periods(tmp_path: Path) -> None:
    """A qwen3next layer's kind follows its index (every 4th full attention): its last layers come in fours."""
    hybrid = synthesize("tiny-qwen3next", tmp_path / "h.gguf", quant="Q4_0", overrides={"n_layer": 8}).path
    with pytest.raises(ValueError, match="whole periods of 4, not 1"):
        draft_twin(hybrid, tmp_path / "d.gguf", 4, last=1)
    assert draft_twin(hybrid, tmp_path / "d.gguf", 4, last=4).n_layer == 4
