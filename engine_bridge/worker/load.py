"""The one translation of :class:`~artifacts.engine_params.EngineParams` into llama.cpp, for measuring and serving.

:func:`load_model_and_context` loads a model and creates its context with the low-level API from an
EngineParams and nothing else: the placement (``n_gpu_layers``, split mode, tensor split, tensor overrides
as ``-ot`` does, ``--no-host``, the plan's expert split), the context (sizes, threads, flash attention, KV
types and placement, op offload) and the load mode. :class:`~engine_bridge.worker.native.NativeModel`
(measuring, one sequence) and :class:`~engine_bridge.worker.serving.ServeEngine` (serving, several) both
load through it, so a plan is measured exactly as it is served; sliding-window layers get a window-sized cache
(``SWA_FULL``), and :func:`keep_prefix` says whether a cut-back cache still serves its prefix. :class:`SeqBatch` is
a ``llama_batch`` over numpy arrays. ``-ot`` and the expert split need the ggml device functions declared here.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp._ggml import libggml as _python_libggml

from artifacts import native_switches as sw
from artifacts.engine_params import KV_TYPE_IDS, SWA_FULL, EngineParams
from artifacts.model_info import model_info
from engine_bridge.errors import EngineError, ExpertSplitMismatch
from engine_bridge.expert_split import check_expert_split
from engine_bridge.ops import Device

_SPLIT_MODES = {"none": llama_cpp.LLAMA_SPLIT_MODE_NONE, "layer": llama_cpp.LLAMA_SPLIT_MODE_LAYER,
                "row": llama_cpp.LLAMA_SPLIT_MODE_ROW}
_LOAD_MODES = {"mmap": llama_cpp.LLAMA_LOAD_MODE_MMAP, "load": llama_cpp.LLAMA_LOAD_MODE_NONE,
               "mlock": llama_cpp.LLAMA_LOAD_MODE_MLOCK}
_LOG_WARN, _LOG_ERROR, _LOG_CONT = 3, 4, 5  # ggml_log_level of the pinned ggml.h (llama-cpp-python's _logger maps an older enum)
_last_level = [0]
# The latest error lines, so a failed load can say why (llama.cpp returns only NULL).
RECENT_ERRORS: deque[str] = deque(maxlen=16)


def _llama_libggml() -> ctypes.CDLL:
    """The copy of libggml that libllama links (``libggml.so.0`` beside it): the wheel ships the library's names as
    separate files, and each file the loader opens is a library of its own, with its own device registry. RPC
    devices registered in another copy would be invisible to llama.cpp's loads."""
    linked = Path(_python_libggml._name).with_name("libggml.so.0")
    return ctypes.CDLL(str(linked)) if linked.is_file() else _python_libggml


libggml = _llama_libggml()


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
        ("ggml_backend_reg_by_name", vp, [cp]),
        ("ggml_backend_reg_get_proc_address", vp, [vp, cp]),
        ("ggml_backend_register", None, [vp]),
        ("ggml_backend_reg_dev_count", sz, [vp]),
        ("ggml_backend_reg_dev_get", vp, [vp, sz]),
    ):
        fn = getattr(libggml, name)
        fn.restype, fn.argtypes = res, args


_declare_ggml()
_DEV_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}


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


_RPC_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
_RPC_REGISTERED: dict[str, int] = {}


def add_rpc_servers(endpoints: tuple[str, ...]) -> None:
    """Register each llama.cpp RPC server's devices with ggml (llama.cpp's --rpc), once per process.

    Their devices join the device list as RPC0, RPC1, ... in registration order, and llama.cpp puts them first
    among a model's devices. Raises EngineError ``rpc_unavailable`` when the build has no RPC backend or a
    server does not answer.
    """
    for endpoint in endpoints:
        if endpoint in _RPC_REGISTERED:
            continue
        reg = libggml.ggml_backend_reg_by_name(b"RPC")
        fn = libggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
        if not fn:
            raise EngineError("rpc_unavailable", "this backend build has no RPC support: rebuild it with "
                              "scripts/build-backend.sh (GGML_RPC)")
        server = _RPC_ADD_SERVER(fn)(endpoint.encode())
        if not server:
            raise EngineError("rpc_unavailable", f"RPC server {endpoint} did not answer: start it with "
                              f"`flux rpc-server --port {endpoint.rsplit(':', 1)[-1]}` there")
        libggml.ggml_backend_register(server)
        _RPC_REGISTERED[endpoint] = int(server)


def _rpc_devices(endpoint: str) -> list[int]:
    """The ggml devices of a registered RPC server, in its order."""
    reg = _RPC_REGISTERED[endpoint]
    return [int(libggml.ggml_backend_reg_dev_get(reg, i)) for i in range(libggml.ggml_backend_reg_dev_count(reg))]


def _buffer_type(device: str) -> int:
    if device.upper() == "CPU":
        return int(libggml.ggml_backend_cpu_buffer_type())
    dev = libggml.ggml_backend_dev_by_name(device.encode())
    if not dev:
        names = ", ".join(d.name for d in list_devices())
        raise EngineError("bad_override", f"no ggml device named {device!r} (this build has: {names})")
    return int(libggml.ggml_backend_dev_buffer_type(dev))


def _model_params(p: EngineParams, keep: list[Any]) -> Any:
    """llama.cpp's model parameters for ``p``: layers, split, load mode, ``-ot`` overrides, ``--no-host``.

    Arrays the parameters point at are appended to ``keep``: they must outlive the model.
    """
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0x7FFFFFFF if p.n_gpu_layers == -1 else p.n_gpu_layers
    mp.split_mode, mp.main_gpu, mp.load_mode = _SPLIT_MODES[p.split_mode], p.main_gpu, _LOAD_MODES[p.load_mode]
    if p.tensor_split:
        split = (ctypes.c_float * llama_cpp.LLAMA_MAX_DEVICES)(*p.tensor_split)
        mp.tensor_split = split
        keep.append(split)
    if p.tensor_overrides:
        arr = (_BuftOverride * (len(p.tensor_overrides) + 1))()  # NULL-terminated
        patterns = [o.pattern.encode() for o in p.tensor_overrides]
        for i, (o, pat) in enumerate(zip(p.tensor_overrides, patterns, strict=True)):
            arr[i].pattern, arr[i].buft = pat, _buffer_type(o.device)
        mp.tensor_buft_overrides = ctypes.cast(arr, ctypes.c_void_p)
        keep += [arr, patterns]
    mp.no_host, mp.use_extra_bufts = p.no_host, p.repack
    if _RPC_REGISTERED:  # a worker that met RPC servers gives each load exactly its own: RPC first, then local GPUs
        remote = {d for e in _RPC_REGISTERED for d in _rpc_devices(e)}
        own = [d for e in p.rpc_servers for d in _rpc_devices(e)]
        local = [d for i in range(libggml.ggml_backend_dev_count())
                 if (d := int(libggml.ggml_backend_dev_get(i))) not in remote and libggml.ggml_backend_dev_type(d) in (1, 2)]
        devices = (ctypes.c_void_p * (len(own) + len(local) + 1))(*own, *local, None)
        mp.devices = ctypes.cast(devices, ctypes.c_void_p)
        keep.append(devices)
    return mp


@contextlib.contextmanager
def _expert_split_env(params: EngineParams, model_path: Path) -> Iterator[None]:
    """Give the load the plan's expert split (llama.cpp reads FLUX_MOE_SPLIT when it loads a model), checked first.

    FLUX_MOE_SPLIT comes only from the plan: it is removed for a plan without a split, so a worker that
    loads several plans never carries one plan's split into another; FLUX_MOE_MAPPED, its batch limit and FLUX_MOE_CACHE likewise. FLUX_MOE_HOST_SYNC is set when the plan
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
    env = params.environment()
    wanted = {s.name: env.get(s.name) for s in (sw.MOE_SPLIT, sw.MOE_MAPPED, sw.MOE_MAPPED_MAX_TOKENS, sw.MOE_CACHE)}
    wanted[sw.MOE_HOST_SYNC.name] = env.get(sw.MOE_HOST_SYNC.name, os.environ.get(sw.MOE_HOST_SYNC.name))
    before = {k: os.environ.get(k) for k in wanted}
    try:
        for k, v in wanted.items():
            _set_env(k, v)
        yield
    finally:
        for k, v in before.items():
            _set_env(k, v)


@contextlib.contextmanager
def _kv_window_env(params: EngineParams) -> Iterator[None]:
    """Give the context its KV window (llama.cpp reads FLUX_KV_VRAM_CELLS when it creates the cache), from the plan
    only: removed for a plan without one, so a worker never carries one plan's window into another."""
    before = os.environ.get(sw.KV_VRAM_CELLS.name)
    try:
        _set_env(sw.KV_VRAM_CELLS.name, params.environment().get(sw.KV_VRAM_CELLS.name))
        yield
    finally:
        _set_env(sw.KV_VRAM_CELLS.name, before)


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def load_problem(errors: Iterable[str]) -> str | None:
    """Why llama.cpp's loader refused a file, in its own words without its function prefixes ("tensor
    'blk.1.ssm_a' not found", "key not found in model: qwen3next.ssm.state_size", "tensor '...' has wrong
    shape; expected ..., got ..."), from its error lines; None when it gave no reason."""
    for line in reversed(list(errors)):
        if "error loading model: " in line:
            why = line.split("error loading model: ", 1)[1]
            for prefix in ("error loading model hyperparameters: ", "error loading model vocabulary: ",
                           "check_tensor_dims: "):
                why = why.removeprefix(prefix)
            return why.strip() or None
    return None


def check_structure(path: Path) -> str | None:
    """What llama.cpp's loader finds wrong with the model's tensors and hyperparameters (None: nothing), from a
    load that allocates and reads no weights (``no_alloc``, no mmap, every layer on the CPU in the plain layout:
    the checks do not depend on where weights would go, and the CPU's extra buffer types took paths on the H200
    host's AMX CPU that other CPUs do not): milliseconds, whatever the model's size."""
    quiet_llama_logs()
    llama_cpp.llama_backend_init()
    if not path.is_file():
        raise EngineError("model_missing", f"{path}: no such model file")
    mp = llama_cpp.llama_model_default_params()
    mp.no_alloc, mp.n_gpu_layers, mp.load_mode, mp.use_extra_bufts = True, 0, llama_cpp.LLAMA_LOAD_MODE_NONE, False
    RECENT_ERRORS.clear()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    if model:
        llama_cpp.llama_model_free(model)
        return None
    return load_problem(RECENT_ERRORS) or "llama.cpp's loader refused it without saying why (see the worker log)"


def _split_refusal(model_path: Path, errors: Iterable[str]) -> ExpertSplitMismatch | None:
    """The typed error for a load llama.cpp refused because of the expert split (its log line says so)."""
    for line in reversed(list(errors)):
        if "FLUX_MOE_SPLIT: " in line:
            return ExpertSplitMismatch(str(model_path), line.split("FLUX_MOE_SPLIT: ", 1)[1])
    return None


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


class SmallBatchThreads:
    """llama.cpp runs a batch of more than one token on ``n_threads_batch``: a step that carries no prompt (a
    draft's verification, a few sequences' next tokens) is as memory-bound as one token, and on a plan with more
    batch threads than decode threads it paid the extra threads' wake-up every step (on the 2-core CPU, drafting
    with ``-t 1 -tb 2`` decoded at a fraction of its ``-t 1 -tb 1`` speed). ``use(prompt)`` sets the context's
    threads for the next ``llama_decode``: the batch count with a prompt in it, the decode count without."""

    def __init__(self, ctx: Any, n_threads: int, n_threads_batch: int) -> None:
        self.ctx, self.small, self.large = ctx, (n_threads, n_threads), (n_threads, n_threads_batch)
        self.now = self.large

    def use(self, prompt: bool) -> None:
        want = self.large if prompt else self.small
        if want != self.now and self.small != self.large:
            llama_cpp.llama_set_n_threads(self.ctx, *want)
            self.now = want


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


def _context_params(p: EngineParams, perf: bool = False) -> Any:
    """llama.cpp's context parameters for ``p`` (``perf``: keep llama.cpp's perf counters)."""
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = p.n_ctx * p.n_seq_max
    cp.n_batch, cp.n_ubatch, cp.n_seq_max = p.n_batch, p.n_ubatch, p.n_seq_max
    cp.n_threads, cp.n_threads_batch = p.n_threads, p.n_threads_batch
    cp.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if p.flash_attn
                          else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    cp.type_k, cp.type_v = KV_TYPE_IDS[p.type_k], KV_TYPE_IDS[p.type_v]
    cp.offload_kqv, cp.op_offload, cp.kv_unified, cp.no_perf = p.offload_kqv, p.op_offload, p.kv_unified, not perf
    cp.swa_full = SWA_FULL  # llama.cpp's C default is a full-size cache for sliding-window layers too
    return cp


def keep_prefix(ctx: Any, seq: int, keep: int) -> bool:
    """Cut sequence ``seq``'s cache to its first ``keep`` positions; False when what is left cannot serve them, and
    the caller must clear the sequence and prefill it again.

    A partial removal can fail (a recurrent model's state). And a sliding-window model's window layers keep only
    their window plus a micro-batch (``swa_full`` false), a parked state only the window: when the cells of the
    last window before ``keep`` are gone, the next token at ``keep`` would attend to a partial window and decode a
    different token, silently. llama.cpp keeps each sequence's window cells in position order, so the lowest
    position the cache still holds tells (llama-server's test too).
    """
    mem = llama_cpp.llama_get_memory(ctx)
    if not llama_cpp.llama_memory_seq_rm(mem, seq, keep, -1):
        return False
    window = int(llama_cpp.llama_model_n_swa(llama_cpp.llama_get_model(ctx)))
    if not window or keep == 0:
        return True
    # the token at `keep` attends to positions keep - window + 1 ... keep - 1 (none held: -1, -1)
    low, high = (int(f(mem, seq)) for f in (llama_cpp.llama_memory_seq_pos_min, llama_cpp.llama_memory_seq_pos_max))
    return high == keep - 1 and 0 <= low <= max(0, keep - window + 1)


def load_model_and_context(path: Path, p: EngineParams, eval_callback: Any = None,
                           perf: bool = False) -> tuple[Any, Any, list[Any]]:
    """Load ``path`` and create one multi-sequence context: (model, context, objects to keep alive).

    ``perf`` keeps llama.cpp's perf counters (measuring reads them beside its clocks). ``eval_callback`` (a
    ``ggml_backend_sched_eval_callback`` the caller keeps alive) observes the tensors it asks for as llama.cpp
    computes them (``cb_eval``).

    Raises:
        ExpertSplitMismatch: the plan's expert split does not fit the model (checked before and during the load).
        EngineError: the model or the context cannot be made.
    """
    quiet_llama_logs()
    llama_cpp.llama_backend_init()  # idempotent
    if not path.is_file():
        raise EngineError("model_missing", f"{path}: no such model file")
    if p.n_batch < p.n_seq_max:
        raise EngineError("bad_params", f"n_batch ({p.n_batch}) must be at least n_seq_max ({p.n_seq_max})")
    add_rpc_servers(p.rpc_servers)
    keep: list[Any] = []
    mp = _model_params(p, keep)
    RECENT_ERRORS.clear()
    with _expert_split_env(p, path):
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        why = load_problem(RECENT_ERRORS)
        raise _split_refusal(path, RECENT_ERRORS) or EngineError(
            "load_failed", f"llama.cpp could not load {path}: {why}" if why else
            f"llama.cpp could not load {path} (see the worker log)")
    cp = _context_params(p, perf)
    if eval_callback is not None:
        cp.cb_eval, cp.cb_eval_user_data = eval_callback, None
    with _kv_window_env(p):
        ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise EngineError("load_failed", f"llama.cpp could not create a context for {path} (see the worker log)")
    return model, ctx, keep
