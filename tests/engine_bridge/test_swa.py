"""A sliding-window model (the tiny Gemma 3 twin: 7 of its 8 layers on a 512-token window) in the worker: its
context allocates what Flux counts (the window layers' cache is the window plus a micro-batch, as llama-server's),
and a cached prefix is reused only while that cache still holds the window before it, so a second request gives
the greedy reply a cold engine gives."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from artifacts.engine_params import EngineParams
from artifacts.model_info import kv_cache_bytes, model_info
from artifacts.synth import synthesize
from tests.engine_bridge.sinks import Recorder, gen_args

llama_cpp = pytest.importorskip("llama_cpp", reason="the backend is not built: run scripts/build-backend.sh")

from engine_bridge.worker.serving import ServeEngine  # noqa: E402

# One thread (a shared 2-core box); 128-token micro-batches: the window layers keep 512 + 128 -> 768 cells
PARAMS = EngineParams(n_ctx=4096, n_seq_max=1, n_batch=256, n_ubatch=128, n_threads=1, n_threads_batch=1)
MIB = 2**20
KV_SIZE = re.compile(r"llama_kv_cache: size =\s+([\d.]+) MiB \(\s*(\d+) cells,\s+(\d+) layers")
_CONTEXT = """
import sys, llama_cpp
from artifacts.engine_params import EngineParams
from engine_bridge.worker.load import _context_params
llama_cpp.llama_backend_init()
model = llama_cpp.llama_model_load_from_file(sys.argv[1].encode(), llama_cpp.llama_model_default_params())
p = EngineParams(n_ctx=int(sys.argv[2]), n_seq_max=int(sys.argv[3]), n_threads=1, n_threads_batch=1)
assert llama_cpp.llama_init_from_model(model, _context_params(p))
"""


@pytest.fixture(scope="module")
def gemma(models_dir: Path) -> Path:
    """tiny-gemma3 whose attention matters (a larger attention-output scale, as test_batch's ctx_model): a cache that
    lost part of the window changes its next tokens."""
    path = models_dir / "tiny-gemma3-attn.gguf"
    if not path.exists():
        synthesize("tiny-gemma3", path, quant="Q4_0", overrides={"attn_out_std": "0.1"})
    return path


def _engine(model: Path) -> tuple[ServeEngine, Recorder]:
    rec = Recorder()
    return ServeEngine(model, PARAMS, 64 << 20, rec), rec


def _run(engine: ServeEngine, key: int, prompt: list[int], n: int = 16) -> None:
    engine.submit(key, gen_args(f"r{key}", prompt, n))
    while engine.has_work():
        engine.step()


def _cold(model: Path, prompt: list[int]) -> list[int]:
    """The greedy reply of a fresh engine, which prefills the whole prompt."""
    engine, rec = _engine(model)
    _run(engine, 1, prompt)
    engine.close()
    assert rec.results[1]["cached_tokens"] == 0
    return rec.tokens[1]


def _prompt(engine: ServeEngine, seed: int, n_words: int) -> list[int]:
    words = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly zebras".split()
    return engine.vocab.tokenize(" ".join(words[(seed * 7 + i * i) % len(words)] for i in range(n_words)))


@pytest.mark.parametrize(("n_ctx", "n_seq"), [(32768, 1), (8192, 2)])
def test_the_worker_allocates_what_flux_counts(gemma: Path, n_ctx: int, n_seq: int) -> None:
    """The worker's context (its one translation of EngineParams) keeps each sequence's window layers at 512 + 512
    cells, not at the context: what kv_cache_bytes says and llama-server allocates (tests/artifacts)."""
    res = subprocess.run([sys.executable, "-c", _CONTEXT, str(gemma), str(n_ctx), str(n_seq)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    caches = sorted((int(c), int(n)) for _, c, n in KV_SIZE.findall(res.stderr))
    assert caches == [(1024, 7), (n_ctx, 1)], "a full-size window cache (swa_full) would have n_ctx cells"
    allocated = sum(float(mib) for mib, _, _ in KV_SIZE.findall(res.stderr)) * MIB
    assert allocated == pytest.approx(kv_cache_bytes(model_info(gemma), "f16", n_ctx, n_seq), rel=0.01)


def test_a_second_request_gives_the_same_greedy_reply(gemma: Path) -> None:
    engine, rec = _engine(gemma)
    a = _prompt(engine, 1, 900)
    assert len(a) > 768 + 512, "longer than the window cache: its first positions are overwritten"
    _run(engine, 1, a)
    _run(engine, 2, a)
    assert rec.results[2]["cached_tokens"] == len(a) - 1
    assert rec.tokens[2] == rec.tokens[1]
    engine.close()


def test_a_prefix_whose_window_is_gone_is_prefilled_again(gemma: Path) -> None:
    """A prompt that shares the first 1000 of a sequence's 3800 cached tokens: the window layers no longer hold
    positions 489-999, so the worker prefills it from scratch and answers as a cold engine does. A prompt that
    extends what the sequence holds finds its window and reuses the cache."""
    engine, rec = _engine(gemma)
    a, b = _prompt(engine, 2, 900), _prompt(engine, 3, 40)
    _run(engine, 1, a)
    _run(engine, 2, a[:1000] + b)
    assert rec.results[2]["cached_tokens"] == 0
    assert rec.tokens[2] == _cold(gemma, a[:1000] + b)
    _run(engine, 3, a + b)  # the sequence now holds a[:1000] + b: a's window at 1000 is there
    _run(engine, 4, a + b[:20] + a[:10])
    assert rec.results[4]["cached_tokens"] == len(a) + 20
    assert rec.tokens[4] == _cold(gemma, a + b[:20] + a[:10])
    assert rec.tokens[2] != rec.tokens[4], "other prompts give other tokens: the comparison has power"
    engine.close()


def test_a_parked_state_is_reused_only_whole(gemma: Path) -> None:
    """A parked state holds the window layers' last window only: restored and cut back further, it cannot serve,
    so the prompt is prefilled and the reply is the cold engine's."""
    engine, rec = _engine(gemma)
    a, b = _prompt(engine, 4, 900), _prompt(engine, 5, 200)
    _run(engine, 1, a)
    _run(engine, 2, b)  # the only sequence: a is parked
    assert engine.stats()["parked"]["count"] == 1
    _run(engine, 3, a[:900] + b)
    assert rec.tokens[3] == _cold(gemma, a[:900] + b)
    _run(engine, 4, b)  # parks a[:900] + b and its reply
    _run(engine, 5, a[:900] + b + rec.tokens[3])  # the whole parked state and one token more
    assert rec.results[5]["cached_tokens"] == len(a[:900] + b) + len(rec.tokens[3]) - 1
    assert rec.tokens[5] == _cold(gemma, a[:900] + b + rec.tokens[3])
    engine.close()
