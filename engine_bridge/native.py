"""The native engine: llama.cpp through llama-cpp-python, configured only from :class:`EngineParams`.

Runs inside the worker process (``engine_bridge.worker``); nothing outside ``engine_bridge`` imports it.
Timings come from llama.cpp's own perf counters (``llama_perf_context``), not from Python clocks.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp._ggml import libggml
from pydantic import BaseModel, ConfigDict

from artifacts.model_info import model_info
from engine_bridge.errors import EngineError, ExpertSplitMismatch
from engine_bridge.expert_split import check_expert_split
from engine_bridge.params import KV_TYPE_IDS, EngineParams, TensorOverride

log = logging.getLogger(__name__)

_SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}


class _BuftOverride(ctypes.Structure):
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _declare_ggml() -> None:
    """Declare the ggml device functions Flux calls (llama-cpp-python does not bind them)."""
    vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
    for name, res, args in (
        ("ggml_backend_dev_count", sz, []),
        ("ggml_backend_dev_get", vp, [sz]),
        ("ggml_backend_dev_by_name", vp, [cp]),
        ("ggml_backend_dev_name", cp, [vp]),
        ("ggml_backend_dev_description", cp, [vp]),
        ("ggml_backend_dev_type", ctypes.c_int, [vp]),
        ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]),
        ("ggml_backend_dev_buffer_type", vp, [vp]),
        ("ggml_backend_cpu_buffer_type", vp, []),
    ):
        fn = getattr(libggml, name)
        fn.restype, fn.argtypes = res, args


_declare_ggml()
_DEV_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


class Device(BaseModel):
    """A ggml backend device as llama.cpp sees it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str
    description: str
    kind: str
    memory_free: int
    memory_total: int


def list_devices() -> list[Device]:
    """Every ggml device of this build on this machine (CPU first)."""
    out = []
    for i in range(libggml.ggml_backend_dev_count()):
        dev = libggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        libggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(Device(
            name=(libggml.ggml_backend_dev_name(dev) or b"").decode(),
            description=(libggml.ggml_backend_dev_description(dev) or b"").decode(),
            kind=_DEV_TYPES.get(libggml.ggml_backend_dev_type(dev), "other"),
            memory_free=free.value, memory_total=total.value))
    return out


def _buffer_type(device: str) -> int:
    if device.upper() == "CPU":
        return int(libggml.ggml_backend_cpu_buffer_type())
    dev = libggml.ggml_backend_dev_by_name(device.encode())
    if not dev:
        names = ", ".join(d.name for d in list_devices())
        raise EngineError("bad_override", f"no ggml device named {device!r} (this build has: {names})")
    return int(libggml.ggml_backend_dev_buffer_type(dev))


@contextlib.contextmanager
def _tensor_overrides(overrides: Sequence[TensorOverride], no_host: bool = False) -> Iterator[Any]:
    """Make llama_model_load_from_file see ``overrides`` as ``tensor_buft_overrides`` (``-ot``) and,
    with ``no_host``, set ``no_host`` (``--no-host``: CPU weights repacked, not in pinned host memory).

    The high-level ``Llama`` has no parameter for either, so the load call is wrapped for the duration
    of the constructor; the array must outlive the model, so it is returned to the caller to keep.
    """
    if not overrides and not no_host:
        yield None
        return
    arr = (_BuftOverride * (len(overrides) + 1))()
    keep = [o.pattern.encode() for o in overrides]
    for i, (o, pat) in enumerate(zip(overrides, keep, strict=True)):
        arr[i].pattern = pat
        arr[i].buft = _buffer_type(o.device)
    original = llama_cpp.llama_cpp.llama_model_load_from_file

    def load(path: bytes, params: Any) -> Any:
        if overrides:
            params.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
        params.no_host = no_host
        return original(path, params)

    llama_cpp.llama_cpp.llama_model_load_from_file = load
    try:
        yield (arr, keep)
    finally:
        llama_cpp.llama_cpp.llama_model_load_from_file = original


@contextlib.contextmanager
def _expert_split_env(params: EngineParams, model_path: Path) -> Iterator[None]:
    """Give the load the plan's expert split (llama.cpp reads FLUX_MOE_SPLIT when it loads a model), checked first.

    FLUX_MOE_SPLIT comes only from the plan: it is removed for a plan without a split, so a worker that
    loads several plans never carries one plan's split into another. FLUX_MOE_HOST_SYNC is set when the plan
    asks for it and otherwise left as the environment has it (a switch for diagnosis).
    """
    split = params.expert_split
    if split is not None:
        check_expert_split(split, model_info(model_path, supported=frozenset()))
        names = {d.name for d in list_devices()}
        for h in split.layers:
            if h.device not in names:
                raise ExpertSplitMismatch(str(model_path), f"layer {h.layer}'s device {h.device!r} is not in this "
                                          f"build ({', '.join(sorted(names))})")
    wanted = {"FLUX_MOE_SPLIT": split.env_value() if split is not None else None,
              "FLUX_MOE_HOST_SYNC": "1" if params.expert_host_sync else os.environ.get("FLUX_MOE_HOST_SYNC")}
    before = {k: os.environ.get(k) for k in wanted}
    try:
        for k, v in wanted.items():
            _set_env(k, v)
        yield
    finally:
        for k, v in before.items():
            _set_env(k, v)


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _split_refusal(model_path: Path, errors: Iterable[str]) -> ExpertSplitMismatch | None:
    """The typed error for a load llama.cpp refused because of the expert split (its log line says so)."""
    for line in reversed(list(errors)):
        if "FLUX_MOE_SPLIT: " in line:
            return ExpertSplitMismatch(str(model_path), line.split("FLUX_MOE_SPLIT: ", 1)[1])
    return None


class Timing(BaseModel):
    """Wall-clock timing of one prompt + generation, with llama.cpp's perf counters beside it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    prompt_tokens: int
    prompt_ms: float
    gen_tokens: int
    gen_ms: float
    counter_prompt_tokens: int | None = None
    counter_prompt_ms: float | None = None
    counter_gen_tokens: int | None = None
    counter_gen_ms: float | None = None

    @property
    def prefill_tps(self) -> float:
        """Prompt tokens per second."""
        return self.prompt_tokens / self.prompt_ms * 1e3 if self.prompt_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        """Generated tokens per second."""
        return self.gen_tokens / self.gen_ms * 1e3 if self.gen_ms > 0 else 0.0


class NativeModel:
    """One loaded model + context, configured from EngineParams."""

    def __init__(self, model_path: Path, params: EngineParams, *, logits_all: bool = False) -> None:
        self.params = params
        if not model_path.is_file():
            raise EngineError("model_missing", f"{model_path}: no such model file")
        from engine_bridge.context import RECENT_ERRORS, quiet_llama_logs

        quiet_llama_logs()  # warnings and errors kept, and a refused expert split explained
        RECENT_ERRORS.clear()
        with _expert_split_env(params, model_path), _tensor_overrides(params.tensor_overrides, params.no_host) as keep:
            try:
                self.llm = Llama(
                    model_path=str(model_path), n_ctx=params.n_ctx, n_batch=params.n_batch,
                    n_ubatch=params.n_ubatch, n_threads=params.n_threads, n_threads_batch=params.n_threads_batch,
                    n_gpu_layers=params.n_gpu_layers, main_gpu=params.main_gpu,
                    split_mode=_SPLIT_MODES[params.split_mode], tensor_split=list(params.tensor_split) if params.tensor_split else None,
                    flash_attn=params.flash_attn, type_k=KV_TYPE_IDS[params.type_k],
                    type_v=KV_TYPE_IDS[params.type_v], use_mmap=params.load_mode == "mmap",
                    use_mlock=params.load_mode == "mlock", offload_kqv=params.offload_kqv,
                    op_offload=params.op_offload, seed=params.seed, logits_all=logits_all, verbose=False,
                )
            except ValueError as exc:
                refusal = _split_refusal(model_path, RECENT_ERRORS)
                if refusal is not None:
                    raise refusal from exc
                raise EngineError("load_failed", f"llama.cpp could not load {model_path}: {exc}") from exc
        self._keep_overrides = keep
        self.n_vocab = self.llm.n_vocab()
        self.n_ctx = self.llm.n_ctx()

    @property
    def ctx(self) -> Any:
        """The raw llama_context pointer."""
        return self.llm._ctx.ctx

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Tokens of ``text`` (no BOS added unless the model asks for one)."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens``."""
        return self.llm.detokenize(list(tokens)).decode("utf-8", errors="replace")

    def _clear(self) -> None:
        self.llm.reset()
        self.llm._ctx.kv_cache_clear()

    def _last_logits(self) -> np.ndarray:
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def timed_run(self, prompt: Sequence[int], n_gen: int) -> Timing:
        """Prefill ``prompt`` then decode ``n_gen`` greedy tokens, timed by the wall clock.

        Prefill is the prompt's evaluation up to the first token's logits (the device synchronized);
        decode is the ``n_gen`` single-token steps after it, logits read and argmax taken each time (what a
        server pays per token). llama.cpp's own perf counters are kept beside them for diagnosis: on a GPU
        they attribute asynchronous work to whichever call synchronizes, so they are not the timing.
        """
        if len(prompt) + n_gen > self.n_ctx:
            raise EngineError("context_overflow", f"{len(prompt)} + {n_gen} tokens exceed n_ctx {self.n_ctx}")
        self._clear()
        llama_cpp.llama_perf_context_reset(self.ctx)
        t0 = time.perf_counter()
        self.llm.eval(list(prompt))
        llama_cpp.llama_synchronize(self.ctx)
        tok = int(np.argmax(self._last_logits()))
        t1 = time.perf_counter()
        for _ in range(n_gen):
            self.llm.eval([tok])
            tok = int(np.argmax(self._last_logits()))
        t2 = time.perf_counter()
        perf = llama_cpp.llama_perf_context(self.ctx)
        return Timing(prompt_tokens=len(prompt), prompt_ms=(t1 - t0) * 1e3, gen_tokens=n_gen,
                      gen_ms=(t2 - t1) * 1e3, counter_prompt_tokens=perf.n_p_eval,
                      counter_prompt_ms=perf.t_p_eval_ms, counter_gen_tokens=perf.n_eval,
                      counter_gen_ms=perf.t_eval_ms)

    def greedy(self, prompt: Sequence[int], n_gen: int, stop_eog: bool = True) -> list[int]:
        """Greedy continuation of ``prompt`` (stops at end-of-generation tokens when asked)."""
        self._clear()
        self.llm.eval(list(prompt))
        out: list[int] = []
        for _ in range(n_gen):
            tok = int(np.argmax(self._last_logits()))
            if stop_eog and llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, tok):
                break
            out.append(tok)
            self.llm.eval([tok])
        return out

    def logprobs(self, prompt: Sequence[int], continuation: Sequence[int]) -> np.ndarray:
        """Log-softmax over the vocabulary before each continuation token: shape [len(cont), n_vocab].

        The prompt is evaluated without outputs; the last prompt token and the continuation then go in
        one batch with an output row per position (one llama_decode instead of one per token).
        """
        cont = [int(t) for t in continuation]
        if not cont:
            return np.zeros((0, self.n_vocab))
        if len(prompt) + len(cont) > self.n_ctx or len(cont) > self.llm.n_batch:
            raise EngineError("context_overflow", f"{len(prompt)} + {len(cont)} tokens do not fit n_ctx/n_batch")
        self._clear()
        head, last = list(prompt[:-1]), int(prompt[-1])
        if head:
            self.llm.eval(head)
        batch = [last, *cont[:-1]]
        self.llm._batch.set_batch(batch=batch, n_past=len(head), logits_all=True)
        self.llm._ctx.decode(self.llm._batch)
        self.llm.n_tokens = len(head) + len(batch)
        rows = [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).astype(np.float64)
                for i in range(len(batch))]
        logits = np.stack(rows)
        logits -= logits.max(axis=1, keepdims=True)
        return logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))

    def chat(self, messages: list[dict[str, str]], max_tokens: int, temperature: float = 0.0) -> dict[str, Any]:
        """One chat completion through the GGUF's chat template (llama-cpp-python's formatter)."""
        return dict(self.llm.create_chat_completion(messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]
                                                    temperature=temperature))

    def close(self) -> None:
        """Free the model and context."""
        self.llm.close()
