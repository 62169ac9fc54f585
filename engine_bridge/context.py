"""One llama.cpp context holding several sequences, built with the low-level API.

llama-cpp-python's ``Llama`` cannot set ``n_seq_max`` or ``kv_unified``; the serving engine
(:mod:`engine_bridge.batch`) loads the model and creates its context here, with the same placement knobs
as :class:`~engine_bridge.native.NativeModel` (tensor overrides included), and fills its batches through
:class:`SeqBatch`, a ``llama_batch`` over numpy arrays.
"""

from __future__ import annotations

import ctypes
import sys
from collections import deque
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from engine_bridge.errors import EngineError
from engine_bridge.native import _expert_split_env, _split_refusal, _tensor_overrides
from engine_bridge.params import KV_TYPE_IDS, EngineParams

_SPLIT_MODES = {"none": llama_cpp.LLAMA_SPLIT_MODE_NONE, "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
                "row": llama_cpp.LLAMA_SPLIT_MODE_ROW}
_LOAD_MODES = {"mmap": llama_cpp.LLAMA_LOAD_MODE_MMAP, "load": llama_cpp.LLAMA_LOAD_MODE_NONE,
               "mlock": llama_cpp.LLAMA_LOAD_MODE_MLOCK}
_LOG_WARN, _LOG_ERROR, _LOG_CONT = 3, 4, 5  # ggml_log_level of the pinned ggml.h (llama-cpp-python's _logger maps an older enum)
_last_level = [0]
# The latest error lines, so a failed load can say why (llama.cpp returns only NULL).
RECENT_ERRORS: deque[str] = deque(maxlen=16)


@llama_cpp.llama_log_callback
def _warnings_only(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp log callback: warnings and errors to stderr (the worker log), the rest dropped."""
    if level != _LOG_CONT:
        _last_level[0] = level
    if _last_level[0] >= _LOG_WARN and text:
        line = text.decode("utf-8", errors="replace")
        sys.stderr.write(line)
        if _last_level[0] == _LOG_ERROR:
            RECENT_ERRORS.append(line.strip())


def quiet_llama_logs() -> None:
    """Keep llama.cpp's warnings and errors, drop its INFO lines (hundreds per load, one per restore)."""
    llama_cpp.llama_log_set(_warnings_only, ctypes.c_void_p(0))


class SeqBatch:
    """A llama_batch over numpy arrays, so a step fills it with slice assignments."""

    def __init__(self, n_tokens: int, n_seq: int) -> None:
        self.token = np.zeros(n_tokens, np.int32)
        self.pos = np.zeros(n_tokens, np.int32)
        self.n_seq_id = np.ones(n_tokens, np.int32)
        self.logits = np.zeros(n_tokens, np.int8)
        self.seq_values = np.arange(n_seq, dtype=np.int32)
        self.seq_addr = self.seq_values.ctypes.data + 4 * np.arange(n_seq, dtype=np.uintp)
        self.seq_ptrs = np.zeros(n_tokens, np.uintp)
        self.n = 0
        b: Any = llama_cpp.llama_batch()  # its stub types the pointer fields as arrays
        self.raw = b
        b.token = self.token.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos))
        b.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self.seq_ptrs.ctypes.data, ctypes.POINTER(ctypes.POINTER(llama_cpp.llama_seq_id)))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def add(self, seq: int, pos0: int, tokens: list[int], want_logits: bool) -> int:
        """Append ``tokens`` of sequence ``seq`` at positions ``pos0...``; returns the last token's index."""
        a, z = self.n, self.n + len(tokens)
        self.token[a:z] = tokens
        self.pos[a:z] = np.arange(pos0, pos0 + len(tokens))
        self.seq_ptrs[a:z] = self.seq_addr[seq]
        self.logits[a:z] = 0
        self.logits[z - 1] = int(want_logits)
        self.n = z
        return z - 1


def _context_params(p: EngineParams) -> Any:
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = p.n_ctx * p.n_seq_max
    cp.n_batch, cp.n_ubatch, cp.n_seq_max = p.n_batch, p.n_ubatch, p.n_seq_max
    cp.n_threads, cp.n_threads_batch = p.n_threads, p.n_threads_batch
    cp.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if p.flash_attn
                          else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.type_k, cp.type_v = KV_TYPE_IDS[p.type_k], KV_TYPE_IDS[p.type_v]
    cp.offload_kqv, cp.op_offload, cp.kv_unified, cp.no_perf = p.offload_kqv, p.op_offload, False, True
    return cp


def load_model_and_context(path: Path, p: EngineParams, eval_callback: Any = None) -> tuple[Any, Any, list[Any]]:
    """Load ``path`` and create one multi-sequence context: (model, context, objects to keep alive).

    ``eval_callback`` (a ``ggml_backend_sched_eval_callback`` the caller keeps alive) observes the tensors it
    asks for as llama.cpp computes them (``cb_eval``).

    Raises:
        ExpertSplitMismatch: the plan's expert split does not fit the model (checked before and during the load).
        EngineError: the model or the context cannot be made.
    """
    quiet_llama_logs()
    llama_cpp.llama_backend_init()  # idempotent; Llama() does it, this path does not go through Llama()
    if not path.is_file():
        raise EngineError("model_missing", f"{path}: no such model file")
    if p.n_batch < p.n_seq_max:
        raise EngineError("bad_params", f"n_batch ({p.n_batch}) must be at least n_seq_max ({p.n_seq_max})")
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0x7FFFFFFF if p.n_gpu_layers == -1 else p.n_gpu_layers
    mp.split_mode, mp.main_gpu, mp.load_mode = _SPLIT_MODES[p.split_mode], p.main_gpu, _LOAD_MODES[p.load_mode]
    keep: list[Any] = []
    if p.tensor_split:
        split = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*p.tensor_split)
        mp.tensor_split = split
        keep.append(split)
    RECENT_ERRORS.clear()
    with _expert_split_env(p, path), _tensor_overrides(p.tensor_overrides, p.no_host) as overrides:
        model = llama_cpp.llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    keep.append(overrides)
    if not model:
        raise _split_refusal(path, RECENT_ERRORS) or EngineError(
            "load_failed", f"llama.cpp could not load {path} (see the worker log)")
    cp = _context_params(p)
    if eval_callback is not None:
        cp.cb_eval, cp.cb_eval_user_data = eval_callback, None
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise EngineError("load_failed", f"llama.cpp could not create a context for {path} (see the worker log)")
    return model, ctx, keep
