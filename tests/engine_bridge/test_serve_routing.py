"""The serving engine counts its expert picks on sampled decode steps: real llama.cpp in a real worker.

The counts of every decode step (``routing_every`` 1) must be a routing trace's of the same tokens: the trace of
the prompt and the reply, less the trace of the prompt alone, is what the reply's decode steps routed. The hot
share is checked against an expert split on the CPU (the patched backend's hot copies in a second host buffer).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from artifacts.engine_params import EngineParams, ExpertSplit
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.sampling import GREEDY

# n_batch 16, below the op-offload threshold: a split layer takes the split path
PARAMS = EngineParams(n_ctx=256, n_batch=16, n_ubatch=16, n_threads=1, n_threads_batch=1, n_seq_max=2)
PROMPT = np.random.default_rng(0).integers(0, 500, size=24).tolist()


def _serve(w: WorkerClient, model: Path, params: EngineParams, every: int, prompt: list[int], n: int) -> list[int]:
    w.request(ops.SERVE_LOAD, ops.ServeLoadArgs(model=str(model), params=params, routing_every=every,
                                                routing_window=8))
    args = ops.GenerateArgs(rid="r", prompt=prompt, max_tokens=n, sampling=GREEDY)
    return [m["token"] for m in w.generate(args) if m["type"] == "token"]


def _trace(w: WorkerClient, model: Path, tokens: list[int]) -> np.ndarray:
    got = w.request(ops.ROUTING_COUNTS, ops.RoutingRequest(model=str(model), params=PARAMS.model_copy(
        update={"n_seq_max": 1}), prompts=(tuple(tokens),)))
    return got.array()


def test_every_decode_step_counted_is_the_trace_of_the_same_tokens(tiny_moe: Path) -> None:
    with WorkerClient() as w:
        prompt = PROMPT
        reply = _serve(w, tiny_moe, PARAMS, 1, prompt, 12)
        got = w.request(ops.SERVE_ROUTING)
        assert got.every == 1 and got.error is None
        assert got.steps == len(reply) - 1, "every decode step but the prompt's: the last token is never fed"
        assert got.tokens == len(reply) - 1
        counts = np.asarray(got.counts)
        assert counts.shape == (got.n_layer, got.n_expert) and got.n_expert == 8
        assert (counts.sum(axis=1) == got.tokens * got.n_expert_used).all(), "each layer routes each token"
        expected = _trace(w, tiny_moe, prompt + reply[:-1]) - _trace(w, tiny_moe, prompt)
    np.testing.assert_array_equal(counts, expected)


def test_one_step_in_n_is_counted_and_the_hot_share_is_the_split_experts(tiny_moe: Path) -> None:
    hot = {0: [1, 5], 1: [0, 2, 3, 7], 2: list(range(8)), 3: [6]}
    params = PARAMS.model_copy(update={"expert_split": ExpertSplit.on("CPU", hot)})
    with WorkerClient() as w:
        prompt = PROMPT[:10]
        reply = _serve(w, tiny_moe, params, 3, prompt, 20)
        got = w.request(ops.SERVE_ROUTING)
    assert got.steps == (len(reply) - 1) // 3
    counts = np.asarray(got.counts)
    mask = np.zeros_like(counts, dtype=bool)
    for layer, experts in hot.items():
        mask[layer, experts] = True
    assert got.picks == counts.sum() == got.tokens * got.n_expert_used * got.n_layer
    assert got.hot == counts[mask].sum() and 0 < got.hot < got.picks
    per_layer = (counts * mask).sum(axis=1) / counts.sum(axis=1)
    assert abs(got.hot / got.picks - per_layer.mean()) < 1e-12, "the ratio is the mean of the layers' hot shares"
    assert got.window_tokens <= 8 + 1 and 0 < got.window_picks <= got.picks


def test_a_dense_model_and_counting_off_report_nothing(tiny_moe: Path, tiny_dense: Path) -> None:
    with WorkerClient() as w:
        prompt = PROMPT[:5]
        _serve(w, tiny_moe, PARAMS, 0, prompt, 4)
        assert w.request(ops.SERVE_ROUTING).every == 0
        _serve(w, tiny_dense, PARAMS, 1, prompt, 4)
        got = w.request(ops.SERVE_ROUTING)
    assert got.every == 0 and got.n_expert == 0 and got.picks == 0
