"""The engine worker over its protocol: real llama.cpp in a real subprocess, faults included."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from artifacts.engine_params import EngineParams, TensorOverride
from engine_bridge import ops
from engine_bridge.client import WorkerClient
from engine_bridge.errors import EngineError, WorkerDied, WorkerTimeout
from engine_bridge.protocol import PROTOCOL_VERSION
from engine_bridge.sampling import GREEDY

PARAMS = EngineParams(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2, n_threads_batch=2)


@pytest.fixture()
def worker(tmp_path: Path):  # type: ignore[no-untyped-def]
    w = WorkerClient(log_path=tmp_path / "worker.log")
    w.start()
    yield w
    w.close()


def test_hello_speaks_our_protocol(worker: WorkerClient) -> None:
    assert worker.call("hello")["protocol"] == PROTOCOL_VERSION


def test_timed_run_times_prefill_and_decode(worker: WorkerClient, tiny_moe: Path) -> None:
    load = worker.request(ops.LOAD, ops.LoadArgs(model=str(tiny_moe), params=PARAMS))
    assert load.n_ctx == 256 and load.n_vocab > 256
    toks = worker.tokenize("Hello world, this is Flux.")
    t = worker.request(ops.TIMED_RUN, ops.TimedRunArgs(prompt=toks, n_gen=5))
    assert t.prompt_tokens == len(toks)
    assert t.gen_tokens == 5, "five decode steps after the prompt's own token"
    assert t.prompt_ms > 0 and t.gen_ms > 0
    # llama.cpp's counters ride along: together they saw every evaluated token
    assert (t.counter_prompt_tokens or 0) + (t.counter_gen_tokens or 0) == len(toks) + 5


def test_every_declared_op_has_a_handler() -> None:
    from engine_bridge.worker.handlers import unhandled

    assert unhandled() == []


def test_arguments_that_do_not_validate_are_bad_request(worker: WorkerClient, tiny_moe: Path) -> None:
    with pytest.raises(EngineError) as exc:
        worker.call("load", {"model": str(tiny_moe), "params": PARAMS.model_dump(), "logits_all": True})
    assert exc.value.code == "bad_request" and "logits_all" in exc.value.message
    with pytest.raises(EngineError) as exc:
        worker.call("timed_run", {"prompt": "not tokens", "n_gen": 1})
    assert exc.value.code == "bad_request" and exc.value.message.startswith("timed_run: prompt")
    assert worker.alive, "a bad request fails alone"


def test_measuring_and_serving_load_the_same_engine(tiny_moe: Path) -> None:
    """One EngineParams translation: the measuring engine and the serving engine give the same greedy tokens
    for the same placement (here with a tensor override)."""
    params = PARAMS.model_copy(update={"tensor_overrides": (TensorOverride(pattern=r"^blk\.1\.ffn_.*_exps\.", device="CPU"),)})
    with WorkerClient() as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(tiny_moe), params=params))
        toks = w.tokenize("the same engine")
        measured = w.request(ops.GREEDY, ops.GreedyArgs(prompt=toks, n_gen=8, stop_eog=False)).tokens
        w.request(ops.SERVE_LOAD, ops.ServeLoadArgs(model=str(tiny_moe), params=params))
        args = ops.GenerateArgs(rid="r", prompt=toks, max_tokens=8, sampling=GREEDY)
        served = [m["token"] for m in w.generate(args) if m["type"] == "token"]
    assert served[:len(measured)] == measured


def test_logprobs_are_normalized(worker: WorkerClient, tiny_moe: Path, tmp_path: Path) -> None:
    worker.call("load", {"model": str(tiny_moe), "params": PARAMS.model_dump()})
    toks = worker.call("tokenize", {"text": "abc def"})["tokens"]
    cont = worker.call("greedy", {"prompt": toks, "n_gen": 4, "stop_eog": False})["tokens"]
    out = tmp_path / "lp.npy"
    worker.call("logprobs", {"prompt": toks, "continuation": cont, "out": str(out)})
    lp = np.load(out)
    assert lp.shape[0] == 4
    np.testing.assert_allclose(np.exp(lp).sum(axis=1), 1.0, rtol=1e-4)
    assert (lp.argmax(axis=1) == np.array(cont)).all(), "greedy tokens are the argmax of their distributions"


def test_overrides_load_and_match_plain_outputs(worker: WorkerClient, tiny_moe: Path, tmp_path: Path) -> None:
    worker.call("load", {"model": str(tiny_moe), "params": PARAMS.model_dump()})
    toks = worker.call("tokenize", {"text": "overrides"})["tokens"]
    plain = worker.call("greedy", {"prompt": toks, "n_gen": 6, "stop_eog": False})["tokens"]
    params = PARAMS.model_copy(update={"tensor_overrides": (TensorOverride(pattern=r"^blk\.(0|2)\.ffn_(gate|up)_exps\.", device="CPU"),)})
    worker.call("load", {"model": str(tiny_moe), "params": params.model_dump()})
    assert worker.call("greedy", {"prompt": toks, "n_gen": 6, "stop_eog": False})["tokens"] == plain
    repacked = params.model_copy(update={"no_host": True, "load_mode": "load"})  # --no-host --no-mmap
    worker.call("load", {"model": str(tiny_moe), "params": repacked.model_dump()})
    assert worker.call("greedy", {"prompt": toks, "n_gen": 6, "stop_eog": False})["tokens"] == plain


def test_unknown_device_is_a_typed_error(worker: WorkerClient, tiny_moe: Path) -> None:
    params = PARAMS.model_copy(update={"tensor_overrides": (TensorOverride(pattern="exps", device="CUDA7"),)})
    with pytest.raises(EngineError) as exc:
        worker.call("load", {"model": str(tiny_moe), "params": params.model_dump()})
    assert exc.value.code == "bad_override" and "CUDA7" in exc.value.message
    assert worker.call("hello")["protocol"] == PROTOCOL_VERSION, "the worker survives a failed request"


def test_requests_before_load_fail_cleanly(worker: WorkerClient) -> None:
    with pytest.raises(EngineError) as exc:
        worker.call("timed_run", {"prompt": [1, 2], "n_gen": 1})
    assert exc.value.code == "not_loaded"


def test_native_crash_is_worker_died(worker: WorkerClient) -> None:
    with pytest.raises(WorkerDied) as exc:
        worker.call("abort")
    assert exc.value.returncode is not None and exc.value.returncode < 0
    assert not worker.alive


def test_kill_mid_request(worker: WorkerClient, tiny_moe: Path) -> None:
    worker.call("load", {"model": str(tiny_moe), "params": PARAMS.model_dump()})
    pid = worker.pid
    assert pid
    threading.Timer(0.3, lambda: os.kill(pid, signal.SIGKILL)).start()
    with pytest.raises(WorkerDied):
        for _ in range(10_000):
            worker.call("timed_run", {"prompt": list(range(10, 200)), "n_gen": 40})


def test_timeout_kills_the_worker(worker: WorkerClient, tiny_moe: Path) -> None:
    worker.call("load", {"model": str(tiny_moe), "params": PARAMS.model_dump()})
    pid = worker.pid
    assert pid
    os.kill(pid, signal.SIGSTOP)  # a hung worker
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeout):
        worker.call("hello", timeout=0.5)
    assert time.monotonic() - t0 < 5 and not worker.alive


def test_quantized_v_without_flash_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="flash_attn"):
        EngineParams(type_v="q8_0", flash_attn=False)


def test_plain_cpu_weights_load_and_are_a_flag_too(tiny_moe: Path) -> None:
    plain = PARAMS.model_copy(update={"repack": False})
    assert "--no-repack" in plain.cli_args() and "--no-repack" not in PARAMS.cli_args()
    with WorkerClient() as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(tiny_moe), params=plain))
        toks = w.tokenize("plain layout")
        assert len(w.request(ops.GREEDY, ops.GreedyArgs(prompt=toks, n_gen=4, stop_eog=False)).tokens) == 4


def test_a_vocabulary_only_load_tokenizes_like_the_whole_model(tiny_moe: Path) -> None:
    """The tokenizer helper reads the vocabulary alone (no weights: 12-14 s saved per plan of a 30B model on
    the H200); its tokens are the full load's, and an op that needs weights is a typed refusal."""
    text = "def f(x):\n    return x  <|im_start|>user\nhé 🙂"
    got = []
    for vocab_only in (False, True):
        with WorkerClient() as w:
            w.request(ops.LOAD, ops.LoadArgs(model=str(tiny_moe), params=EngineParams(n_ctx=256, n_batch=64,
                                                                                      n_ubatch=64),
                                             vocab_only=vocab_only), 60)
            got.append((w.tokenize(text, timeout=30), w.tokenize(text, special=False, timeout=30)))
            if vocab_only:
                with pytest.raises(EngineError) as err:
                    w.request(ops.TIMED_RUN, ops.TimedRunArgs(prompt=[1, 2, 3], n_gen=2), 30)
                assert err.value.code == "not_loaded" and "vocabulary only" in err.value.message
    assert got[0] == got[1] and got[0][0]


def test_token_arrays_travel_packed_and_arrive_as_lists(tiny_moe: Path) -> None:
    """A long prompt's tokens cross the pipe packed (base64 of int32: a 32k-token prompt is about a millisecond to
    write and to read instead of several, and a cached prompt crosses twice): a serving engine's tokenize result
    and a packed generate prompt arrive as the lists they were."""
    from engine_bridge.protocol import PACKED_KEY, decode, encode, packed
    from engine_bridge.worker.handlers import payload

    assert decode(encode({"id": 1, "t": packed(list(range(5000)))}))["t"] == list(range(5000))
    assert packed([3, 1, 2]) == [3, 1, 2], "short arrays stay readable JSON"
    for lookalike in ({PACKED_KEY: "not base64!"}, {PACKED_KEY: "AAA="}, {PACKED_KEY: "AAAA", "other": 1}):
        assert decode(encode({"id": 1, "x": lookalike}))["x"] == lookalike, "only a packed array is unpacked"
    with pytest.raises(EngineError) as exc:
        packed([2**40] * 100)
    assert exc.value.code == "bad_request"
    wire = payload(ops.TOKENIZE.name, ops.TokenizeResult(tokens=list(range(100))))
    assert set(wire["tokens"]) == {PACKED_KEY}
    text = " ".join(f"word{i}" for i in range(300))
    with WorkerClient() as w:
        w.request(ops.LOAD, ops.LoadArgs(model=str(tiny_moe), params=PARAMS, vocab_only=True))
        want = w.tokenize(text)
        w.request(ops.SERVE_LOAD, ops.ServeLoadArgs(model=str(tiny_moe), params=PARAMS.model_copy(
            update={"n_ctx": 2048})))
        got = w.tokenize(text)
        assert got == want and len(got) > 300
        result = [m for m in w.stream("generate", {"rid": "p", "prompt": packed(got), "max_tokens": 2,
                                                   "sampling": {"temperature": 0.0}}) if "result" in m][0]["result"]
    assert result["prompt_tokens"] == len(got)
