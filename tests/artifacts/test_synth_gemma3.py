"""The gemma3 (Gemma 3) twins: sliding-window attention as llama.cpp's converter writes it, loaded by real llama.cpp,
and the KV cache Flux counts for them against what llama-server allocates (issue 56 item 1)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader
from twin_checks import field, kinds_by_layer, written_tiny_twin

from artifacts.model_info import kv_cache_bytes, model_info, swa_cells
from artifacts.synth import PRESETS, QUANTS, Quant, plan_tensors, planned_bytes, synthesize
from artifacts.synth.presets import SynthSpec

TINY = "tiny-gemma3"
FULL = "gemma3-270m"
EVERY_LAYER = {"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
               "attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight", "ffn_norm.weight",
               "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "post_ffw_norm.weight"}
MIB = 2**20
# llama.cpp's lines for each KV cache it creates: "llama_kv_cache: size =    8.00 MiB ( 32768 cells,   1 layers, ..."
KV_SIZE = re.compile(r"llama_kv_cache: size =\s+([\d.]+) MiB \(\s*(\d+) cells,\s+(\d+) layers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthesize(TINY, tmp_path_factory.mktemp("gemma3") / "g.gguf", quant="Q4_0").path


@pytest.mark.parametrize("quant", QUANTS)
def test_tiny_twin_lists_the_converters_tensors(tmp_path: Path, quant: Quant) -> None:
    reader = written_tiny_twin(TINY, tmp_path / "g.gguf", quant)
    kinds = kinds_by_layer([t.name for t in reader.tensors])
    assert sorted(kinds) == list(range(8)) and all(k == EVERY_LAYER for k in kinds.values())
    top = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors if not t.name.startswith("blk.")}
    assert top == {"token_embd.weight": (256, 512), "output_norm.weight": (256,)}  # the output is the embedding


def test_tiny_twin_header_keys(tiny: Path) -> None:
    reader = GGUFReader(tiny)
    a = "gemma3"
    assert field(reader, "general.architecture") == a
    expected = {"block_count": 8, "embedding_length": 256, "feed_forward_length": 512, "attention.head_count": 4,
                "attention.head_count_kv": 1, "attention.key_length": 64, "attention.value_length": 64,
                "context_length": 32768, "attention.sliding_window": 512}
    assert {k: field(reader, f"{a}.{k}") for k in expected} == expected
    assert field(reader, f"{a}.rope.freq_base") == pytest.approx(1e6)
    assert field(reader, f"{a}.rope.freq_base_swa") == pytest.approx(1e4)  # rope_local_base_freq
    # Gemma3Model writes neither (llama.cpp: head_dim rotated dims, its default pattern of 6)
    assert f"{a}.rope.dimension_count" not in reader.fields
    assert f"{a}.attention.sliding_window_pattern" not in reader.fields
    record = json.loads(field(reader, "flux.synth.spec"))
    assert SynthSpec.model_validate(record) == PRESETS[TINY]


def test_other_twins_record_no_gemma3_fields(tmp_path: Path) -> None:
    record = json.loads(field(GGUFReader(synthesize("tiny-dense", tmp_path / "d.gguf").path), "flux.synth.spec"))
    assert not {"n_swa", "rope_base_swa"} & set(record)


def test_full_preset_has_gemma_3_270m_shapes() -> None:
    spec = PRESETS[FULL]
    plan = {t.name: t.shape for t in plan_tensors(spec, "F16")}
    assert sorted(kinds_by_layer(list(plan))) == list(range(18))
    assert plan["blk.0.attn_q.weight"] == (640, 4 * 256) and plan["blk.0.attn_k.weight"] == (640, 256)
    assert plan["blk.0.ffn_up.weight"] == (640, 2048) and plan["token_embd.weight"] == (640, 262144)
    assert "output.weight" not in plan  # tied
    assert [i for i in range(18) if not spec.is_swa(i)] == [5, 11, 17]  # 15 of 18 layers on the window
    assert 0.53e9 < planned_bytes(spec, "F16") < 0.55e9  # 268 M parameters


def test_model_info_counts_the_window_layers(tmp_path: Path) -> None:
    """Gemma 3 270M: 15 of its 18 layers keep 1024 cells (512-token window + a 512-token micro-batch), 3 the whole
    context: 111 MiB of f16 KV at 32768 tokens, where every layer at the full context would be 576 MiB."""
    path = tmp_path / "g270.gguf"
    synthesize(FULL, path, quant="Q4_0")
    info = model_info(path)
    assert (info.n_swa, info.n_swa_layers, info.kv_bytes_per_token["f16"]) == (512, 15, 18 * 1024)
    assert info.swa_kv_bytes_per_token["f16"] == 15 * 1024
    assert swa_cells(info, 32768) == 1024 and swa_cells(info, 32768, n_ubatch=2048) == 2560
    assert swa_cells(info, 600) == 600
    assert info.kv_cache_bytes_train_ctx["f16"] == kv_cache_bytes(info, "f16", 32768) == 111 * MIB
    assert info.kv_bytes_per_token["f16"] * 32768 == 576 * MIB
    assert kv_cache_bytes(info, "f16", 8192, n_seq=4) == 4 * (3 * 1024 * 8192 + 15 * 1024 * 1024)


def test_llama_cpp_loads_and_generates_deterministically(tiny: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
    llm = llama_cpp.Llama(str(tiny), n_ctx=256, n_threads=2, verbose=False, seed=0)
    assert llm.metadata["general.architecture"] == "gemma3"
    runs = []
    for _ in range(2):  # not twin_checks.greedy_twice: this twin's first greedy token there is <|endoftext|>
        out = llm("Once upon a time", max_tokens=8, temperature=0.0)
        assert isinstance(out, dict) and out["usage"]["completion_tokens"] == 8
        runs.append(out["choices"][0]["text"])
        llm.reset()
    assert runs[0] == runs[1] and len(set(runs[0])) > 2  # not one token repeated (a tied twin must not echo)


def test_the_window_cache_computes_what_a_full_one_does(tiny: Path) -> None:
    """1500 tokens through a window-sized cache (768 cells, overwritten in turn) and through one of the whole
    context give the same logits to rounding: the window layers attend to the last 512 positions only, so the
    cells llama.cpp reuses were masked anyway. The twin's small layer updates keep rounding small."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")
    tokens = np.random.default_rng(0).integers(0, 500, size=1500).tolist()
    last = []
    for full in (False, True):
        llm = llama_cpp.Llama(str(tiny), n_ctx=2048, n_batch=128, n_ubatch=128, n_threads=2, verbose=False,
                              seed=0, logits_all=True, swa_full=full)
        llm.eval(tokens)
        last.append(np.array(llm.scores[llm.n_tokens - 1]))
        llm.close()
    assert float(np.abs(last[0] - last[1]).max()) < 1e-3 * float(last[1].std())


def _llama_server_kv(model: Path, n_ctx: int, log: Path) -> tuple[int, list[tuple[int, int]]]:
    """The KV cache llama-server (the pinned build) allocates for ``model`` at ``-c n_ctx -np 1``: bytes (from its
    MiB lines) and each cache's (cells, layers)."""
    from artifacts.engine_params import EngineParams
    from engine_bridge.backend import llama_server_path
    from engine_bridge.llama_server import LlamaServer

    exe = llama_server_path(Path.home() / ".cache" / "flux")
    if exe is None:
        pytest.skip("llama-server is not built: run scripts/build-backend.sh")
    args = [*EngineParams(n_ctx=n_ctx, n_threads=1, n_threads_batch=1).server_args(), "-lv", "4"]
    with LlamaServer(exe, model, args, log_path=log):
        pass
    caches = KV_SIZE.findall(log.read_text(errors="replace"))
    assert caches, log.read_text()[-2000:]
    return int(sum(float(mib) for mib, _, _ in caches) * MIB), [(int(c), int(n)) for _, c, n in caches]


def _inspect(flux: Any, model: Path) -> dict[str, Any]:
    out = flux("inspect", str(model), "--json", "--no-hash")
    assert out.returncode == 0, out.stderr
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def test_flux_inspect_kv_matches_llama_server(flux: Any, tiny: Path, tmp_path: Path) -> None:
    """At the twin's 32768-token context llama-server keeps one full-attention layer of 32768 cells and seven
    window layers of 1024: 9.75 MiB, what flux inspect reports; counting every layer at 32768 cells (as Flux did)
    gave 64 MiB."""
    info = _inspect(flux, tiny)
    assert (info["architecture"], info["n_swa"], info["n_swa_layers"]) == ("gemma3", 512, 7)
    served, caches = _llama_server_kv(tiny, 32768, tmp_path / "server.log")
    assert sorted(caches) == [(1024, 7), (32768, 1)]
    assert info["kv_cache_bytes_train_ctx"]["f16"] == pytest.approx(served, rel=0.01)
    assert served == pytest.approx(9.75 * MIB, rel=0.01)
    assert info["kv_bytes_per_token"]["f16"] * 32768 == 64 * MIB  # the old count: 6.6x what is allocated


def test_a_twin_without_a_window_is_counted_as_before(flux: Any, tiny_dense: Path, tmp_path: Path) -> None:
    info = _inspect(flux, tiny_dense)
    assert (info["n_swa"], info["n_swa_layers"], info["swa_kv_bytes_per_token"]) == (0, 0, {})
    ctx = info["n_ctx_train"]
    assert info["kv_cache_bytes_train_ctx"]["f16"] == info["kv_bytes_per_token"]["f16"] * ctx
    served, caches = _llama_server_kv(tiny_dense, ctx, tmp_path / "server.log")
    assert caches == [(ctx, 4)] and info["kv_cache_bytes_train_ctx"]["f16"] == pytest.approx(served, rel=0.01)
