"""Routing traces through the worker, their table form, and the routing profiles of twins measured in llama.cpp."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from artifacts.engine_params import EngineParams, ExpertSplit
from artifacts.records.routing import top_share
from artifacts.synth import PRESETS, synthesize
from artifacts.synth.routing import router_scales
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.errors import EngineError, RoutingMismatch
from engine_bridge.ops import RoutingCounts, RoutingRequest
from engine_bridge.routing_trace import ROUTING_SCHEMA, check_routing_table, routing_table

pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")

RNG = np.random.default_rng(0)
PROMPTS = (tuple(RNG.integers(0, 500, size=40).tolist()), tuple(RNG.integers(0, 500, size=300).tolist()))
# 128 experts, 8 per token, as Qwen3-30B-A3B, in a 4 MB twin (2 layers, narrow experts)
WIDE = {"n_layer": "2", "n_expert": "128", "n_expert_used": "8", "n_ff_exp": "32"}


def _trace(model: Path, params: EngineParams, prompts: tuple[tuple[int, ...], ...], n_gen: int = 0) -> RoutingCounts:
    with WorkerClient() as w:
        return w.request(ops.ROUTING_COUNTS, RoutingRequest(model=str(model), params=params, prompts=prompts, n_gen=n_gen),
                         timeout=600)


def test_every_layer_counts_every_prefilled_and_decoded_token(tiny_moe: Path) -> None:
    spec = PRESETS["tiny-moe"]
    params = EngineParams(n_ctx=512, n_batch=512, n_ubatch=512)
    counts = _trace(tiny_moe, params, PROMPTS, n_gen=8)
    assert counts.n_tokens == 40 + 300 + 2 * 8
    assert (counts.architecture, counts.n_layer, counts.n_expert, counts.n_expert_used) == ("qwen3moe", 4, 8, 2)
    a = counts.array()
    assert a.shape == (spec.n_layer, spec.n_expert)
    assert (a.sum(axis=1) == counts.n_tokens * spec.n_expert_used).all()
    # the same workload under an expert split routes the same way (the split does not change the outputs)
    split = params.model_copy(update={"expert_split": ExpertSplit.on("CPU", {0: [1, 5], 3: [2]})})
    assert np.array_equal(_trace(tiny_moe, split, PROMPTS, n_gen=8).array(), a)


def test_a_trace_whose_threads_follow_a_file_counts_the_same(tiny_moe: Path, tmp_path: Path) -> None:
    params = EngineParams(n_ctx=512, n_batch=512, n_ubatch=512)
    threads = tmp_path / "cores.txt"
    threads.write_text("2")
    with WorkerClient() as w:
        got = w.request(ops.ROUTING_COUNTS, RoutingRequest(model=str(tiny_moe), params=params, prompts=PROMPTS, n_gen=8,
                                                           threads_file=str(threads)), timeout=600)
    assert got == _trace(tiny_moe, params, PROMPTS, n_gen=8)


def test_a_workload_longer_than_the_context_is_refused(tiny_moe: Path) -> None:
    with pytest.raises(EngineError, match="n_ctx 256"):
        _trace(tiny_moe, EngineParams(n_ctx=256), PROMPTS)


def _counts(n_layer: int = 2, n_expert: int = 4) -> RoutingCounts:
    a = np.arange(n_layer * n_expert).reshape(n_layer, n_expert)
    return RoutingCounts(architecture="qwen3moe", n_layer=n_layer, n_expert=n_expert, n_expert_used=2,
                         n_tokens=int(a.sum()) // 4, counts=tuple(tuple(int(x) for x in r) for r in a))


def test_the_table_round_trips_through_parquet_with_the_models_identity(tmp_path: Path) -> None:
    table = routing_table(_counts(), "abc123")
    assert table.schema.equals(ROUTING_SCHEMA, check_metadata=False)
    assert table.num_rows == 8 and table.column("count").to_pylist() == list(range(8))
    pq.write_table(table, tmp_path / "r.parquet")
    back = pq.read_table(tmp_path / "r.parquet")
    assert np.array_equal(check_routing_table(back, "abc123", 2, 4), _counts().array())
    assert back.schema.metadata[b"n_expert_used"] == b"2"


@pytest.mark.parametrize(("args", "what"), [
    (("other", 2, 4), "model hash"),
    (("abc123", 3, 4), "layer count"),
    (("abc123", 2, 8), "expert count"),
])
def test_a_trace_of_another_model_is_refused(args: tuple[str, int, int], what: str) -> None:
    with pytest.raises(RoutingMismatch, match=f"its {what} is") as err:
        check_routing_table(routing_table(_counts(), "abc123"), *args)
    assert err.value.what == what and err.value.code == "routing_mismatch"


def test_a_table_with_missing_or_repeated_rows_is_refused() -> None:
    table = routing_table(_counts(), "abc123")
    with pytest.raises(RoutingMismatch, match="rows"):
        check_routing_table(table.slice(0, 7), "abc123", 2, 4)
    repeated = pa.Table.from_arrays([pa.array([0] * 8, pa.int32()), pa.array([0, 1, 2, 3, 0, 1, 2, 3], pa.int32()),
                                     pa.array(range(8), pa.int64())], schema=table.schema)
    with pytest.raises(RoutingMismatch, match="rows"):
        check_routing_table(repeated, "abc123", 2, 4)


def test_top_share() -> None:
    counts = np.array([[10, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert top_share(counts, 0.5).tolist() == [1.0, 0.5, 0.0]
    assert top_share(counts, 0.25).tolist() == [1.0, 0.25, 0.0]
    with pytest.raises(ValueError, match="fraction"):
        top_share(counts, 0.0)


@pytest.fixture(scope="module")
def wide_twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wide")
    return {r: synthesize("tiny-moe", out / f"{r}.gguf", overrides={**WIDE, "routing": r}).path
            for r in ("uniform", "skewed", "local")}


def test_a_skewed_twin_routes_as_its_profile_in_llama_cpp(wide_twins: dict[str, Path]) -> None:
    # 2,048 random tokens: 512 distinct hidden states, so a few frequent tokens cannot fake a skew
    prompts = tuple(tuple(RNG.integers(0, 509, size=256).tolist()) for _ in range(8))
    params = EngineParams(n_ctx=512, n_batch=256, n_ubatch=256)
    _, expected = router_scales(128, 8, 0.9)
    want_half = float(np.sort(expected)[::-1][:64].sum())  # 0.898: the fit of the published 0.90
    skewed = _trace(wide_twins["skewed"], params, prompts).array()
    uniform = _trace(wide_twins["uniform"], params, prompts).array()
    half_s, half_u = top_share(skewed, 0.5), top_share(uniform, 0.5)
    assert (np.abs(half_s - want_half) <= 0.04).all(), half_s
    top1 = skewed.max(axis=1) / skewed.sum(axis=1)
    assert ((top1 >= 0.035) & (top1 <= 0.07)).all(), top1  # published: the busiest expert 4.3-6.3% of picks
    assert (half_u <= 0.68).all(), half_u  # near uniform (0.5 would be exactly uniform)
    assert (uniform.max(axis=1) / uniform.mean(axis=1) <= 2.5).all()
    # each layer has its own popular experts
    assert set(np.argsort(-skewed[0])[:8]) != set(np.argsort(-skewed[1])[:8])


def test_a_local_twin_repeats_its_picks_on_the_next_token_as_published(wide_twins: dict[str, Path]) -> None:
    # published for Qwen3-30B-A3B: ~45% of a token's picks were the previous token's too (docs/routing.md); the
    # local profile writes that into the twin (a recency head per layer read by the router), keeping the skew
    prompts = tuple(tuple(RNG.integers(0, 509, size=256).tolist()) for _ in range(6))
    params = EngineParams(n_ctx=512, n_batch=256, n_ubatch=256)
    local = _trace(wide_twins["local"], params, prompts, n_gen=16)
    uniform = _trace(wide_twins["uniform"], params, prompts, n_gen=16)
    skewed = _trace(wide_twins["skewed"], params, prompts, n_gen=16)
    assert local.pairs == uniform.pairs == (6 * (256 + 16 - 1),) * 2  # pairs within a sequence, every layer
    assert ((local.repeat_share() >= 0.38) & (local.repeat_share() <= 0.56)).all(), local.repeat_share()
    # without locality, a pick repeats by chance: k / n_expert = 6.25% uniform, more where a few experts are popular
    assert (np.abs(uniform.repeat_share() - 8 / 128) <= 0.02).all(), uniform.repeat_share()
    assert (skewed.repeat_share() <= 0.25).all(), skewed.repeat_share()
    assert (np.abs(top_share(local.array(), 0.5) - 0.9) <= 0.04).all()  # still the skewed profile's popularity


def test_the_local_profile_is_refused_where_it_cannot_be_written(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="qwen3moe twins"):
        synthesize("tiny-dense", tmp_path / "d.gguf", overrides={"n_expert": "4", "n_expert_used": "2",
                                                                 "n_ff_exp": "512", "routing": "local"})
    with pytest.raises(ValueError, match="Q4_0, Q8_0 or F16"):
        synthesize("tiny-moe", tmp_path / "k.gguf", quant="Q4_K", overrides={"routing": "local"})
    assert not list(tmp_path.iterdir())
