"""Per-expert placement on the hybrid families' MoE blocks: qwen3next and qwen35moe route 8 experts per layer
(2 used) beside a gated shared expert. Their tiny twins' experts are split between two host buffers (the hot
copies in the CPU's plain buffer), and the split model's logits and greedy tokens must be the unsplit model's;
the graph must take the split path on every listed layer. Real llama.cpp, no GPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from artifacts.engine_params import EngineParams, ExpertSplit
from artifacts.model_info import model_info
from artifacts.synth import synthesize
from engine_bridge.expert_split import check_expert_split

llama_cpp = pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")

from test_expert_split import SMALL_BATCHES, _outputs, _split_nodes  # noqa: E402

# Layer 1 has every expert hot; the others split 1 to 5 of the 8 experts.
SPLIT = ExpertSplit.on("CPU", {0: [1, 5], 1: list(range(8)), 2: [0, 2, 3, 7, 4], 3: [6]})
FAMILIES = ("tiny-qwen3next", "tiny-qwen35moe")


@pytest.fixture(scope="module", params=FAMILIES)
def twin(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(request.param, tmp_path_factory.mktemp("split") / "m.gguf", quant="Q4_0").path


@pytest.mark.parametrize("layout", ["repacked", "plain"])
def test_a_split_of_a_hybrid_family_gives_the_unsplit_logits(twin: Path, layout: str) -> None:
    check_expert_split(SPLIT, model_info(twin))  # the Python side accepts the family too
    ref, ref_tokens = _outputs(twin, EngineParams(**SMALL_BATCHES), layout)
    got, tokens = _outputs(twin, EngineParams(**SMALL_BATCHES, expert_split=SPLIT), layout)
    assert np.isfinite(ref).all() and ref.shape[0] > 0
    assert np.abs(got - ref).max() <= 1e-5
    assert tokens == ref_tokens


def test_every_listed_layer_of_a_hybrid_family_takes_the_split_path(twin: Path) -> None:
    params = EngineParams(n_ctx=256, n_batch=64, n_ubatch=64, expert_split=SPLIT)
    # layer 1 holds every expert hot: its experts run as one part (as in the qwen3moe test's layer 2)
    assert _split_nodes(twin, params, 4) == {"ffn_moe_hot-0", "ffn_moe_cold-0", "ffn_moe_hot-2", "ffn_moe_cold-2",
                                             "ffn_moe_hot-3", "ffn_moe_cold-3"}
    assert _split_nodes(twin, params, 40) == set()  # >= GGML_OP_OFFLOAD_MIN_BATCH tokens: the stock path


def test_the_routing_trace_counts_a_hybrid_familys_picks_on_every_layer(twin: Path) -> None:
    """The route stage's trace (the router's `ffn_moe_topk` of each layer) on the hybrids: every recurrent and
    attention layer's picks are counted, the same with the experts split."""
    from test_routing_trace import PROMPTS, _trace

    params = EngineParams(n_ctx=512, n_batch=512, n_ubatch=512)
    counts = _trace(twin, params, PROMPTS, n_gen=4)
    assert counts.architecture == model_info(twin).architecture and counts.n_layer == 4
    a = counts.array()
    assert a.shape == (4, 8) and (a.sum(axis=1) == counts.n_tokens * counts.n_expert_used).all()
    assert counts.n_tokens == 40 + 300 + 2 * 4
    assert np.array_equal(_trace(twin, params.model_copy(update={"expert_split": SPLIT}), PROMPTS, n_gen=4).array(), a)
