"""The presets of real models that `flux synth --like` writes twins of, each from its published config
(sources in docs/twins.md); what a spec means is in :mod:`artifacts.synth.presets`."""

from __future__ import annotations

from typing import Any

from artifacts.synth.presets import SynthSpec, conditioned

_QWEN3: dict[str, Any] = {"arch": "qwen3moe", "rope_base": 1e6, "eps": 1e-6}
_QWEN3NEXT: dict[str, Any] = {"arch": "qwen3next", "rope_base": 1e7, "eps": 1e-6}
_QWEN35MOE: dict[str, Any] = {"arch": "qwen35moe", "rope_base": 1e7, "eps": 1e-6, "n_ff": 0}
_GEMMA3: dict[str, Any] = {
    "arch": "gemma3", "rope_base": 1e6, "rope_base_swa": 1e4, "eps": 1e-6, "tied": True, "n_swa": 512,
    "n_ctx_train": 32768,
}
_MINICPM4: dict[str, Any] = {
    "arch": "minicpm", "rope_base": 1e4, "eps": 1e-6, "scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 256,
    "longrope": True,
}

PRESETS: dict[str, SynthSpec] = {
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": conditioned(
        **_QWEN3,
        n_layer=48,
        n_embd=2048,
        n_head=32,
        n_head_kv=4,
        head_dim=128,
        n_ff=6144,
        n_expert=128,
        n_expert_used=8,
        n_ff_exp=768,
        n_vocab=151936,
        n_ctx_train=40960,
    ),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (docs/twins.md): hidden_size 2048, num_hidden_layers 48,
    # full_attention_interval 4, num_attention_heads 16, num_key_value_heads 2, head_dim 256,
    # partial_rotary_factor 0.25 (n_rot 64, as the converter writes rope.dimension_count), intermediate_size
    # 5120, num_experts 512, num_experts_per_tok 10, moe_intermediate_size 512, shared_expert_intermediate_size
    # 512, linear_conv_kernel_dim 4, linear_key_head_dim = linear_value_head_dim 128, linear_num_key_heads 16,
    # linear_num_value_heads 32, vocab_size 151936, max_position_embeddings 262144, rms_norm_eps 1e-6;
    # rope_theta 1e7 (not seen in a config copy; shapes do not depend on it). Keys and tensors as
    # llama.cpp's conversion/qwen.py Qwen3NextModel writes them with --no-mtp (the MTP block is left out).
    "qwen3-next-80b-a3b": conditioned(
        **_QWEN3NEXT,
        n_layer=48,
        n_embd=2048,
        n_head=16,
        n_head_kv=2,
        head_dim=256,
        n_rot=64,
        n_ff=5120,
        n_expert=512,
        n_expert_used=10,
        n_ff_exp=512,
        n_ff_shexp=512,
        n_vocab=151936,
        n_ctx_train=262144,
        full_attn_interval=4,
        ssm_d_conv=4,
        ssm_d_state=128,
        ssm_n_group=16,
        ssm_dt_rank=32,
    ),
    # Qwen/Qwen3.6-35B-A3B config.json, text_config (docs/twins.md): hidden_size 2048, num_hidden_layers 40,
    # layer_types 3 x linear_attention + full_attention (full_attention_interval 4), num_attention_heads 16,
    # num_key_value_heads 2, head_dim 256, partial_rotary_factor 0.25 (n_rot 64), rope_parameters rope_theta 1e7
    # and mrope_section [11, 11, 10] (interleaved), num_experts 256, num_experts_per_tok 8, moe_intermediate_size
    # 512, shared_expert_intermediate_size 512, no intermediate_size, linear_conv_kernel_dim 4,
    # linear_key_head_dim = linear_value_head_dim 128, linear_num_key_heads 16, linear_num_value_heads 32,
    # vocab_size 248320, max_position_embeddings 262144, rms_norm_eps 1e-6, tie_word_embeddings false. Keys and
    # tensors as llama.cpp's conversion/qwen.py Qwen3_5MoeTextModel writes them with --no-mtp (its one MTP layer,
    # mtp_num_hidden_layers 1, is left out).
    "qwen3.6-35b-a3b": conditioned(
        **_QWEN35MOE,
        n_layer=40,
        n_embd=2048,
        n_head=16,
        n_head_kv=2,
        head_dim=256,
        n_rot=64,
        n_expert=256,
        n_expert_used=8,
        n_ff_exp=512,
        n_ff_shexp=512,
        n_vocab=248320,
        n_ctx_train=262144,
        full_attn_interval=4,
        ssm_d_conv=4,
        ssm_d_state=128,
        ssm_n_group=16,
        ssm_dt_rank=32,
        rope_sections=(11, 11, 10, 0),
    ),
    # openbmb/MiniCPM4-8B config.json (docs/twins.md): MiniCPMForCausalLM (llama.cpp arch minicpm), hidden_size
    # 4096, num_hidden_layers 32, num_attention_heads 32, num_key_value_heads 2 (head dim 128), intermediate_size
    # 16384, max_position_embeddings 32768, rms_norm_eps 1e-6, rope_scaling longrope (64 long / short factors),
    # vocab_size 73448; muP scale_emb 12, scale_depth 1.4, dim_model_base 256, rope_theta 1e4 (MiniCPM's
    # values, as in the MiniCPM4 configs read: docs/twins.md). Keys and tensors as conversion/minicpm.py's
    # MiniCPMModel writes them.
    "minicpm4-8b": conditioned(
        **_MINICPM4,
        n_layer=32,
        n_embd=4096,
        n_head=32,
        n_head_kv=2,
        head_dim=128,
        n_ff=16384,
        n_vocab=73448,
        n_ctx_train=32768,
    ),
    # google/gemma-3-270m config.json (docs/twins.md): Gemma3ForCausalLM (llama.cpp arch gemma3), hidden_size 640,
    # num_hidden_layers 18, layer_types 5 x sliding_attention + full_attention (llama.cpp's default pattern of 6),
    # sliding_window 512, num_attention_heads 4, num_key_value_heads 1, head_dim 256, intermediate_size 2048,
    # vocab_size 262144, max_position_embeddings 32768, rope_theta 1e6, rope_local_base_freq 1e4, rms_norm_eps
    # 1e-6, tie_word_embeddings true, no softcapping. Keys and tensors as conversion/gemma.py's Gemma3Model
    # writes them.
    "gemma3-270m": conditioned(
        **_GEMMA3,
        n_layer=18,
        n_embd=640,
        n_head=4,
        n_head_kv=1,
        head_dim=256,
        n_ff=2048,
        n_vocab=262144,
    ),
    # google/gemma-3-1b-it config.json: the same with hidden_size 1152, 26 layers, intermediate_size 6912.
    "gemma3-1b": conditioned(
        **_GEMMA3,
        n_layer=26,
        n_embd=1152,
        n_head=4,
        n_head_kv=1,
        head_dim=256,
        n_ff=6912,
        n_vocab=262144,
    ),
    # Llama-3.1-8B
    "llama3-8b": conditioned(
        arch="llama",
        n_layer=32,
        n_embd=4096,
        n_head=32,
        n_head_kv=8,
        head_dim=128,
        n_ff=14336,
        n_vocab=128256,
        n_ctx_train=131072,
        rope_base=500000.0,
        eps=1e-5,
    ),
    # Mixtral-8x7B-v0.1
    "mixtral-8x7b": conditioned(
        arch="llama",
        n_layer=32,
        n_embd=4096,
        n_head=32,
        n_head_kv=8,
        head_dim=128,
        n_ff=14336,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=14336,
        n_vocab=32000,
        n_ctx_train=32768,
        rope_base=1e6,
        eps=1e-5,
    ),
    # TinyLlama-1.1B
    "tinyllama-1.1b": conditioned(
        arch="llama",
        n_layer=22,
        n_embd=2048,
        n_head=32,
        n_head_kv=4,
        head_dim=64,
        n_ff=5632,
        n_vocab=32000,
        n_ctx_train=2048,
        rope_base=10000.0,
        eps=1e-5,
    ),
    # A Qwen3-MoE-shaped model of ~0.73 GB at Q4_0: big enough for a CPU benchmark, small enough for CI.
    "qwen3moe-small": SynthSpec(
        **_QWEN3,
        n_layer=8,
        n_embd=1024,
        n_head=16,
        n_head_kv=4,
        head_dim=64,
        n_ff=3072,
        n_expert=64,
        n_expert_used=8,
        n_ff_exp=768,
        n_vocab=32000,
        n_ctx_train=40960,
    ),
    # Load and routing tests (< 10 MB at every quant). tiny-moe's n_ff_exp=128 is not a multiple of 256,
    # so its ffn_down_exps exercises the K-quant fallback.
    "tiny-dense": SynthSpec(
        arch="llama",
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_ff=512,
        n_vocab=512,
        n_ctx_train=4096,
        rope_base=500000.0,
        eps=1e-5,
    ),
    "tiny-moe": SynthSpec(
        **_QWEN3,
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_ff=512,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=128,
        n_vocab=512,
        n_ctx_train=4096,
    ),
    # A qwen3next-shaped CI twin: layers 0-2 recurrent (gated delta-net), layer 3 full attention; value heads
    # twice the key heads and a quarter of each head rotated, as in Qwen3-Next-80B-A3B.
    "tiny-qwen3next": SynthSpec(
        **_QWEN3NEXT,
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_rot=16,
        n_ff=512,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=128,
        n_ff_shexp=128,
        n_vocab=512,
        n_ctx_train=4096,
        full_attn_interval=4,
        ssm_d_conv=4,
        ssm_d_state=32,
        ssm_n_group=4,
        ssm_dt_rank=8,
    ),
    # A minicpm-shaped CI twin: MiniCPM4-8B's muP scales and LongRoPE at 4 layers, one kv head per 4 query heads;
    # dim_model_base 16 keeps MiniCPM4-8B's logit scale n_embd / dim_model_base = 16.
    "tiny-minicpm": conditioned(
        **(_MINICPM4 | {"dim_model_base": 16}),
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=1,
        head_dim=64,
        n_ff=512,
        n_vocab=512,
        n_ctx_train=4096,
    ),
    # A gemma3-shaped CI twin: Gemma 3's sliding window (512) and pattern (layers 0-4, 6, 7 local; 5 global), one
    # kv head, tied output, its 32768-token context, at 8 layers.
    "tiny-gemma3": conditioned(
        **_GEMMA3,
        n_layer=8,
        n_embd=256,
        n_head=4,
        n_head_kv=1,
        head_dim=64,
        n_ff=512,
        n_vocab=512,
    ),
    # A qwen35moe-shaped CI twin: tiny-qwen3next's shapes with Qwen3.5's separate alpha/beta projections and
    # interleaved rope sections in Qwen3.6-35B-A3B's proportions (11:11:10 of the rotated pairs -> 3:3:2 of 8).
    "tiny-qwen35moe": SynthSpec(
        **_QWEN35MOE,
        n_layer=4,
        n_embd=256,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_rot=16,
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=128,
        n_ff_shexp=128,
        n_vocab=512,
        n_ctx_train=4096,
        full_attn_interval=4,
        ssm_d_conv=4,
        ssm_d_state=32,
        ssm_n_group=4,
        ssm_dt_rank=8,
        rope_sections=(3, 3, 2, 0),
    ),
}
