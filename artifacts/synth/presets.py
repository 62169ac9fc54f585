"""What a synthetic twin is: its spec and how a deep one is conditioned (the presets of real models are in
:mod:`artifacts.synth.catalog`, its tensor plan and tokenizer in :mod:`artifacts.synth.layout`).

`artifacts.synth` writes what these modules describe; they are declarative and cheap (planning a 17 GB twin
writes nothing), so sizes can be checked without writing files.

A `SynthSpec` holds the shapes llama.cpp's speed depends on (layers, widths, heads, experts, vocab) and
the standard deviations of the random weights, which decide whether a twin behaves like a model at
all: MoE routing that spreads tokens over the experts and logits that are not near-uniform.

Every twin carries the same kind of tokenizer, one llama.cpp accepts: a byte-level BPE (gpt2 model, qwen2
pre-tokenizer) with real merges and the ChatML control tokens, so text prompts and chat completions work.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

Arch = Literal["llama", "qwen3moe", "qwen3next", "qwen35moe", "minicpm", "gemma3"]
Quant = Literal["F16", "Q8_0", "Q4_0", "Q4_K"]
QUANTS: tuple[Quant, ...] = ("F16", "Q8_0", "Q4_0", "Q4_K")

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # bos/padding, -, eos
# ChatML as Qwen3's template renders it (thinking left out): tools in the system turn, assistant tool calls
# as Hermes-style <tool_call> JSON, tool results as <tool_response> in a user turn. Without tools it is
# plain ChatML; roles Qwen's template has no branch for are rendered as plain ChatML turns too.
CHATML = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with \
function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n\
</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if message.role == "system" and loop.first %}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# 256 byte tokens + <|endoftext|>, <|im_start|>, <|im_end|> + at least one merged token: below this
# llama.cpp's gpt2 tokenizer cannot be built.
MIN_VOCAB = 256 + 3 + 1


class SynthSpec(BaseModel):
    """Shapes and weight scales of a synthetic model.

    Shapes follow the model's config.json. For `arch="llama"` with experts (Mixtral), llama.cpp reads the
    expert width from `feed_forward_length`, so `n_ff` must equal `n_ff_exp`.

    `arch="qwen3next"` is a hybrid: every `full_attn_interval`-th layer is gated full attention with a KV
    cache, the others gated delta-net linear attention with a fixed-size recurrent state (the `ssm_*` fields,
    named as llama.cpp's hparams), and every layer has a sigmoid-gated shared expert of width `n_ff_shexp`.
    `arch="qwen35moe"` (Qwen3.5/3.6 MoE) is the same hybrid with separate delta-net alpha/beta projections and
    interleaved multi-section rope (`rope_sections`); its config has no dense FFN, so `n_ff` is 0 and
    `feed_forward_length` is left out, as the converter leaves it out.

    `arch="minicpm"` is a dense llama-like transformer with MiniCPM's muP scales (`scale_emb`, `scale_depth`,
    `dim_model_base`, written as llama.cpp's embedding, residual and logit scales) and, with `longrope`, the
    LongRoPE factor tensors.

    `arch="gemma3"` is Gemma 3's dense transformer: q/k norms, a norm after attention and after the GELU FFN,
    the embedding scaled by sqrt(n_embd) and tied to the output. With `n_swa` > 0 five of every six layers
    (llama.cpp's gemma3 pattern: layer i is global iff i % 6 == 5) attend to the last `n_swa` positions only,
    with their own rope base `rope_base_swa`, and llama.cpp keeps a window-sized KV cache for them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    arch: Arch
    n_layer: int = Field(ge=1)
    n_embd: int = Field(ge=1)
    n_head: int = Field(ge=1)
    n_head_kv: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    n_ff: int = Field(ge=0)  # 0: no dense FFN width in the config (qwen35moe), the key is not written
    n_expert: int = Field(default=0, ge=0)
    n_expert_used: int = Field(default=0, ge=0)
    n_ff_exp: int = Field(default=0, ge=0)
    n_vocab: int = Field(ge=MIN_VOCAB)
    n_ctx_train: int = Field(ge=1)
    rope_base: float = Field(gt=0)
    eps: float = Field(gt=0)
    tied: bool = False
    # Weight scales (std of the dequantized weights). A large embedding and a tiny attention output keep
    # the token-specific part of the residual stream dominant; without that attention, which averages
    # over positions, washes it out and every token is routed to the same experts.
    embd_std: float = Field(default=1.0, gt=0)
    weight_std: float = Field(default=0.02, gt=0)
    attn_out_std: float = Field(default=5e-4, gt=0)
    router_std: float = Field(default=0.02, gt=0)
    # Std of the FFN's and experts' down projections, the part of each layer that writes to the residual
    # stream (None: weight_std). Deep random models amplify rounding when each layer's update is large
    # next to the residual stream; a smaller one keeps a correct kernel change as small as in a real model.
    down_std: float | None = Field(default=None, gt=0)
    # The output layer's std is logit_std / sqrt(n_embd): the logits get about this std, so the next-token
    # distribution is peaked (KL between configs is sensitive) yet finite.
    logit_std: float = Field(default=4.0, gt=0)
    # Routing profile (artifacts.synth.routing): "uniform" keeps the random router; "skewed" scales its rows so
    # the busiest half of each layer's experts gets about routing_top_half of the picks; "local" is skewed and
    # has temporal locality: about routing_repeat of a token's picks were the previous token's too
    # (artifacts.synth.locality, qwen3moe twins); "domains" steers the prompts of each corpus domain (code, prose,
    # log, chat) to its own expert subset, two subsets' Jaccard index about routing_overlap, skewed within
    # (artifacts.synth.domains, qwen3moe twins).
    routing: Literal["uniform", "skewed", "local", "domains"] = "uniform"
    routing_top_half: float = Field(default=0.9, gt=0.5, lt=1.0)
    routing_repeat: float = Field(default=0.45, gt=0.0, lt=0.6)
    routing_overlap: float = Field(default=0.05, ge=0.0, lt=1.0)
    # Hybrid (qwen3next, qwen35moe) shapes; 0 everywhere else, and then left out of flux.synth.spec.
    n_rot: int = Field(default=0, ge=0)  # rotated dims per head (partial rope); 0: head_dim
    n_ff_shexp: int = Field(default=0, ge=0)  # shared expert width (shared_expert_intermediate_size)
    full_attn_interval: int = Field(default=0, ge=0)  # layer i has full attention iff (i + 1) % interval == 0
    ssm_d_conv: int = Field(default=0, ge=0)  # linear_conv_kernel_dim
    ssm_d_state: int = Field(default=0, ge=0)  # linear_key_head_dim (= linear_value_head_dim)
    ssm_n_group: int = Field(default=0, ge=0)  # linear_num_key_heads
    ssm_dt_rank: int = Field(default=0, ge=0)  # linear_num_value_heads
    # qwen35moe: rope_parameters.mrope_section padded to 4, as rope.dimension_sections (IMROPE); () elsewhere
    rope_sections: tuple[int, ...] = ()
    # minicpm (muP): the embedding is multiplied by scale_emb, each layer's attention and FFN output by
    # scale_depth / sqrt(n_layer), the logits divided by n_embd / dim_model_base; 0 elsewhere.
    scale_emb: float = Field(default=0.0, ge=0)
    scale_depth: float = Field(default=0.0, ge=0)
    dim_model_base: int = Field(default=0, ge=0)
    longrope: bool = False  # rope_scaling.rope_type longrope: rope_factors_long/short tensors, n_rot / 2 each
    # qwen35moe: next-token (MTP) blocks after the trunk (mtp_num_hidden_layers; llama.cpp runs one), written as
    # the converter writes them without --no-mtp; 0: left out, as with --no-mtp
    n_mtp: int = Field(default=0, ge=0, le=1)
    # gemma3: sliding_window (0: every layer attends to the whole context) and rope_local_base_freq, the rope base
    # of the sliding-window layers (written as rope.freq_base_swa); 0 elsewhere
    n_swa: int = Field(default=0, ge=0)
    rope_base_swa: float = Field(default=0.0, ge=0)

    def is_swa(self, layer: int) -> bool:
        """True when `layer` attends to a sliding window, as llama.cpp's gemma3 loader decides (its default
        sliding_window_pattern of 6, which the converter does not write: every sixth layer is global)."""
        return self.arch == "gemma3" and self.n_swa > 0 and layer % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1

    def is_recurrent(self, layer: int) -> bool:
        """True when `layer` is a linear-attention (recurrent) layer, as llama.cpp's hybrid loaders decide."""
        return self.arch in HYBRID_ARCHES and (layer + 1) % self.full_attn_interval != 0

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        """Reject shapes llama.cpp would refuse to load."""
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.n_expert_used > self.n_expert:
            raise ValueError(f"n_expert_used {self.n_expert_used} > n_expert {self.n_expert}")
        if self.n_expert and (self.n_expert_used < 1 or self.n_ff_exp < 1):
            raise ValueError("a MoE spec (n_expert > 0) needs n_expert_used >= 1 and n_ff_exp >= 1")
        if self.arch == "qwen3moe" and not self.n_expert:
            raise ValueError("arch qwen3moe needs n_expert > 0")
        if self.arch == "llama" and self.n_expert and self.n_ff != self.n_ff_exp:
            raise ValueError("llama MoE reads the expert width from n_ff: set n_ff == n_ff_exp")
        if self.routing != "uniform" and not self.n_expert:
            raise ValueError(f"routing={self.routing} needs experts (n_expert > 0)")
        if not self.n_ff and self.arch != "qwen35moe":
            raise ValueError(f"arch {self.arch} needs n_ff >= 1")
        misplaced = [k for k, arches in ARCH_FIELDS.items() if getattr(self, k) and self.arch not in arches]
        if misplaced:
            arches = sorted({a for k in misplaced for a in ARCH_FIELDS[k]})
            raise ValueError(f"{', '.join(misplaced)} apply to arch {' or '.join(arches)} only")
        if self.arch in HYBRID_ARCHES:
            _check_hybrid(self)
        if self.arch == "minicpm" and not (self.scale_emb and self.scale_depth and self.dim_model_base):
            raise ValueError("arch minicpm needs scale_emb, scale_depth and dim_model_base > 0")
        if self.arch == "minicpm" and self.n_expert:
            raise ValueError("arch minicpm twins are dense: set n_expert 0")
        if self.arch == "gemma3" and self.n_expert:
            raise ValueError("arch gemma3 twins are dense: set n_expert 0")
        return self


# The hybrid (gated delta-net + gated attention) architectures and their shape fields.
HYBRID_ARCHES: tuple[Arch, ...] = ("qwen3next", "qwen35moe")
HYBRID_FIELDS = (
    "n_rot", "n_ff_shexp", "full_attn_interval", "ssm_d_conv", "ssm_d_state", "ssm_n_group", "ssm_dt_rank",
)
# Field -> the architectures it applies to. Elsewhere it stays at its empty default and flux.synth.spec leaves
# it out, so twins made before the field existed keep their records, hence their bytes and hashes.
ARCH_FIELDS: dict[str, tuple[Arch, ...]] = {
    **dict.fromkeys(HYBRID_FIELDS, HYBRID_ARCHES),
    "rope_sections": ("qwen35moe",),
    "n_mtp": ("qwen35moe",),
    **dict.fromkeys(("scale_emb", "scale_depth", "dim_model_base", "longrope"), ("minicpm",)),
    **dict.fromkeys(("n_swa", "rope_base_swa"), ("gemma3",)),
}
# llama.cpp's gemma3 loader: load_swa_pattern(ml, 6), layer i is sliding-window iff i % 6 < 5
GEMMA3_SWA_PATTERN = 6


def _check_hybrid(spec: SynthSpec) -> None:
    """Reject hybrid (qwen3next, qwen35moe) shapes llama.cpp's loader or graph would refuse."""
    missing = [k for k in HYBRID_FIELDS if k != "n_rot" and not getattr(spec, k)]
    if missing or not spec.n_expert:
        raise ValueError(f"arch {spec.arch} needs n_expert and {', '.join(HYBRID_FIELDS[1:])} > 0")
    if spec.ssm_dt_rank % spec.ssm_n_group:
        raise ValueError(f"ssm_dt_rank {spec.ssm_dt_rank} is not a multiple of ssm_n_group {spec.ssm_n_group}")
    if spec.n_rot > spec.head_dim or spec.n_rot % 2:
        raise ValueError(f"n_rot {spec.n_rot} must be even and at most head_dim {spec.head_dim}")
    # qwen35moe's loader requires rope.dimension_sections; its sections split the rotated pairs (HF: 11+11+10 = 64/2)
    if spec.arch == "qwen35moe" and (len(spec.rope_sections) != 4 or 2 * sum(spec.rope_sections) != spec.n_rot):
        raise ValueError(f"arch qwen35moe needs 4 rope_sections summing to n_rot / 2, got {spec.rope_sections}")


# Deep twins are conditioned like a trained model: random layers whose updates are large next to the
# residual stream amplify rounding with depth (a correct flash-attention change: mean KL 1.1e-4 at 8 layers,
# 4.4e-3 at 48, where real models show < 1e-4) and near-tied expert choices flip, so every GPU placement looks
# wrong. RESIDUAL_DRIFT bounds how far all layers' FFN updates together move the unit-rms residual stream;
# DEEP_ATTN_OUT makes attention count (a KV-cache or rope error must show). Measured on a 48-layer
# qwen3moe-small twin (scripts/quality_floor.py, docs/quality-gate.md).
DEEP_LAYERS = 8
RESIDUAL_DRIFT = 0.15
DEEP_ATTN_OUT = 2e-3


def conditioned(**spec: Any) -> SynthSpec:
    """A spec whose down projections and attention output are scaled for its depth (above DEEP_LAYERS), and
    whose weights undo a minicpm's muP scales, so that its residual stream and logits behave like the others'."""
    base = SynthSpec(**spec)
    if base.n_layer > DEEP_LAYERS:
        per_layer = RESIDUAL_DRIFT / base.n_layer**0.5  # rms each layer's FFN adds to the residual stream
        # a SwiGLU output row has rms ~ 0.5 x sqrt(width) x std; routed experts are averaged over the k used
        if base.n_expert:
            down = per_layer * base.n_expert_used**0.5 / (0.5 * base.n_ff_exp**0.5)
        else:
            down = per_layer / (0.5 * base.n_ff**0.5)
        base = base.model_copy(update={"down_std": float(f"{down:.3g}"), "attn_out_std": DEEP_ATTN_OUT})
    if base.arch == "gemma3":
        return _undo_gemma_scale(base)
    return _undo_mup(base) if base.arch == "minicpm" else base


def _undo_gemma_scale(spec: SynthSpec) -> SynthSpec:
    """A gemma3 spec whose embedding is divided by the sqrt(n_embd) llama.cpp's gemma3 graph multiplies it by, so
    that its residual stream starts at embd_std like the other twins' (synth_layout sets the norms that write to it)."""
    return spec.model_copy(update={"embd_std": float(f"{spec.embd_std / spec.n_embd**0.5:.3g}")})


def _undo_mup(spec: SynthSpec) -> SynthSpec:
    """Scale a minicpm twin's weights by the inverse of llama.cpp's muP scales: the embedding by 1 / scale_emb,
    the layers' output projections by sqrt(n_layer) / scale_depth, the output layer by n_embd / dim_model_base.
    The graph multiplies them back, so the twin's activations are those of an unscaled twin."""
    residual = spec.scale_depth / spec.n_layer**0.5
    return spec.model_copy(update={
        "embd_std": float(f"{spec.embd_std / spec.scale_emb:.3g}"),
        "down_std": float(f"{(spec.down_std or spec.weight_std) / residual:.3g}"),
        "attn_out_std": float(f"{spec.attn_out_std / residual:.3g}"),
        "logit_std": spec.logit_std * spec.n_embd / spec.dim_model_base,
    })
