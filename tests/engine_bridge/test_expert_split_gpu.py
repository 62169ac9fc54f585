"""Per-expert placement on a GPU: each layer's hot experts copied to CUDA0, the layer's full expert tensors on
the host, against the same twin with every expert on the host (the reference) and with every expert on the GPU.

A split changes the logits only by the GPU kernels' rounding: its KL divergence from the host reference stays
of the order of plain GPU placement's (on an H200, qwen3moe-small at 16-token batches: mean KLD 2.7-2.9e-4 for
the splits, patches/llama.cpp/README.md), with and without the host part waiting for the device part. Real
llama.cpp on a CUDA build and an NVIDIA GPU; skipped elsewhere (tests/engine_bridge/test_expert_split.py checks
the split between two host buffers on any machine). The speed of a split is raced by ``flux plan`` itself and by
``flux bench oracle`` and ``flux bench ablate`` on a plan.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from artifacts.engine_params import EngineParams, ExpertSplit, TensorOverride
from artifacts.model_info import model_info
from artifacts.synth import synthesize
from artifacts.synth.routing import layer_ranks

llama_cpp = pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
from llama_cpp._ggml import libggml  # noqa: E402  # after the skip

from engine_bridge.worker.load import SeqBatch, list_devices, load_model_and_context  # noqa: E402
from engine_bridge.worker.native import NativeModel  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not any(d.name == "CUDA0" for d in list_devices()),
                                                  reason="needs an NVIDIA GPU and a CUDA build of the backend")]

EXPERTS_ON_HOST = TensorOverride(pattern=r"\.ffn_(gate|up|down)_exps\.", device="CPU")
# 16-token batches (< GGML_OP_OFFLOAD_MIN_BATCH, 32): every batch takes the split path; layers on the GPU.
GPU_SMALL_BATCHES = {"n_ctx": 256, "n_batch": 16, "n_ubatch": 16, "n_gpu_layers": 99, "flash_attn": True}
RNG = np.random.default_rng(0)
PROMPT = RNG.integers(0, 500, size=40).tolist()
CONTINUATION = RNG.integers(0, 500, size=48).tolist()


@pytest.fixture(scope="module", params=["tiny-moe", "qwen3moe-small"])
def twin(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny twin, and the 8-layer, 64-expert one with skewed routing (the split's intended case)."""
    path = tmp_path_factory.mktemp("gpu-split") / f"{request.param}.gguf"
    synthesize(request.param, path, quant="Q4_0",
               overrides={"routing": "skewed"} if request.param == "qwen3moe-small" else None)
    return path


def hot_split(model: Path) -> ExpertSplit:
    """Each layer's busiest quarter of the experts (by the skewed profile's ranks) on CUDA0."""
    info = model_info(model)
    hot = max(1, info.n_expert // 4)
    return ExpertSplit.on("CUDA0", {il: np.flatnonzero(layer_ranks(info.n_expert, il, seed=0) < hot).tolist()
                                    for il in range(info.n_layer)})


def _logprobs(model: Path, params: EngineParams) -> np.ndarray:
    m = NativeModel(model, params)
    try:
        return m.logprobs(PROMPT, CONTINUATION)
    finally:
        m.close()


def _kl_top1(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """Mean KL(ref || got) over positions, and how often both pick the same top token."""
    kl = float(np.mean(np.sum(np.exp(ref) * (ref - got), axis=1)))
    return kl, float(np.mean(ref.argmax(axis=1) == got.argmax(axis=1)))


def _hot_nodes_on_gpu(model: Path, params: EngineParams, n_tokens: int = 16, prefix: str = "ffn_moe_hot-") -> int:
    """How many of an ``n_tokens`` decode's graph nodes are named ``prefix`` (the split's hot parts by default)."""
    seen: Counter[str] = Counter()
    libggml.ggml_get_name.restype, libggml.ggml_get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]

    def observe(tensor: int, ask: bool, _user_data: int | None) -> bool:
        if ask:
            seen[(libggml.ggml_get_name(tensor) or b"").decode()] += 1
        return not ask

    callback = llama_cpp.ggml_backend_sched_eval_callback(observe)
    m, ctx, keep = load_model_and_context(model, params, callback)
    try:
        batch = SeqBatch(n_tokens, 1)
        batch.add(0, 0, PROMPT[:n_tokens], want_logits=True)
        batch.raw.n_tokens = batch.n
        assert llama_cpp.llama_decode(ctx, batch.raw) == 0
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(m)
        del keep
    return sum(n for name, n in seen.items() if name.startswith(prefix))


def _assert_split_is_as_close_as_plain_gpu(twin: Path, batches: dict[str, Any], **split_params: Any) -> None:
    """A split (``split_params`` on top of the hot split) is as far from the host reference as plain GPU placement."""
    split = hot_split(twin)
    ref = _logprobs(twin, EngineParams(**batches, tensor_overrides=(EXPERTS_ON_HOST,)))
    all_gpu = _logprobs(twin, EngineParams(**batches))
    got = _logprobs(twin, EngineParams(**batches, tensor_overrides=(split.host_override(),), expert_split=split,
                                       **split_params))
    kl_gpu, top1_gpu = _kl_top1(ref, all_gpu)
    kl_split, top1_split = _kl_top1(ref, got)
    assert kl_gpu < 0.05, f"plain GPU placement is far from the host: KL {kl_gpu:.2e}"
    assert kl_split <= 2 * kl_gpu + 1e-4, f"split KL {kl_split:.2e} vs plain GPU placement's {kl_gpu:.2e}"
    assert top1_split >= top1_gpu - 0.1, (top1_split, top1_gpu)


@pytest.mark.parametrize("host_sync", [False, True])
def test_a_split_on_the_gpu_differs_from_the_host_only_as_plain_gpu_placement_does(twin: Path, host_sync: bool) -> None:
    _assert_split_is_as_close_as_plain_gpu(twin, GPU_SMALL_BATCHES, expert_host_sync=host_sync)


def test_every_split_layer_runs_its_hot_part(twin: Path) -> None:
    split = hot_split(twin)
    params = EngineParams(**GPU_SMALL_BATCHES, tensor_overrides=(split.host_override(),), expert_split=split)
    assert _hot_nodes_on_gpu(twin, params) >= model_info(twin).n_layer


# 4-token batches: a mapped split (FLUX_MOE_MAPPED, patch 0006) computes its cold picks on the GPU up to 4 tokens
MAPPED_BATCHES = {**GPU_SMALL_BATCHES, "n_batch": 4, "n_ubatch": 4}


def test_a_mapped_split_differs_from_the_host_only_as_plain_gpu_placement_does(twin: Path) -> None:
    """The cold experts read by the GPU from pinned host memory: same kernels as plain GPU placement, so the
    logits stay as close to the host reference as plain GPU placement's."""
    _assert_split_is_as_close_as_plain_gpu(twin, MAPPED_BATCHES, expert_mapped=True)


def test_a_mapped_split_runs_no_host_part_up_to_four_tokens(twin: Path) -> None:
    split = hot_split(twin)
    params = EngineParams(**MAPPED_BATCHES, tensor_overrides=(split.host_override(),), expert_split=split,
                          expert_mapped=True)
    n_layer = model_info(twin).n_layer
    assert _hot_nodes_on_gpu(twin, params, 4, "ffn_moe_mapped-") >= n_layer
    assert _hot_nodes_on_gpu(twin, params, 4, "ffn_moe_cold-") == 0
