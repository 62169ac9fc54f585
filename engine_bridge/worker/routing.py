"""Which experts a MoE model routes tokens to, observed inside real llama.cpp.

llama.cpp names the expert selection of layer `il` `ffn_moe_topk-<il>`: int32 expert ids of shape
[n_expert_used, n_tokens] (ggml order), a strided view of the router's argsort. A ggml scheduler eval
callback (`llama_context_params.cb_eval`) asks for exactly those tensors and copies them out once computed,
so the counts are what llama.cpp's own kernels chose, not a re-implementation of the router.

Used to check that a synthetic twin routes realistically (a degenerate twin sends every token to the same
experts and makes MoE prefill look many times faster than the real model), and by the worker op
``routing_counts`` (:func:`trace`) to record a plan's routing trace on a workload.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import llama_cpp
import numpy as np
from llama_cpp._ggml import libggml
from numpy.typing import NDArray

from artifacts.engine_params import EngineParams
from artifacts.errors import ModelFileError
from engine_bridge.errors import EngineError
from engine_bridge.ops import RoutingCounts, RoutingRequest
from engine_bridge.worker.load import SeqBatch, load_model_and_context
from engine_bridge.worker.threads import SharedThreads

_TOPK_PREFIX = b"ffn_moe_topk-"
_GGML_TYPE_I32 = 26  # enum ggml_type in ggml.h


def _declare_ggml() -> None:
    """Declare the ggml tensor functions the callback calls (llama-cpp-python does not bind them)."""
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    for name, res, args in (
        ("ggml_get_name", ctypes.c_char_p, [vp]),
        ("ggml_nbytes", sz, [vp]),
        ("ggml_backend_tensor_get", None, [vp, vp, sz, sz]),
    ):
        fn = getattr(libggml, name)
        fn.restype, fn.argtypes = res, args


_declare_ggml()


class _TensorHead(ctypes.Structure):
    """The leading fields of `struct ggml_tensor` (ggml.h): enough to read a strided view."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


class TopkRecorder:
    """Counts expert selections from `ffn_moe_topk-<layer>` tensors as llama.cpp computes them.

    With ``keep_picks``, also keeps every token's picks: ``picks[sequence][layer]`` is a list of [tokens,
    n_expert_used] arrays in token order (a diagnosis of caches needs the order; the planner needs counts only).
    """

    def __init__(self, n_layer: int = 0, n_expert: int = 0, keep_picks: bool = False) -> None:
        self.counts = np.zeros((n_layer, n_expert), dtype=np.int64)  # sized again once the model is known
        # per layer: picks that the same sequence's previous token picked too, and such token pairs
        self.repeats = np.zeros(n_layer, dtype=np.int64)
        self.pairs = np.zeros(n_layer, dtype=np.int64)
        self.last: dict[int, NDArray[np.bool_]] = {}  # per layer: the last token's picks, as a mask
        self.picks: list[dict[int, list[NDArray[np.int32]]]] | None = [] if keep_picks else None
        self.error: str | None = None
        self.asking = True  # False: ask for nothing (a serving engine samples some steps only)
        # Kept on the object: the C side holds only the function pointer, which must outlive the context.
        self.callback = llama_cpp.ggml_backend_sched_eval_callback(self._eval)

    def _eval(self, tensor: int, ask: bool, _user_data: int | None) -> bool:
        """ggml's eval callback: with ask, say whether we want `tensor`; without, read it (True: go on)."""
        if not self.asking:  # first: a step not sampled pays one Python call per graph node, no more
            return not ask
        name = libggml.ggml_get_name(tensor) or b""
        layer = name[len(_TOPK_PREFIX) :]
        if not name.startswith(_TOPK_PREFIX) or not layer.isdigit():  # not e.g. "ffn_moe_topk-3 (cont)"
            return not ask
        if ask:
            return True
        try:
            self._record(tensor, int(layer))
        except Exception as e:  # an exception must not cross the C callback
            self.error = self.error or f"{name.decode(errors='replace')}: {e}"
        return True

    @staticmethod
    def _ids(tensor: int) -> NDArray[np.int32]:
        """Copy the (possibly strided) id tensor out of its backend buffer."""
        head = _TensorHead.from_address(tensor)
        if head.type != _GGML_TYPE_I32:
            raise ValueError(f"expected int32 expert ids, got ggml type {head.type}")
        nbytes = int(libggml.ggml_nbytes(tensor))
        raw = np.empty(nbytes, dtype=np.uint8)
        libggml.ggml_backend_tensor_get(tensor, raw.ctypes.data, 0, nbytes)
        return np.ndarray(
            shape=tuple(reversed(head.ne)), dtype=np.int32, buffer=raw, strides=tuple(reversed(head.nb))
        )

    def _count(self, tensor: int, layer: int) -> np.ndarray:
        """Add up the ids of one layer's selection into ``counts``; the ids."""
        ids = self._ids(tensor)
        n_layer, n_expert = self.counts.shape
        if not 0 <= layer < n_layer or ids.size and not 0 <= ids.min() <= ids.max() < n_expert:
            raise ValueError(f"layer {layer} or expert ids out of range for {n_layer}x{n_expert}")
        self.counts[layer] += np.bincount(ids.ravel(), minlength=n_expert)
        return ids

    def _record(self, tensor: int, layer: int) -> None:
        """Add up the ids of one layer's selection, and its repeats of the previous token's picks."""
        ids = self._count(tensor, layer)
        n_expert = self.counts.shape[1]
        picks = ids.reshape(-1, ids.shape[-1])  # [tokens in batch order, n_expert_used]
        if self.picks is not None:
            self.picks[-1].setdefault(layer, []).append(picks.copy())
        mask = np.zeros((picks.shape[0], n_expert), dtype=bool)
        np.put_along_axis(mask, picks.astype(np.int64), True, axis=1)
        if layer in self.last:
            mask = np.concatenate([self.last[layer][None], mask])
        self.repeats[layer] += int((mask[1:] & mask[:-1]).sum())
        self.pairs[layer] += mask.shape[0] - 1
        self.last[layer] = mask[-1]

    def new_sequence(self) -> None:
        """The next tokens start a sequence: no pair with the previous one's last token."""
        self.last.clear()
        if self.picks is not None:
            self.picks.append({})


def expert_counts(
    model_path: Path | str,
    text_or_tokens: str | Sequence[int],
    n_tokens: int = 256,
    n_threads: int | None = None,
) -> NDArray[np.int64]:
    """Run one prefill through llama.cpp and count how often each expert of each layer was selected.

    Logits are requested for every token: llama.cpp otherwise computes the last layer only for the rows
    it outputs, and the last layer's counts would cover one token.

    Args:
        model_path: a MoE GGUF.
        text_or_tokens: text (tokenized without special tokens) or token ids; the first `n_tokens` are used.
        n_tokens: how many tokens to decode, in one batch.
        n_threads: CPU threads (default: all cores).

    Returns:
        int64 array [n_layer, n_expert]; each row sums to n_tokens * n_expert_used.

    Raises:
        ModelFileError: the model does not load or has no experts.
        ValueError: fewer than `n_tokens` tokens, or token ids outside the vocabulary.
        EngineError: llama.cpp fails to make a context or to decode, or the routing tensors are unreadable.
    """
    path = Path(model_path)
    tokens = _tokens_of(path, text_or_tokens, n_tokens)
    t = n_threads or os.cpu_count() or 1
    params = EngineParams(n_ctx=n_tokens + 16, n_batch=n_tokens, n_ubatch=n_tokens, n_threads=t, n_threads_batch=t)
    return trace(RoutingRequest(model=str(path), params=params, prompts=(tuple(tokens),))).array()


def _tokens_of(path: Path, text_or_tokens: str | Sequence[int], n_tokens: int) -> list[int]:
    """The input's first ``n_tokens`` token ids, from the model's vocabulary alone (a vocab-only load)."""
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise ModelFileError(path, "llama.cpp could not load it (run with a llama.cpp log to see why)")
    try:
        return _tokens(model, text_or_tokens, n_tokens)
    finally:
        llama_cpp.llama_model_free(model)


def _meta(model: llama_cpp.llama_model_p, key: str) -> str | None:
    """A GGUF metadata value as text, None when absent."""
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, ctypes.sizeof(buf))
    return buf.value.decode() if n >= 0 else None


def _tokens(model: llama_cpp.llama_model_p, text_or_tokens: str | Sequence[int], n_tokens: int) -> list[int]:
    """The first n_tokens token ids of the input, checked against the vocabulary."""
    vocab = llama_cpp.llama_model_get_vocab(model)
    if isinstance(text_or_tokens, str):
        data = text_or_tokens.encode()
        buf = (llama_cpp.llama_token * (len(data) + 1))()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
        tokens = list(buf[: max(n, 0)])
    else:
        tokens = [int(t) for t in text_or_tokens]
    if len(tokens) < n_tokens:
        raise ValueError(f"the input gives {len(tokens)} tokens, fewer than n_tokens={n_tokens}")
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    if any(not 0 <= t < n_vocab for t in tokens[:n_tokens]):
        raise ValueError(f"token ids must be in [0, {n_vocab})")
    return tokens[:n_tokens]


# Prompt tokens per decode call of a trace: every row's logits are kept (see expert_counts), so the output
# buffer is this many vocabulary rows.
_TRACE_CHUNK = 256


def trace(request: RoutingRequest, recorder: TopkRecorder | None = None) -> RoutingCounts:
    """Count expert selections over a workload: each prompt prefilled, then ``n_gen`` greedy tokens decoded.

    The model is loaded with the request's EngineParams (placement, expert split and all), in a context of its
    own whose eval callback reads every layer's ``ffn_moe_topk``; each prompt starts from an empty cache.
    ``recorder`` (default: a new one) is the callback's: pass one made with ``keep_picks`` to keep every pick.

    Raises:
        ModelFileError: the model has no experts.
        EngineError: a prompt does not fit the context, or llama.cpp fails to load or decode.
    """
    p = request.params
    longest = max(len(t) for t in request.prompts) + request.n_gen
    if longest > p.n_ctx:
        raise EngineError("context_overflow", f"a prompt + {request.n_gen} tokens is {longest} tokens, n_ctx {p.n_ctx}")
    path = Path(request.model)
    recorder = recorder or TopkRecorder()
    model, ctx, keep = load_model_and_context(path, p.model_copy(update={"n_seq_max": 1}), recorder.callback)
    try:
        arch = _meta(model, "general.architecture") or ""
        n_expert = int(_meta(model, f"{arch}.expert_count") or 0)
        n_used = int(_meta(model, f"{arch}.expert_used_count") or 0)
        if n_expert < 1:
            raise ModelFileError(path, f"has no experts ({arch}.expert_count): routing needs a MoE model")
        n_layer = llama_cpp.llama_model_n_layer(model)
        recorder.counts = np.zeros((n_layer, n_expert), dtype=np.int64)
        recorder.repeats, recorder.pairs = np.zeros(n_layer, dtype=np.int64), np.zeros(n_layer, dtype=np.int64)
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        chunk = min(p.n_batch, _TRACE_CHUNK)
        threads = SharedThreads(request.threads_file)
        for prompt in request.prompts:
            recorder.new_sequence()
            _trace_one(ctx, list(prompt), request.n_gen, chunk, n_vocab, lambda: threads.apply(ctx))
    finally:
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
        del keep
    if recorder.error:
        raise EngineError("routing_unreadable", f"{path}: cannot read the expert selection: {recorder.error}")
    n_tokens = sum(len(t) for t in request.prompts) + request.n_gen * len(request.prompts)
    return RoutingCounts(architecture=arch, n_layer=recorder.counts.shape[0], n_expert=n_expert, n_expert_used=n_used,
                         n_tokens=n_tokens, counts=tuple(tuple(int(x) for x in row) for row in recorder.counts),
                         repeats=tuple(int(x) for x in recorder.repeats), pairs=tuple(int(x) for x in recorder.pairs))


def _trace_one(ctx: llama_cpp.llama_context_p, prompt: list[int], n_gen: int, chunk: int, n_vocab: int,
               before: Callable[[], object] = lambda: None) -> None:
    """Prefill ``prompt`` in chunks with every row output (the last layer routes every token), then decode;
    ``before`` runs before each chunk and before the decoded tokens (the threads follow their file there)."""
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    batch = SeqBatch(chunk, 1)
    pos = 0
    for start in range(0, len(prompt), chunk):
        before()
        part = prompt[start:start + chunk]
        batch.n = 0
        batch.add(0, pos, part, want_logits=True)
        batch.logits[:batch.n] = 1
        _decode(ctx, batch)
        pos += len(part)
    before()
    for _ in range(n_gen):
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
        batch.n = 0
        batch.add(0, pos, [int(np.argmax(logits))], want_logits=True)
        _decode(ctx, batch)
        pos += 1


def _decode(ctx: llama_cpp.llama_context_p, batch: SeqBatch) -> None:
    batch.raw.n_tokens = batch.n
    rc = llama_cpp.llama_decode(ctx, batch.raw)
    if rc != 0:
        raise EngineError("decode_failed", f"llama_decode returned {rc} for {batch.n} tokens")
