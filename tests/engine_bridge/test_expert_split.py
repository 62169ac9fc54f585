"""Per-expert placement in the patched llama.cpp: a tiny twin's experts split between two host buffers.

The hot copies go to the CPU's plain buffer ("CPU" as the hot device), the full expert tensors stay where the
normal placement puts them (the CPU's repacked layout, or the plain one), and the split model's logits must be
the unsplit model's. Real llama.cpp, no GPU: the overlap of host and GPU experts is not exercised here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from artifacts.engine_params import EngineParams, ExpertSplit, HotExperts
from artifacts.model_info import model_info
from engine_bridge.errors import ExpertSplitMismatch
from engine_bridge.expert_split import check_expert_split

llama_cpp = pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
from llama_cpp._ggml import libggml  # noqa: E402  # after the skip

from engine_bridge.worker.load import RECENT_ERRORS, SeqBatch, load_model_and_context, quiet_llama_logs  # noqa: E402
from engine_bridge.worker.native import NativeModel  # noqa: E402

# Layer 2 has every expert hot (device part only); the others split 2, 4 and 1 of the 8 experts.
SPLIT = ExpertSplit.on("CPU", {0: [1, 5], 1: [0, 2, 3, 7], 2: list(range(8)), 3: [6]})
# n_batch 16 < GGML_OP_OFFLOAD_MIN_BATCH (32): every batch takes the split path.
SMALL_BATCHES = {"n_ctx": 256, "n_batch": 16, "n_ubatch": 16}
RNG = np.random.default_rng(0)
PROMPT = RNG.integers(0, 500, size=40).tolist()
CONTINUATION = RNG.integers(0, 500, size=16).tolist()


@contextlib.contextmanager
def plain_host_layout() -> Iterator[None]:
    """Load with llama.cpp's extra CPU buffer types off: host weights in the plain (not repacked) layout."""
    original = llama_cpp.llama_cpp.llama_model_load_from_file

    def load(path: bytes, params: Any) -> Any:
        params.use_extra_bufts = False
        return original(path, params)

    llama_cpp.llama_cpp.llama_model_load_from_file = load
    try:
        yield
    finally:
        llama_cpp.llama_cpp.llama_model_load_from_file = original


def _outputs(model: Path, params: EngineParams, layout: str) -> tuple[np.ndarray, list[int]]:
    # the worker's loads take the layout from EngineParams.repack (use_extra_bufts)
    m = NativeModel(model, params.model_copy(update={"repack": layout != "plain"}))
    try:
        return m.logprobs(PROMPT, CONTINUATION), m.greedy(PROMPT[:10], 24, stop_eog=False)
    finally:
        m.close()


@pytest.mark.parametrize("host_sync", [False, True])
@pytest.mark.parametrize("layout", ["repacked", "plain"])
def test_a_split_between_two_host_buffers_gives_the_unsplit_logits(tiny_moe: Path, layout: str, host_sync: bool) -> None:
    ref, ref_tokens = _outputs(tiny_moe, EngineParams(**SMALL_BATCHES), layout)
    got, tokens = _outputs(tiny_moe, EngineParams(**SMALL_BATCHES, expert_split=SPLIT, expert_host_sync=host_sync), layout)
    # each pick's row is the stock row plus an exact zero; the hot copies run the same kernels here
    assert np.abs(got - ref).max() <= 1e-5
    assert tokens == ref_tokens


def test_the_two_host_layouts_are_the_repacked_and_the_plain_one(tiny_moe: Path) -> None:
    lines: list[str] = []

    @llama_cpp.llama_log_callback
    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode(errors="replace"))

    def buffers(plain: bool) -> str:
        lines.clear()
        llama_cpp.llama_log_set(capture, ctypes.c_void_p(0))
        try:
            with plain_host_layout() if plain else contextlib.nullcontext():
                model = llama_cpp.llama_cpp.llama_model_load_from_file(str(tiny_moe).encode(),
                                                                       llama_cpp.llama_model_default_params())
            llama_cpp.llama_model_free(model)
        finally:
            quiet_llama_logs()
        return "".join(line for line in lines if "model buffer size" in line)

    assert "CPU_REPACK" in buffers(plain=False)
    assert "CPU_REPACK" not in buffers(plain=True)


class _NodeNames:
    """An eval callback that counts the graph's node names (asks for none of them)."""

    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._eval)
        libggml.ggml_get_name.restype, libggml.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]

    def _eval(self, tensor: int, ask: bool, _user_data: int | None) -> bool:
        if ask:
            self.seen[(libggml.ggml_get_name(tensor) or b"").decode()] += 1
        return not ask


def _split_nodes(model: Path, params: EngineParams, n_tokens: int) -> set[str]:
    """Names of the split parts' nodes in a decode of n_tokens tokens, every row output."""
    names = _NodeNames()
    m, ctx, keep = load_model_and_context(model, params, names.callback)
    try:
        batch = SeqBatch(n_tokens, 1)
        batch.add(0, 0, PROMPT[:n_tokens], want_logits=True)
        batch.logits[:] = 1
        batch.raw.n_tokens = batch.n
        assert llama_cpp.llama_decode(ctx, batch.raw) == 0
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(m)
        del keep
    return {n for n in names.seen if n.startswith(("ffn_moe_hot-", "ffn_moe_cold-"))}


def test_small_batches_split_and_prefill_keeps_the_stock_path(tiny_moe: Path) -> None:
    params = EngineParams(n_ctx=256, n_batch=64, n_ubatch=64, expert_split=SPLIT)
    assert _split_nodes(tiny_moe, params, 4) == {"ffn_moe_hot-0", "ffn_moe_cold-0", "ffn_moe_hot-1", "ffn_moe_cold-1",
                                                 "ffn_moe_hot-3", "ffn_moe_cold-3"}
    assert _split_nodes(tiny_moe, params, 40) == set()  # >= GGML_OP_OFFLOAD_MIN_BATCH tokens
    assert _split_nodes(tiny_moe, EngineParams(n_ctx=256, n_batch=64, n_ubatch=64), 4) == set()


def test_a_plan_without_a_split_drops_a_stray_split_variable(tiny_moe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLUX_MOE_SPLIT", "CPU|0:1")
    assert _split_nodes(tiny_moe, EngineParams(n_ctx=256, n_batch=64, n_ubatch=64), 4) == set()
    assert os.environ["FLUX_MOE_SPLIT"] == "CPU|0:1"  # restored after the load


@pytest.mark.parametrize(("hot", "match"), [
    ({9: [1]}, "layer 9 does not exist: the model has 4 layers"),
    ({0: [8]}, "layer 0: expert 8 does not exist"),
])
def test_a_split_that_does_not_match_the_model_is_refused_before_loading(tiny_moe: Path, hot: dict[int, list[int]],
                                                                        match: str) -> None:
    with pytest.raises(ExpertSplitMismatch, match=match) as err:
        NativeModel(tiny_moe, EngineParams(**SMALL_BATCHES, expert_split=ExpertSplit.on("CPU", hot)))
    assert err.value.code == "expert_split_mismatch" and "--replan" in str(err.value)


def test_a_dense_model_and_an_unknown_device_are_refused(tiny_dense: Path, tiny_moe: Path) -> None:
    with pytest.raises(ExpertSplitMismatch, match="no routed experts"):
        check_expert_split(SPLIT, model_info(tiny_dense, supported=frozenset()))
    with pytest.raises(ExpertSplitMismatch, match="device 'CUDA7' is not in this build"):
        NativeModel(tiny_moe, EngineParams(**SMALL_BATCHES, expert_split=ExpertSplit.on("CUDA7", {0: [1]})))


@pytest.mark.parametrize(("value", "match"), [
    ("CPU|4:1", "layer 4 does not exist: the model has 4 layers"),
    ("CPU|0:8", "layer 0: expert 8 does not exist"),
    ("CPU|0:1,1", "layer 0 lists expert 1 twice"),
    ("CPU|0:1;1:2;0:3", "layer 0 is listed twice"),
    ("NOPE|0:1", "no device named 'NOPE'"),
    ("0:1", "names no device"),
    ("CPU|0:", "layer 0 lists no experts"),
    ("CPU|0:1,x", "'x' in 'CPU|0:1,x' is not a non-negative integer"),
    ("CPU|0:-1", "is not a non-negative integer"),
])
def test_the_backend_refuses_a_bad_split_variable(tiny_moe: Path, monkeypatch: pytest.MonkeyPatch, value: str,
                                                  match: str) -> None:
    # straight to llama.cpp (no Python check first): what llama-server would meet
    quiet_llama_logs()
    RECENT_ERRORS.clear()
    monkeypatch.setenv("FLUX_MOE_SPLIT", value)
    model = llama_cpp.llama_model_load_from_file(str(tiny_moe).encode(), llama_cpp.llama_model_default_params())
    if model:
        llama_cpp.llama_model_free(model)
    assert not model
    assert any("FLUX_MOE_SPLIT: " in line and match in line for line in RECENT_ERRORS), list(RECENT_ERRORS)


def test_a_mapped_split_is_refused_on_a_device_that_cannot_read_host_memory(tiny_moe: Path) -> None:
    """FLUX_MOE_MAPPED (patch 0006) needs a device whose kernels read pinned host memory in place (CUDA): a CPU
    "hot device" is refused at load, in one line, and the worker's typed error carries it."""
    with pytest.raises(ExpertSplitMismatch, match="cannot read host memory in place") as err:
        NativeModel(tiny_moe, EngineParams(**SMALL_BATCHES, expert_split=SPLIT, expert_mapped=True))
    assert "unset FLUX_MOE_MAPPED" in str(err.value)


def test_an_adaptive_cache_swaps_experts_and_keeps_the_unsplit_logits(tiny_moe: Path, monkeypatch: pytest.MonkeyPatch,
                                                                        capfd: pytest.CaptureFixture[str]) -> None:
    """FLUX_MOE_CACHE=adaptive (patch 0007), starting from a poor hot set (one expert per layer): the picks are
    read back every step here and experts swapped every second read, and every logit stays the unsplit model's
    (which experts are hot never changes a pick's result). FLUX_MOE_CACHE_FREEZE=1 holds the set: no swap."""
    for key, value in {"FLUX_MOE_CACHE_SAMPLE": "1", "FLUX_MOE_CACHE_EVERY": "2", "FLUX_MOE_CACHE_LOG": "1"}.items():
        monkeypatch.setenv(key, value)
    one_hot = ExpertSplit.on("CPU", {il: [7] for il in range(4)})
    adaptive = EngineParams(**SMALL_BATCHES, expert_split=one_hot, expert_cache="adaptive")
    ref, ref_tokens = _outputs(tiny_moe, EngineParams(**SMALL_BATCHES), "plain")
    capfd.readouterr()
    got, tokens = _outputs(tiny_moe, adaptive, "plain")
    assert np.abs(got - ref).max() <= 1e-5 and tokens == ref_tokens
    rounds = [line for line in capfd.readouterr().err.splitlines() if line.startswith("flux-moe-cache: ")]
    assert rounds, "no swap round ran"
    assert max(int(re.search(r"swaps=(\d+)", line).group(1)) for line in rounds) > 0  # type: ignore[union-attr]
    monkeypatch.setenv("FLUX_MOE_CACHE_FREEZE", "1")
    frozen, frozen_tokens = _outputs(tiny_moe, adaptive, "plain")
    assert np.abs(frozen - ref).max() <= 1e-5 and frozen_tokens == ref_tokens
    assert not any(line.startswith("flux-moe-cache: ") for line in capfd.readouterr().err.splitlines())


def test_an_adaptive_cache_needs_a_layout_it_can_copy_experts_from(tiny_moe: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ExpertSplitMismatch, match="a layout a swap cannot copy from"):
        NativeModel(tiny_moe, EngineParams(**SMALL_BATCHES, expert_split=SPLIT, expert_cache="adaptive"))
    monkeypatch.setenv("FLUX_MOE_CACHE", "lru")  # straight to llama.cpp, as llama-server would meet it
    monkeypatch.setenv("FLUX_MOE_SPLIT", "CPU|0:1")
    quiet_llama_logs()
    RECENT_ERRORS.clear()
    assert not llama_cpp.llama_model_load_from_file(str(tiny_moe).encode(), llama_cpp.llama_model_default_params())
    assert any("FLUX_MOE_CACHE='lru': use 'static' or 'adaptive'" in line for line in RECENT_ERRORS), list(RECENT_ERRORS)


def test_the_backend_refuses_a_split_of_a_dense_model(tiny_dense: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_llama_logs()
    RECENT_ERRORS.clear()
    monkeypatch.setenv("FLUX_MOE_SPLIT", "CPU|0:1")
    assert not llama_cpp.llama_model_load_from_file(str(tiny_dense).encode(), llama_cpp.llama_model_default_params())
    assert any("layer 0 has no separate routed expert tensors" in line for line in RECENT_ERRORS), list(RECENT_ERRORS)


# ---- ExpertSplit (pure) ---------------------------------------------------------------------------------


@given(st.dictionaries(st.integers(0, 95), st.sets(st.integers(0, 255), min_size=1, max_size=12), min_size=1,
                       max_size=8),
       st.sampled_from(["CPU", "CUDA0", "CUDA1"]), st.integers(0, 95))
def test_the_variable_round_trips(hot: dict[int, set[int]], device: str, switch_at: int) -> None:
    layers = tuple(HotExperts(layer=i, experts=tuple(sorted(ids)), device=device if i < switch_at else "CUDA9")
                   for i, ids in sorted(hot.items()))
    split = ExpertSplit(layers=layers)
    assert ExpertSplit.from_env_value(split.env_value()) == split
    device_runs = 1 + sum(a.device != b.device for a, b in zip(layers, layers[1:], strict=False))
    assert split.env_value().count("|") == device_runs  # a device is named where it changes


def test_environment_carries_the_split_and_the_sync_switch() -> None:
    p = EngineParams(expert_split=SPLIT, expert_host_sync=True, offload_min_batch=16)
    assert p.environment() == {"GGML_OP_OFFLOAD_MIN_BATCH": "16", "FLUX_MOE_SPLIT": "CPU|0:1,5;1:0,2,3,7;2:0,1,2,3,4,5,6,7;3:6",
                               "FLUX_MOE_HOST_SYNC": "1"}
    assert EngineParams().environment() == {}
    assert "FLUX_MOE_SPLIT" not in " ".join(p.cli_args())  # llama-server reads the same variable
    assert SPLIT.hot(1) == (0, 2, 3, 7) and SPLIT.hot(5) == ()


def test_the_host_override_names_exactly_the_split_layers_expert_tensors() -> None:
    pattern = re.compile(ExpertSplit.on("CUDA0", {3: [1], 12: [2]}).host_override().pattern)
    assert pattern.search("blk.3.ffn_up_exps.weight") and pattern.search("blk.12.ffn_down_exps.weight")
    assert not pattern.search("blk.13.ffn_up_exps.weight") and not pattern.search("blk.2.ffn_gate_exps.weight")
    assert not pattern.search("blk.3.ffn_gate_inp.weight") and not pattern.search("blk.3.ffn_up_shexp.weight")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"layer": 0, "experts": (3, 1), "device": "CPU"}, "ascending"),
    ({"layer": 0, "experts": (1, 1), "device": "CPU"}, "unique"),
    ({"layer": 0, "experts": (-1,), "device": "CPU"}, "non-negative"),
    ({"layer": 0, "experts": (), "device": "CPU"}, "at least 1"),
    ({"layer": 0, "experts": (1,), "device": "CUDA0|x"}, "not a ggml device name"),
    ({"layer": -1, "experts": (1,), "device": "CPU"}, "greater than or equal to 0"),
])
def test_bad_hot_sets_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        HotExperts(**kwargs)


def test_layers_must_be_ascending_and_unique() -> None:
    h0, h1 = HotExperts(layer=0, experts=(1,), device="CPU"), HotExperts(layer=1, experts=(2,), device="CPU")
    with pytest.raises(ValidationError, match="ascending and unique"):
        ExpertSplit(layers=(h1, h0))
    with pytest.raises(ValidationError, match="ascending and unique"):
        ExpertSplit(layers=(h0, h0))
    with pytest.raises(ValueError, match="expected"):
        ExpertSplit.from_env_value("0:1")
