"""What a GGUF model is, read from its header only: shapes, bytes by role and layer, experts, KV cost.

Split models (``name-00001-of-00003.gguf``) are one model: pass any shard, every shard is read.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from artifacts.errors import ModelFileError
from artifacts.gguf_header import ArrayInfo, GGUFHeader, TensorInfo, read_header

Role = Literal[
    "embeddings", "attention", "norm", "dense_ffn", "shared_expert", "router",
    "experts_gate", "experts_up", "experts_down", "output", "other",
]
ROLES: tuple[Role, ...] = (
    "embeddings", "attention", "norm", "dense_ffn", "shared_expert", "router",
    "experts_gate", "experts_up", "experts_down", "output", "other",
)
# Bytes per KV element for each cache type llama.cpp accepts (block bytes / block elements).
KV_TYPES: dict[str, float] = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q5_1": 24 / 32,
                              "q5_0": 22 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32}
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
_ROLE_SPECS: tuple[tuple[str, Role], ...] = (
        (r"^(token_embd|tok_embd|token_types|pos_embd|per_layer_token_embd)", "embeddings"),
        (r"^(output|lm_head)\.", "output"),
        (r"^output_norm", "norm"),
        (r"ffn_gate_exps", "experts_gate"),
        (r"ffn_up_exps", "experts_up"),
        (r"ffn_down_exps", "experts_down"),
        (r"ffn_gate_up_exps", "experts_gate"),
        (r"ffn_(gate|up|down)_shexp|ffn_gate_inp_shexp", "shared_expert"),
        (r"ffn_gate_inp|exp_probs_b", "router"),
        (r"norm", "norm"),
        (r"^attn_|\.attn_|ssm_|time_mix|wkv", "attention"),
        (r"ffn_(gate|up|down)", "dense_ffn"),
)
_ROLE_RULES: tuple[tuple[re.Pattern[str], Role], ...] = tuple((re.compile(p), r) for p, r in _ROLE_SPECS)


class LayerInfo(BaseModel):
    """Bytes of one transformer block by role."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    index: int
    bytes_by_role: dict[str, int]

    @property
    def expert_bytes(self) -> int:
        """Bytes of this layer's routed-expert tensors (gate + up + down)."""
        return sum(self.bytes_by_role.get(r, 0) for r in ("experts_gate", "experts_up", "experts_down"))

    @property
    def total_bytes(self) -> int:
        """All bytes of this layer."""
        return sum(self.bytes_by_role.values())


class ModelInfo(BaseModel):
    """A model as Flux plans for it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    path: str
    shards: list[str]
    file_bytes: int
    architecture: str
    supported: bool
    name: str
    file_type: str
    n_params: int
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    key_length: int
    value_length: int
    n_vocab: int
    n_ctx_train: int
    n_expert: int
    n_expert_used: int
    bytes_by_role: dict[str, int]
    quant_types: dict[str, int]
    layers: list[LayerInfo]
    kv_bytes_per_token: dict[str, int]
    content_hash: str | None = None
    # Hybrid models (qwen3next: gated delta-net layers beside every full_attention_interval-th attention
    # layer): the layers that hold a KV cache, and the fixed-size recurrent state of the others per sequence
    # (f32, whatever the context: llama.cpp's conv and SSM states). None / 0: every layer has a KV cache.
    n_kv_layers: int | None = None
    recurrent_state_bytes: int = 0
    # next-token (MTP) blocks after the trunk (nextn_predict_layers): not in n_layer nor in layers; llama.cpp
    # loads them only for an MTP drafting context
    n_nextn_layers: int = 0
    # Sliding-window attention (Gemma 2/3, gpt-oss, Cohere2, ...): the window in tokens, how many KV layers attend
    # to it only, and their share of kv_bytes_per_token. llama.cpp keeps a window-sized cache for those layers
    # (kv_cache_bytes); 0 / {}: every KV layer holds the whole context.
    n_swa: int = 0
    n_swa_layers: int = 0
    swa_kv_bytes_per_token: dict[str, int] = {}
    # Bytes of one sequence's KV cache at the trained context (n_ctx_train) as llama.cpp allocates it with its
    # default 512-token micro-batch, by cache type: kv_cache_bytes(info, type, n_ctx_train)
    kv_cache_bytes_train_ctx: dict[str, int] = {}

    @property
    def is_moe(self) -> bool:
        """True when the model has routed experts."""
        return self.n_expert > 0

    @property
    def weight_bytes(self) -> int:
        """Bytes of all tensors."""
        return sum(self.bytes_by_role.values())


# llama.cpp's default micro-batch (n_ubatch): the sliding-window cache keeps this many cells beyond the window
DEFAULT_UBATCH = 512
_SWA_PAD = 256  # llama.cpp pads the sliding-window cache to 256 cells (llama_kv_cache_iswa)


def swa_cells(info: ModelInfo, n_ctx: int, n_ubatch: int = DEFAULT_UBATCH) -> int:
    """Cells per sequence of a sliding-window layer's KV cache at ``n_ctx`` tokens per sequence: llama.cpp's
    ``llama_kv_cache_iswa`` keeps the window plus one micro-batch, padded to 256, never more than the context
    (``swa_full`` false, as llama-server and Flux's worker run). ``n_ctx`` when the model has no window."""
    return min(n_ctx, _window_cells(info, n_ubatch)) if info.n_swa else n_ctx


def _window_cells(info: ModelInfo, n_ubatch: int) -> int:
    """The window plus one micro-batch, padded to 256 cells."""
    return -(-(info.n_swa + n_ubatch) // _SWA_PAD) * _SWA_PAD


def kv_cache_bytes(info: ModelInfo, kv_type: str, n_ctx: int, n_seq: int = 1,
                   n_ubatch: int = DEFAULT_UBATCH) -> int:
    """Bytes of the KV cache llama.cpp allocates for ``n_seq`` sequences of ``n_ctx`` tokens each: the
    full-attention layers hold ``n_ctx`` cells per sequence, the sliding-window layers :func:`swa_cells`.

    The one place Flux turns KV bytes per token into bytes at a context: the memory model, GPU budgets and
    context sizing all call it. A hybrid's fixed recurrent state is not included (``recurrent_state_bytes``).
    """
    per_token = info.kv_bytes_per_token.get(kv_type, 0)
    swa = info.swa_kv_bytes_per_token.get(kv_type, 0)
    return ((per_token - swa) * n_ctx + swa * swa_cells(info, n_ctx, n_ubatch)) * n_seq


def kv_read_bytes(info: ModelInfo, kv_type: str, depth: float, n_ubatch: int = DEFAULT_UBATCH) -> float:
    """KV bytes one sequence's next token reads at ``depth`` tokens of context: every cell of the full-attention
    layers, at most the window-sized cache of the sliding-window ones."""
    per_token = info.kv_bytes_per_token.get(kv_type, 0)
    swa = info.swa_kv_bytes_per_token.get(kv_type, 0)
    return (per_token - swa) * depth + swa * min(depth, _window_cells(info, n_ubatch))


def block_bytes(info: ModelInfo) -> int:
    """Bytes of every layer's non-expert weights."""
    return sum(sum(v for k, v in layer.bytes_by_role.items() if not k.startswith("experts_")) for layer in info.layers)


def head_bytes(info: ModelInfo) -> int:
    """Bytes of the output head: the output matrix and the final norm, all read for every token."""
    return int(info.bytes_by_role.get("output", 0) + info.bytes_by_role.get("norm", 0) - sum(
        layer.bytes_by_role.get("norm", 0) for layer in info.layers))


def expert_bytes(info: ModelInfo) -> list[int]:
    """Bytes of one routed expert (gate + up + down) of each layer."""
    return [layer.expert_bytes // max(1, info.n_expert) for layer in info.layers]


def tensor_role(name: str) -> Role:
    """Return the role of a tensor, from llama.cpp's tensor naming conventions."""
    for pattern, role in _ROLE_RULES:
        if pattern.search(name):
            return role
    return "other"


def tensor_layer(name: str) -> int | None:
    """Return the block index in ``blk.N.*`` names, else None."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def shard_paths(path: Path) -> list[Path]:
    """Return every shard of a split GGUF (or just ``path``), checking that none is missing."""
    m = _SPLIT.match(path.name)
    if not m:
        return [path]
    n = int(m.group("n"))
    paths = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        raise ModelFileError(path, f"split model is missing shard(s) {', '.join(missing)}: download them")
    return paths


def supported_architectures(repo_root: Path | None = None) -> frozenset[str]:
    """Architectures the pinned llama.cpp implements (third_party/architectures.txt, made at build time)."""
    root = repo_root or Path(__file__).resolve().parents[1]
    lines = (root / "third_party" / "architectures.txt").read_text(encoding="utf-8").splitlines()
    return frozenset(x.strip() for x in lines if x.strip() and not x.startswith("#"))


# llama.cpp's names of rope scaling types (LLAMA_ROPE_SCALING_TYPES, src/llama-model.cpp): it stops on any other
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


def _int(md: dict[str, Any], key: str, default: int = 0) -> int:
    v = md.get(key, default)
    if isinstance(v, list):  # per-layer arrays (e.g. head_count_kv on some models): take the max
        return int(max(v)) if v else default
    return int(v)


def _vocab(md: dict[str, Any], arch: str) -> int:
    tokens = md.get("tokenizer.ggml.tokens")
    if isinstance(tokens, ArrayInfo):
        return tokens.length
    if isinstance(tokens, list):
        return len(tokens)
    return _int(md, f"{arch}.vocab_size")


def _head_dim(md: dict[str, Any], arch: str, which: str) -> int:
    n_head = _int(md, f"{arch}.attention.head_count")
    default = _int(md, f"{arch}.embedding_length") // n_head if n_head else 0
    return _int(md, f"{arch}.attention.{which}", default)


def _kv_layers(md: dict[str, Any], arch: str, n_layer: int) -> int:
    """Layers with a KV cache: every layer, or in a hybrid every ``full_attention_interval``-th one (llama.cpp:
    layer i is recurrent unless (i + 1) % interval == 0)."""
    interval = _int(md, f"{arch}.full_attention_interval")
    return sum(1 for i in range(n_layer) if (i + 1) % interval == 0) if interval > 0 else n_layer


def _recurrent_state(md: dict[str, Any], arch: str, n_layer: int) -> int:
    """f32 bytes of one sequence's recurrent state over the layers without a KV cache: the convolution's last
    (d_conv - 1) inputs of its channels (d_inner + 2 x groups x d_state) and the d_state x d_inner SSM state."""
    d_conv, d_state = _int(md, f"{arch}.ssm.conv_kernel"), _int(md, f"{arch}.ssm.state_size")
    d_inner, groups = _int(md, f"{arch}.ssm.inner_size"), _int(md, f"{arch}.ssm.group_count")
    if not (d_conv and d_state and d_inner):
        return 0
    per_layer = max(0, d_conv - 1) * (d_inner + 2 * groups * d_state) + d_state * d_inner
    return 4 * per_layer * (n_layer - _kv_layers(md, arch, n_layer))


def _kv_elements(md: dict[str, Any], arch: str, n_layer: int, n_swa_layers: int) -> tuple[int, int]:
    """KV elements per token of (every KV layer, the ``n_swa_layers`` sliding-window ones, whose head sizes are
    ``key_length_swa`` / ``value_length_swa`` where the header has them)."""
    n_kv = _int(md, f"{arch}.attention.head_count_kv", _int(md, f"{arch}.attention.head_count"))
    k, v = _head_dim(md, arch, "key_length"), _head_dim(md, arch, "value_length")
    swa = n_swa_layers * n_kv * (_int(md, f"{arch}.attention.key_length_swa", k)
                                 + _int(md, f"{arch}.attention.value_length_swa", v))
    return (_kv_layers(md, arch, n_layer) - n_swa_layers) * n_kv * (k + v) + swa, swa


def _by_kv_type(elements: int) -> dict[str, int]:
    return {t: int(round(elements * b)) for t, b in KV_TYPES.items()}


class _SwaRule(NamedTuple):
    """How an architecture's llama.cpp loader decides its sliding-window layers (src/models/<arch>.cpp)."""

    pattern: int  # load_swa_pattern's default n_pattern; 0: the per-layer sliding_window_pattern array is required
    dense_first: bool = False  # layer i is global iff i % pattern == 0 (else iff i % pattern == pattern - 1)
    when: Literal["key", "always", "unless_zero"] = "key"  # key: only with a sliding_window > 0 in the header
    default: int = 0  # the window without the key
    fixed: int = 0  # the window whatever the key says (llama4's 8192-token chunks, smallthinker's 4096)


# Architectures whose loader sets a sliding-window type llama.cpp gives a window-sized cache (llama_kv_cache_iswa
# through the generic memory path). Left out: gemma3n and gemma4 (layers that share another layer's cache),
# exaone4 (a window only at 64 layers), embedding models (symmetric windows), hybrids with windows.
_SWA_RULES: dict[str, _SwaRule] = {
    "gemma2": _SwaRule(2, when="always", default=4096),
    "gemma3": _SwaRule(6),
    "gpt-oss": _SwaRule(2, when="always"),
    "cohere2": _SwaRule(4, when="always"),
    "cohere2moe": _SwaRule(4, dense_first=True, when="always"),
    "exaone-moe": _SwaRule(4, when="always", default=128),
    "afmoe": _SwaRule(4),
    "mellum": _SwaRule(4),
    "olmo2": _SwaRule(4),
    "plamo3": _SwaRule(8),
    "laguna": _SwaRule(4, dense_first=True),
    "smallthinker": _SwaRule(4, dense_first=True, fixed=4096),
    "muse-glimmer": _SwaRule(4, when="always"),
    "llama4": _SwaRule(4, when="unless_zero", fixed=8192),
    **{a: _SwaRule(0, when="always") for a in ("granite-swa", "maple", "mimo2", "step35", "spark2_5")},
}


def swa_layer_ids(md: dict[str, Any], arch: str, n_layer: int) -> tuple[int, list[int]]:
    """(window, the layers that attend to it) as llama.cpp's loader decides them: the per-layer
    ``sliding_window_pattern`` array when the header has one, else its scalar or the architecture's default
    pattern (llama_hparams::set_swa_pattern). (0, []) for a model without sliding-window layers."""
    rule = _SWA_RULES.get(arch)
    key = md.get(f"{arch}.attention.sliding_window")
    window = int(max(key)) if isinstance(key, list) and key else int(key) if isinstance(key, (int, float)) else None
    if rule is None or (rule.when == "key" and not window) or (rule.when == "unless_zero" and window == 0):
        return 0, []
    window = rule.fixed or window or rule.default
    pattern = md.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        layers = [i for i, swa in enumerate(pattern[:n_layer]) if swa]
    elif isinstance(pattern, ArrayInfo) or (rule.pattern == 0 and pattern is None):
        return 0, []  # an array the header reader did not load, or a required one missing: llama.cpp refuses it
    else:
        n = int(pattern) if pattern is not None else rule.pattern
        layers = [i for i in range(n_layer) if n == 0 or (
            i % n != 0 if rule.dense_first else i % n < n - 1)]
    return (window, layers) if window and layers else (0, [])


def _summarize(tensors: list[TensorInfo], n_layer: int) -> tuple[dict[str, int], dict[str, int], list[LayerInfo]]:
    by_role: dict[str, int] = dict.fromkeys(ROLES, 0)
    quant: dict[str, int] = defaultdict(int)
    per_layer: list[dict[str, int]] = [defaultdict(int) for _ in range(n_layer)]
    for t in tensors:
        role = tensor_role(t.name)
        by_role[role] += t.n_bytes
        quant[t.ggml_type] += t.n_bytes
        layer = tensor_layer(t.name)
        if layer is not None and layer < n_layer:
            per_layer[layer][role] += t.n_bytes
    layers = [LayerInfo(index=i, bytes_by_role=dict(d)) for i, d in enumerate(per_layer)]
    return by_role, dict(quant), layers


def model_info(path: Path, supported: frozenset[str] | None = None) -> ModelInfo:
    """Read a model's header(s) and describe it; never loads weights.

    Args:
        path: a ``.gguf`` file, or any shard of a split model.
        supported: architectures to accept (default: the pinned llama.cpp's list).

    Raises:
        ModelFileError: not a GGUF, truncated, unknown version, missing shard, unreadable, a rope scaling
            type llama.cpp does not know.
    """
    paths = shard_paths(path)
    headers: list[GGUFHeader] = [read_header(p) for p in paths]
    md = headers[0].metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ModelFileError(path, "GGUF has no general.architecture: not a llama.cpp model file")
    scaling = md.get(f"{arch}.rope.scaling.type")
    if scaling is not None and scaling not in ROPE_SCALING_TYPES:
        raise ModelFileError(path, f"{arch}.rope.scaling.type is {scaling!r}, which llama.cpp does not know (it knows "
                                   f"{', '.join(ROPE_SCALING_TYPES)}): convert or download the model again")
    tensors = [t for h in headers for t in h.tensors]
    n_nextn = _int(md, f"{arch}.nextn_predict_layers", 0)  # next-token (MTP) blocks after the trunk
    n_layer = _int(md, f"{arch}.block_count") - n_nextn
    by_role, quant, layers = _summarize(tensors, n_layer)
    arch_ok = arch in (supported if supported is not None else supported_architectures())
    n_swa, swa_layers = swa_layer_ids(md, arch, n_layer)
    kv_elements, swa_elements = _kv_elements(md, arch, n_layer, len(swa_layers))
    info = ModelInfo(
        path=str(path), shards=[str(p) for p in paths], file_bytes=sum(h.file_bytes for h in headers),
        architecture=arch, supported=arch_ok, name=str(md.get("general.name", path.stem)),
        file_type=str(md.get("general.file_type", "")), n_params=sum(t.n_elements for t in tensors),
        n_layer=n_layer, n_embd=_int(md, f"{arch}.embedding_length"),
        n_head=_int(md, f"{arch}.attention.head_count"),
        n_head_kv=_int(md, f"{arch}.attention.head_count_kv", _int(md, f"{arch}.attention.head_count")),
        key_length=_head_dim(md, arch, "key_length"), value_length=_head_dim(md, arch, "value_length"),
        n_vocab=_vocab(md, arch), n_ctx_train=_int(md, f"{arch}.context_length"),
        n_expert=_int(md, f"{arch}.expert_count"), n_expert_used=_int(md, f"{arch}.expert_used_count"),
        bytes_by_role=by_role, quant_types=quant, layers=layers,
        kv_bytes_per_token=_by_kv_type(kv_elements),
        n_kv_layers=_kv_layers(md, arch, n_layer), recurrent_state_bytes=_recurrent_state(md, arch, n_layer),
        n_nextn_layers=n_nextn, n_swa=n_swa, n_swa_layers=len(swa_layers),
        swa_kv_bytes_per_token=_by_kv_type(swa_elements) if swa_layers else {},
    )
    at_train = {t: kv_cache_bytes(info, t, info.n_ctx_train) for t in info.kv_bytes_per_token}
    return info.model_copy(update={"kv_cache_bytes_train_ctx": at_train})


def read_tensors(path: Path) -> list[TensorInfo]:
    """Every tensor of a model (all shards), in file order."""
    return [t for p in shard_paths(path) for t in read_header(p).tensors]
