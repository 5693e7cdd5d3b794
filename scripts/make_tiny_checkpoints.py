"""Write tiny randomly initialised Hugging Face checkpoints and their reference outputs.

Dev-only (needs torch + transformers; see tests/goldens/README.md for the virtualenv):

    /work/venv-golden/bin/python scripts/make_tiny_checkpoints.py [--out tests/fixtures/tiny]

For each family a folder with config.json, model.safetensors (or shards + index), a small byte-level BPE
tokenizer.json/tokenizer_config.json (with a chat template) and generation_config.json, plus golden.json:
the token ids fed, float32 logits at every position (rounded to 5 decimals) and 8 greedy tokens computed by
transformers itself. Hearth's tests load these folders through its own safetensors path and compare.
The embedding models (bert-embed, qwen3-embed) hold embedding_golden.json instead: pooled last hidden states.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

ROOT = Path(__file__).resolve().parents[1]
TOKENS = [5, 17, 42, 99, 3, 250, 77, 1, 300, 8, 120, 64, 33, 2, 181, 9]
LONG_TOKENS = [(7 * i + 3) % 300 + 3 for i in range(80)]
VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)

# Qwen3.5's tiny layout (qwen3_5 and qwen3_5_moe): 8-wide DeltaNet heads, 2 key heads serving 4 value heads
_QWEN35 = dict(
    tie_word_embeddings=False, num_hidden_layers=4, head_dim=16, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, pad_token_id=0,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
                         mrope_section=[1, 1, 0], mrope_interleaved=True),
)

# Gemma 4's tiny layout: 16-wide heads on the windowed layers, 32-wide on the global ones
_GEMMA4 = dict(
    head_dim=16, global_head_dim=32, sliding_window=4, final_logit_softcapping=30.0, pad_token_id=0,
    tie_word_embeddings=True,
)

FAMILIES_GRANITE4H = dict(
    tie_word_embeddings=True, num_hidden_layers=4,
    layer_types=["linear_attention", "attention", "linear_attention", "linear_attention"],
    num_local_experts=0, shared_intermediate_size=96, position_embedding_type="nope",
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
    mamba_expand=2, mamba_chunk_size=8, embedding_multiplier=3.0, residual_multiplier=0.5,
    attention_multiplier=0.2, logits_scaling=2.0, pad_token_id=0,
)

# family -> (config class, extra config, dtype written, shard the weights)
FAMILIES = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=True), torch.float32, False),
    "llama3-scaled": (
        transformers.LlamaConfig,
        dict(
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
        torch.bfloat16,
        True,
    ),
    "mistral": (
        transformers.MistralConfig,
        dict(tie_word_embeddings=False, sliding_window=None),
        torch.float16,
        False,
    ),
    # Mistral v0.1's sliding window (4 here, on every layer): the golden's 16 tokens and 8 greedy ones pass it
    "mistral-swa": (
        transformers.MistralConfig,
        dict(tie_word_embeddings=False, sliding_window=4),
        torch.float32,
        False,
    ),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True), torch.float32, False),
    "qwen3": (transformers.Qwen3Config, dict(tie_word_embeddings=True, head_dim=32), torch.bfloat16, False),
    # YaRN (Qwen's long-context setting): trained on 64 positions, stretched 4x; the golden's 16 tokens
    # sit inside, so the interpolated frequencies and the attention factor both show
    "qwen3-yarn": (
        transformers.Qwen3Config,
        dict(
            tie_word_embeddings=True,
            head_dim=32,
            max_position_embeddings=256,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                 original_max_position_embeddings=64),
        ),
        torch.float32,
        False,
    ),
    "phi3": (transformers.Phi3Config, dict(tie_word_embeddings=False, pad_token_id=0), torch.float32, True),
    # Phi-4-mini's RoPE: LongRoPE factors (trained on 64 positions, 256 declared: the long factors and an
    # attention factor) on 3/4 of each head; the golden's second sequence (LONG_TOKENS) passes 64 positions
    "phi3-longrope": (
        transformers.Phi3Config,
        dict(
            tie_word_embeddings=False,
            pad_token_id=0,
            max_position_embeddings=256,
            original_max_position_embeddings=64,
            partial_rotary_factor=0.75,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                short_factor=[1.0 + 0.05 * i for i in range(6)],
                long_factor=[1.0 + 0.9 * i for i in range(6)],
                original_max_position_embeddings=64,
            ),
        ),
        torch.float32,
        False,
    ),
    # mixture of experts: 4 experts, 2 a token (Qwen3-MoE renormalizes the two's weights, as its releases do)
    "qwen3moe": (
        transformers.Qwen3MoeConfig,
        dict(tie_word_embeddings=False, head_dim=32, num_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=48, norm_topk_prob=True),
        torch.bfloat16,
        False,
    ),
    # SmolLM3: RoPE left out of every fourth layer (4 layers: the last one)
    "smollm3": (
        transformers.SmolLM3Config, dict(tie_word_embeddings=True, num_hidden_layers=4, pad_token_id=0),
        torch.bfloat16,
        False,
    ),
    # Granite 3: scaled embeddings, residual branches, attention scores and logits
    "granite": (
        transformers.GraniteConfig,
        dict(tie_word_embeddings=True, embedding_multiplier=6.0, residual_multiplier=0.3,
             attention_multiplier=0.15, logits_scaling=4.0, pad_token_id=0),
        torch.bfloat16,
        False,
    ),
    # Granite 4.0 Micro: Granite's multipliers in a granitemoehybrid config with attention layers only, no
    # experts, and its FFN as the fused "shared MLP"
    "granite4": (
        transformers.GraniteMoeHybridConfig,
        dict(tie_word_embeddings=True, layer_types=["attention", "attention"], num_local_experts=0,
             shared_intermediate_size=96, position_embedding_type="rope", embedding_multiplier=3.0,
             residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0, pad_token_id=0),
        torch.bfloat16,
        False,
    ),
    # Granite 4.0-H (hybrid): Mamba-2 in three layers of four (2 groups of B and C for 8 heads of 16), the
    # other attending without positions; Granite's multipliers
    "granite4-h": (transformers.GraniteMoeHybridConfig, FAMILIES_GRANITE4H, torch.bfloat16, False),
    # Granite 4.0-H Tiny / Small's layout: the same with 4 routed experts (softmax over the chosen 2) beside
    # the shared MLP in every layer
    "granite4-h-moe": (
        transformers.GraniteMoeHybridConfig,
        dict(FAMILIES_GRANITE4H, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
        torch.bfloat16,
        False,
    ),
    # Nemotron-H (dense): each block one mixer, Mamba-2 (8 heads of 16, 2 groups), attention without positions
    # or a squared-ReLU MLP
    "nemotron_h": (
        transformers.NemotronHConfig,
        dict(tie_word_embeddings=False, hybrid_override_pattern="M-*M-", head_dim=16, ssm_state_size=16,
             mamba_num_heads=8, mamba_head_dim=16, n_groups=2, conv_kernel=4, chunk_size=8,
             layer_norm_epsilon=1e-5, num_hidden_layers=5),
        torch.bfloat16,
        False,
    ),
    # GLM-4: norms of each branch's output, half of each head rotated in adjacent pairs, fused gate|up,
    # QKV biases
    "glm4": (
        transformers.Glm4Config,
        dict(tie_word_embeddings=False, head_dim=16, partial_rotary_factor=0.5, attention_bias=True,
             pad_token_id=0),
        torch.bfloat16,
        False,
    ),
    # OLMo 2: norms of the branch outputs only, q/k norms over the whole projections
    "olmo2": (
        transformers.Olmo2Config, dict(tie_word_embeddings=False, pad_token_id=0), torch.bfloat16, False
    ),
    # ERNIE 4.5 (dense): adjacent-pair RoPE on whole heads
    "ernie4_5": (
        transformers.Ernie4_5Config, dict(tie_word_embeddings=True, head_dim=16), torch.bfloat16, False
    ),
    # ERNIE 4.5 MoE (ERNIE-4.5-21B-A3B's layout): adjacent-pair RoPE on whole heads, a dense first layer
    # (moe_layer_start_index), then experts every other layer (moe_layer_interval 2: layers 1 and 3, layer 2
    # dense); 6 routed experts, 3 a token, chosen by softmax probability plus a per-expert bias
    # (moe_statics.e_score_correction_bias, a parameter: random like the weights) and weighted by the
    # probability alone, renormalized; beside 2 shared experts (one SwiGLU of 2 x 32)
    "ernie4_5_moe": (
        transformers.Ernie4_5_MoeConfig,
        dict(tie_word_embeddings=True, num_hidden_layers=4, moe_num_experts=6, moe_k=3,
             moe_intermediate_size=32, moe_num_shared_experts=2, moe_layer_start_index=1,
             moe_layer_interval=2, pad_token_id=0),
        torch.bfloat16,
        False,
    ),
    # OLMo 3: a window of 4 on three layers of four, YaRN on the full layer only (the windowed ones unscaled)
    "olmo3": (
        transformers.Olmo3Config,
        dict(tie_word_embeddings=False, pad_token_id=0, num_hidden_layers=4, sliding_window=4,
             rope_parameters={
                 "full_attention": dict(rope_type="yarn", rope_theta=50000.0, factor=4.0,
                                        original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0),
                 "sliding_attention": dict(rope_type="default", rope_theta=50000.0)}),
        torch.bfloat16,
        False,
    ),
    # GLM-4.5 (MoE): a dense first layer, then 4 routed experts (2 a token, sigmoid scores plus a choice bias,
    # scaled by 2.5) beside an ungated shared expert; half of each head rotated; q/k norms; QKV biases
    "glm4moe": (
        transformers.Glm4MoeConfig,
        dict(tie_word_embeddings=False, num_hidden_layers=3, head_dim=16, partial_rotary_factor=0.5,
             attention_bias=True, use_qk_norm=True, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, moe_intermediate_size=48, first_k_dense_replace=1, routed_scaling_factor=2.5,
             n_group=1, topk_group=1, norm_topk_prob=True, pad_token_id=0),
        torch.bfloat16,
        False,
    ),
    # DeepSeek-V2-Lite's layout: multi-head latent attention without a q LoRA (plain q_proj), YaRN with
    # DeepSeek's mscale and mscale_all_dim, a dense first layer, then 8 routed experts in 4 groups (softmax
    # scores, 2 experts a token from the one group with the best expert, not renormalized, times 1.5; with
    # as many groups as experts a token the limit would change nothing) beside a shared expert
    "deepseek_v2": (
        transformers.DeepseekV2Config,
        dict(tie_word_embeddings=False, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=None,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
             num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
             topk_method="group_limited_greedy", n_group=4, topk_group=1, routed_scaling_factor=1.5,
             norm_topk_prob=False, pad_token_id=0,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
                                  mscale=0.707, mscale_all_dim=0.707)),
        torch.bfloat16,
        False,
    ),
    # DeepSeek-V3's layout (Moonlight): q LoRA with its norm, interleaved RoPE pairs, a dense first layer,
    # then sigmoid routing over 8 experts with a choice bias, limited to the best 2 of 4 groups (by the sum of
    # each group's top two), renormalized and scaled by 2.5, beside a shared expert
    "deepseek_v3": (
        transformers.DeepseekV3Config,
        dict(tie_word_embeddings=False, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
             num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
             n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, pad_token_id=0,
             rope_interleave=True),
        torch.bfloat16,
        False,
    ),
    # GLM-4.7-Flash's layout (glm4_moe_lite): DeepSeek-V3's with values wider than the keys' unrotated part,
    # one expert group, 2 shared experts
    "glm4_moe_lite": (
        transformers.Glm4MoeLiteConfig,
        dict(tie_word_embeddings=False, num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=24,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=4,
             num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=32, n_group=1, topk_group=1,
             routed_scaling_factor=1.8, norm_topk_prob=True, pad_token_id=0, rope_interleave=True),
        torch.bfloat16,
        False,
    ),
    # EXAONE 4: norms of the branch outputs only, per-head q/k norms, a window of 4 on three layers of four,
    # RoPE only in those
    "exaone4": (
        transformers.Exaone4Config,
        dict(tie_word_embeddings=False, num_hidden_layers=4, head_dim=16, sliding_window=4,
             sliding_window_pattern=4, pad_token_id=0),
        torch.bfloat16,
        False,
    ),
    # Command R7B / Command A: attention and FFN side by side from one LayerNorm (no bias), a window of 4 on
    # three layers of four which alone rotate (adjacent pairs), logits times logit_scale, tied embeddings;
    # digits split one by one before the byte-level BPE (llama.cpp's command-r pre-tokenizer)
    "cohere2": (
        transformers.Cohere2Config,
        dict(tie_word_embeddings=True, num_hidden_layers=4, sliding_window=4, logit_scale=0.25,
             layer_norm_eps=1e-5, pad_token_id=0),
        torch.bfloat16,
        False,
    ),
    # Command R(+): Cohere's parallel block with RoPE (adjacent pairs) in every layer, no window; Command R+'s
    # LayerNorm of q and k per head with weights per head
    "cohere": (
        transformers.CohereConfig,
        dict(tie_word_embeddings=True, logit_scale=0.125, layer_norm_eps=1e-5, use_qk_norm=True,
             pad_token_id=0),
        torch.float16,
        False,
    ),
    # Seed-OSS: a llama with QKV biases (and an output bias the releases leave off: here on, to test it)
    "seed_oss": (
        transformers.SeedOssConfig,
        dict(tie_word_embeddings=False, head_dim=16, attention_bias=True, attention_out_bias=True,
             pad_token_id=0),
        torch.bfloat16,
        False,
    ),
    # Qwen2-MoE: 4 routed experts (2 a token, not renormalized, as Qwen1.5-MoE and Qwen2-57B-A14B) beside a
    # gated shared expert; QKV biases
    "qwen2moe": (
        transformers.Qwen2MoeConfig,
        dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
             shared_expert_intermediate_size=64, norm_topk_prob=False, qkv_bias=True),
        torch.bfloat16,
        False,
    ),
    # Ministral 3: YaRN (mscale over mscale_all_dim) and Llama 4's query temperature, here over an original
    # context of 4 so that it grows within the 16 tokens
    "ministral3": (
        transformers.Ministral3Config,
        dict(tie_word_embeddings=False, head_dim=16, pad_token_id=0,
             rope_parameters=dict(rope_type="yarn", rope_theta=1000000.0, factor=16.0,
                                  original_max_position_embeddings=4, beta_fast=32.0, beta_slow=1.0,
                                  mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.5)),
        torch.bfloat16,
        False,
    ),
    # Qwen3.5 (dense text): gated DeltaNet layers (a causal convolution of 4 over q|k|v, l2-normed q and k,
    # decay and write strength per value head, a norm gated by z) in three layers of four, the fourth full
    # attention with an output gate and RoPE on a quarter of each head; norms scale by 1 + w
    "qwen3_5": (transformers.Qwen3_5TextConfig, _QWEN35, torch.bfloat16, False),
    # Qwen3.5-MoE (Qwen3.5-35B-A3B's layout): Qwen3.5's layers with 4 routed experts (2 a token, renormalized)
    # beside a gated shared expert in every layer
    "qwen3_5_moe": (
        transformers.Qwen3_5MoeTextConfig,
        dict(_QWEN35, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
             shared_expert_intermediate_size=64),
        torch.bfloat16,
        False,
    ),
    # Qwen3-Next (Qwen3-Next-80B-A3B's layout): Qwen3.5-MoE's layers with the DeltaNet's input projections
    # fused per key head (in_proj_qkvz: q, k, then its value heads' v and z; in_proj_ba: b, then a), plain
    # RoPE on a quarter of each head, and here a dense MLP in layer 1 (mlp_only_layers)
    "qwen3_next": (
        transformers.Qwen3NextConfig,
        dict(tie_word_embeddings=False, num_hidden_layers=4, head_dim=16, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, pad_token_id=0,
             rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25),
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
             shared_expert_intermediate_size=64, mlp_only_layers=[1]),
        torch.bfloat16,
        False,
    ),
    # LFM2: gated short convolutions (kernel 3) in place of attention in three layers of four, per-head q/k
    # norms; the FFN length adjusted as LFM2's config asks (2/3 of 96, rounded up to a multiple of 32)
    "lfm2": (
        transformers.Lfm2Config,
        dict(tie_word_embeddings=True, num_hidden_layers=4, norm_eps=1e-6, block_multiple_of=32,
             layer_types=["conv", "full_attention", "conv", "conv"], pad_token_id=0),
        torch.bfloat16,
        False,
    ),
    # LFM2-MoE (LFM2-8B-A1B): LFM2's layers, a dense FFN in the first, then 4 experts (2 a token, sigmoid
    # scores plus a choice bias, renormalized)
    "lfm2moe": (
        transformers.Lfm2MoeConfig,
        dict(tie_word_embeddings=True, num_hidden_layers=4, norm_eps=1e-6, num_dense_layers=1, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=48, use_expert_bias=True,
             layer_types=["conv", "full_attention", "conv", "conv"], pad_token_id=0),
        torch.bfloat16,
        False,
    ),
    "mixtral": (
        transformers.MixtralConfig,
        dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        torch.float16,
        True,
    ),
    # Gemma 2: soft-capped attention (every layer) and logits, a window of 4 on every other layer
    "gemma2": (
        transformers.Gemma2Config,
        dict(head_dim=32, sliding_window=4, pad_token_id=0, attn_logit_softcapping=50.0,
             final_logit_softcapping=30.0, query_pre_attn_scalar=32),
        torch.bfloat16,
        False,
    ),
    # gpt-oss: attention sinks, biases, a window of 4 on the even layers, YaRN unrounded (trained on 64),
    # 4 experts (2 a token, clamped SwiGLU); expert weights on the MXFP4 grid, so that "gpt-oss" (experts
    # as MXFP4 blocks, OpenAI's layout) and "gpt-oss-bf16" (the same numbers, dequantized) share a golden
    "gpt-oss-bf16": (
        transformers.GptOssConfig,
        dict(tie_word_embeddings=False, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=4, swiglu_limit=1.5,
             rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0,
                                  beta_slow=1.0, truncate=False, original_max_position_embeddings=64)),
        torch.bfloat16,
        False,
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            head_dim=32, sliding_window=4, layer_types=["sliding_attention", "full_attention"], pad_token_id=0
        ),
        torch.bfloat16,
        False,
    ),
    # Gemma 4, E2B-style: per-layer embeddings, the last 2 layers reusing earlier layers' keys and values
    # (their MLPs double-wide), global layers with their own head size and proportional RoPE, logit capping
    "gemma4": (
        transformers.Gemma4TextConfig,
        dict(_GEMMA4, num_hidden_layers=5, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
             num_kv_shared_layers=2, use_double_wide_mlp=True,
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                          "full_attention"]),
        torch.bfloat16,
        False,
    ),
    # Gemma 3n, E2B-style: 4 AltUp streams, LAuReL, per-layer embeddings over a table shorter than the
    # vocabulary (ids past it take row 0's), the first 2 layers' gate activations sparsified, the last 2
    # layers reusing the last earlier windowed and global layers' keys and values, logit capping
    "gemma3n": (
        transformers.Gemma3nTextConfig,
        dict(head_dim=16, sliding_window=4, final_logit_softcapping=30.0, pad_token_id=0, num_hidden_layers=6,
             hidden_size_per_layer_input=8, vocab_size_per_layer_input=300, laurel_rank=8,
             num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0, 0.0],
             layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                          "sliding_attention", "full_attention"]),
        torch.bfloat16,
        False,
    ),
    # Gemma 4, 26B-A4B-style: a dense MLP and 4 routed experts side by side in every layer; the global layers'
    # values are their keys (attention_k_eq_v) with fewer KV heads
    "gemma4-moe": (
        transformers.Gemma4TextConfig,
        dict(_GEMMA4, num_hidden_layers=3, hidden_size_per_layer_input=0, attention_k_eq_v=True,
             num_global_key_value_heads=1, enable_moe_block=True, num_experts=4, top_k_experts=2,
             moe_intermediate_size=32,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
        torch.bfloat16,
        False,
    ),
}

# multimodal folders (a vision tower beside the language model; Hearth reads the language model): family ->
# (config class, text config, vision config); the text config is COMMON plus these
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               image_size=28, patch_size=14)
# the Qwen vision fixtures' tower (4 px patches, two frames, merged 2x2, a 4x4 position grid), image
# tokens and M-RoPE (interleaved sections over half of each head)
_QWEN_VISION = dict(hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
                    spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
_QWEN_VISION_TOKENS = dict(image_token_id=317, vision_start_token_id=318, vision_end_token_id=319,
                           video_token_id=316)
_MROPE_HALF = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                   mrope_section=[3, 3, 2], mrope_interleaved=True)
MULTIMODAL = {
    "gemma3-mm": (
        transformers.Gemma3Config,
        dict(model_type="gemma3_text", head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
             pad_token_id=0, layer_types=["sliding_attention", "full_attention"]),
        dict(_VISION),
        dict(mm_tokens_per_image=4, image_token_index=317, boi_token_index=318, eoi_token_index=319),
    ),
    # Gemma 3 with a vision tower Hearth runs: 4x4 patches pooled 2x2 into 4 image tokens, two SigLIP layers,
    # a window shorter than the prompt before an image; golden_vision.json holds a prompt with two images
    "gemma3-vision": (
        transformers.Gemma3Config,
        dict(model_type="gemma3_text", head_dim=32, query_pre_attn_scalar=32, sliding_window=6,
             pad_token_id=0, layer_types=["sliding_attention", "full_attention"]),
        dict(_VISION, image_size=56, num_hidden_layers=2),
        dict(mm_tokens_per_image=4, image_token_index=317, boi_token_index=318, eoi_token_index=319),
    ),
    # Gemma 4 E2B's layout (Gemma4ForConditionalGeneration): the language model under model.language_model,
    # beside a vision tower (no audio tower here)
    "gemma4-mm": (
        transformers.Gemma4Config,
        dict(FAMILIES["gemma4"][1], model_type="gemma4_text"),
        dict(_VISION, model_type="gemma4_vision", head_dim=16, num_key_value_heads=2, patch_size=4,
             pooling_kernel_size=2, position_embedding_size=64),
        dict(audio_config=None, image_token_id=317, boi_token_id=318, eoi_token_id=319),
    ),
    # Gemma 4 E2B-style with a vision tower Hearth runs: patches of 4 px pooled 2x2, two encoder layers with
    # clipped linears and standardized outputs, image rows attending both ways on the windowed layers
    # (use_bidirectional_attention "vision"); golden_vision.json holds a prompt with two images of different
    # sizes
    "gemma4-vision": (
        transformers.Gemma4Config,
        dict(FAMILIES["gemma4"][1], model_type="gemma4_text", use_bidirectional_attention="vision",
             max_position_embeddings=512),
        dict(_VISION, model_type="gemma4_vision", head_dim=16, num_key_value_heads=2, patch_size=4,
             num_hidden_layers=2, pooling_kernel_size=2, position_embedding_size=64, use_clipped_linears=True,
             standardize=True),
        dict(audio_config=None, image_token_id=317, boi_token_id=318, eoi_token_id=319),
    ),
    # the same as E2B / E4B ship it: use_bidirectional_attention unset, so image rows attend causally
    "gemma4-vision-causal": (
        transformers.Gemma4Config,
        dict(FAMILIES["gemma4"][1], model_type="gemma4_text", max_position_embeddings=512),
        dict(_VISION, model_type="gemma4_vision", head_dim=16, num_key_value_heads=2, patch_size=4,
             num_hidden_layers=2, pooling_kernel_size=2, position_embedding_size=64, use_clipped_linears=True,
             standardize=True),
        dict(audio_config=None, image_token_id=317, boi_token_id=318, eoi_token_id=319),
    ),
    # Mistral Small 3.1-style: a Pixtral tower (2D RoPE, gated MLP), patches merged 2x2, a GELU projector;
    # golden_vision.json holds a prompt with two images of different sizes
    "mistral3-vision": (
        transformers.Mistral3Config,
        dict(model_type="mistral", head_dim=16, rms_norm_eps=1e-5),
        dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, head_dim=16, image_size=84, patch_size=14, hidden_act="silu"),
        dict(image_token_index=317, spatial_merge_size=2, multimodal_projector_bias=True),
    ),
    # Qwen3.5 with its vision tower (Qwen3_5ForConditionalGeneration): 4 px patches (a 3D convolution over two
    # copies of the image), a learned 4x4 position grid resampled to each image, 2D rotary, merged 2x2; the
    # text model's M-RoPE turns pairs by (t, h, w) interleaved, every axis in use; golden_vision.json holds a
    # prompt with two images of different sizes
    "qwen3_5-vision": (
        transformers.Qwen3_5Config,
        dict(_QWEN35, model_type="qwen3_5_text", head_dim=32, rope_parameters=_MROPE_HALF),
        dict(_QWEN_VISION, model_type="qwen3_5_vision", depth=2),
        dict(_QWEN_VISION_TOKENS),
    ),
    # Qwen3.5-MoE with the same vision tower (Qwen3_5MoeForConditionalGeneration): qwen3_5-vision's tower and
    # M-RoPE over qwen3_5_moe's text layers; golden_vision.json as qwen3_5-vision's
    "qwen3_5_moe-vision": (
        transformers.Qwen3_5MoeConfig,
        dict(FAMILIES["qwen3_5_moe"][1], model_type="qwen3_5_moe_text", head_dim=32,
             rope_parameters=_MROPE_HALF),
        dict(_QWEN_VISION, model_type="qwen3_5_moe_vision", depth=2),
        dict(_QWEN_VISION_TOKENS),
    ),
    # Qwen3-VL (Qwen3VLForConditionalGeneration): qwen3_5-vision's tower with deepstack mergers after blocks 0
    # and 1 of 3, whose rows join the image rows after text layers 0 and 1 (of 2); Qwen3 text layers with
    # M-RoPE (interleaved sections, every axis in use); golden_vision.json as qwen3_5-vision's
    "qwen3_vl-vision": (
        transformers.Qwen3VLConfig,
        dict(model_type="qwen3_vl_text", head_dim=16, pad_token_id=0,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2],
                                  mrope_interleaved=True)),
        dict(_QWEN_VISION, model_type="qwen3_vl_vision", depth=3, deepstack_visual_indexes=[0, 1]),
        dict(_QWEN_VISION_TOKENS, tie_word_embeddings=False),
    ),
    # Qwen3-VL-MoE (Qwen3VLMoeForConditionalGeneration, Qwen3-VL-30B-A3B's layout): qwen3_vl-vision's tower
    # and M-RoPE, its deepstack mergers after blocks 1 and 2 (so a merger's index and its block's differ),
    # over Qwen3-MoE text layers of 4 experts (2 a token, renormalized), each layer's experts kept in two
    # fused tensors (gate_up_proj, down_proj); golden_vision.json as qwen3_5-vision's
    "qwen3_vl_moe-vision": (
        transformers.Qwen3VLMoeConfig,
        dict(model_type="qwen3_vl_moe_text", head_dim=16, pad_token_id=0, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=48,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[3, 3, 2],
                                  mrope_interleaved=True)),
        dict(_QWEN_VISION, model_type="qwen3_vl_moe_vision", depth=3, deepstack_visual_indexes=[1, 2]),
        dict(_QWEN_VISION_TOKENS, tie_word_embeddings=False),
    ),
    # Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): Qwen2 text layers (QKV biases) with M-RoPE in sections
    # one after another (t, h, w pairs in a row); a tower of 3 RMSNorm blocks with gated SiLU MLPs, windows
    # of 16 px (2 x 2 merged rows, so each image spans several) in blocks 0 and 2, block 1 attending over the
    # whole image; golden_vision.json as qwen3_5-vision's
    "qwen2_5_vl-vision": (
        transformers.Qwen2_5_VLConfig,
        dict(model_type="qwen2_5_vl_text", pad_token_id=0,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
        dict(hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
             spatial_merge_size=2, out_hidden_size=64, model_type="qwen2_5_vl_vision", depth=3,
             hidden_act="silu", window_size=16, fullatt_block_indexes=[1]),
        dict(_QWEN_VISION_TOKENS, tie_word_embeddings=False),
    ),
    # Qwen2-VL (Qwen2VLForConditionalGeneration): qwen2_5_vl-vision's text layers and M-RoPE; a tower of 2
    # LayerNorm blocks (embed_dim 32) with quick-GELU MLPs attending over the whole image, a LayerNorm merger
    "qwen2_vl-vision": (
        transformers.Qwen2VLConfig,
        dict(model_type="qwen2_vl_text", pad_token_id=0,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])),
        dict(embed_dim=32, hidden_size=64, mlp_ratio=2, num_heads=2, patch_size=4, temporal_patch_size=2,
             spatial_merge_size=2, model_type="qwen2_vl_vision", depth=2, hidden_act="quick_gelu"),
        dict(_QWEN_VISION_TOKENS, tie_word_embeddings=False),
    ),
    "ministral3-mm": (
        transformers.Mistral3Config,
        dict(FAMILIES["ministral3"][1], model_type="ministral3"),
        dict(_VISION, head_dim=16),
        dict(image_token_index=317),
    ),
}
FAMILIES |= {name: (spec[0], {}, torch.bfloat16, False) for name, spec in MULTIMODAL.items()}


def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE: the 256 byte symbols, a few merges, and chat special tokens."""
    table = pre_tokenizers.ByteLevel.alphabet()
    alphabet = sorted(table)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return tok


# OpenAI's harmony format, as gpt-oss's template writes it (a system message, the conversation, and the
# assistant's reply opened: the model picks its channel)
HARMONY_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def mxfp4_round(w: torch.Tensor) -> torch.Tensor:
    """w (..., cols) rounded to MXFP4 along its last axis (blocks of 32: a power-of-two scale, E2M1 codes),
    as gguf.quants.MXFP4 picks them."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 2)
    mag = (blocks.abs() / scale).unsqueeze(-1)
    nearest = grid[(mag - grid).abs().argmin(-1)]
    return (torch.sign(blocks) * nearest * scale).reshape(w.shape)


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks (..., cols/32, 16) uint8, scales (..., cols/32) uint8) of w already on the MXFP4 grid, in
    OpenAI's layout: element 2j the low nibble of byte j; scale byte = exponent + 127."""
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    exp = torch.floor(torch.log2(amax)) - 2
    mag = blocks.abs() / torch.exp2(exp)
    codes = torch.zeros(blocks.shape, dtype=torch.uint8)
    for i, g in enumerate(grid):
        codes[mag == g] = i
    codes |= ((blocks < 0) & (mag > 0)).to(torch.uint8) << 3
    assert torch.equal(torch.exp2(exp) * torch.tensor(grid + [-g for g in grid])[codes.long()], blocks)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exp[..., 0] + 127).to(torch.uint8)


def write_gpt_oss_mxfp4(src: Path, dst: Path) -> None:
    """The gpt-oss-bf16 folder with its experts as MXFP4 blocks and scales (config quant_method mxfp4)."""
    from safetensors.torch import load_file, save_file

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).float().transpose(1, 2).contiguous()  # (experts, rows, cols)
        tensors[name + "_blocks"], tensors[name + "_scales"] = mxfp4_encode(w)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    golden = json.loads((dst / "golden.json").read_text())
    (dst / "golden.json").write_text(json.dumps({**golden, "family": "gpt-oss"}))
    print(f"wrote {dst}")


def write_family(name: str, out: Path) -> None:
    cls, extra, dtype, shard = FAMILIES[name]
    torch.manual_seed(sum(map(ord, name)))
    auto = transformers.AutoModelForCausalLM
    if name in MULTIMODAL:
        _, text, vision, wrapper = MULTIMODAL[name]
        config = cls(text_config={**COMMON, **text}, vision_config=vision, **wrapper)
        auto = transformers.AutoModelForImageTextToText
    else:
        config = cls(**{**COMMON, **extra})
    model = auto.from_config(config, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # larger than default init so the logits are not all near zero
        for pname, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
            elif "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:  # biases
                p.normal_(0.0, 0.1)
            if pname.endswith(("q_norm.weight", "k_norm.weight")) and p.dim() == 2:  # Command R+'s, per head
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            if "experts" in pname and p.dim() == 3:  # gpt-oss: (experts, cols, rows), rounded per row
                p.copy_(mxfp4_round(p.transpose(1, 2)).transpose(1, 2))
            if pname.endswith("correct_output_scale"):  # Gemma 3n's AltUp output scale: zero at init
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            if pname.endswith("sinks"):
                p.copy_(torch.linspace(-1.0, 2.0, p.numel()))
        for bname, b in model.named_buffers():  # GLM-4.5's, LFM2-MoE's routing bias: a buffer, zero at init
            if bname.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(0.3 * torch.randn_like(b))
            if bname.endswith("layer_scalar"):  # Gemma 4's per-layer output scale: one at init
                b.copy_(0.5 + torch.rand_like(b))
            if bname.endswith("std_bias"):  # Gemma 4's vision standardization: empty at init
                b.copy_(0.3 * torch.randn_like(b))
            if bname.endswith("std_scale"):
                b.copy_(0.5 + torch.rand_like(b))
            if bname.endswith(("input_min", "output_min")):  # Gemma 4's clipped linears: +-inf at init
                b.fill_(-1.2 - float(torch.rand(())))
            if bname.endswith(("input_max", "output_max")):
                b.fill_(1.2 + float(torch.rand(())))
    model = model.to(dtype)
    folder = out / name
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="60KB" if shard else "1GB")
    tok = tiny_tokenizer()
    if name in ("cohere", "cohere2"):  # Cohere's split: each digit on its own, then GPT-2's
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    harmony = name.startswith("gpt-oss")
    if harmony:
        tok.add_special_tokens(HARMONY_SPECIALS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "<|return|>" if harmony else "<|im_end|>",
                "unk_token": "<unk>",
                "chat_template": HARMONY_TEMPLATE if harmony else CHAT_TEMPLATE,
                "add_bos_token": False,
            },
            indent=1,
        )
    )
    # reference: transformers loading the folder as written (bf16/f16 weights) in float32; loading
    # afresh recomputes RoPE buffers in float32 (casting the live model would round them to bf16)
    ref = auto.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = torch.tensor([TOKENS])
    with torch.no_grad():
        logits = ref(ids).logits[0]
        greedy = ref.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[
            0, len(TOKENS) :
        ]
    if name == "phi3-longrope":  # past the original context: transformers switches to the long factors
        with torch.no_grad():
            rows = ref(torch.tensor([LONG_TOKENS])).logits[0]
            extra = {"long_tokens": LONG_TOKENS}
            extra["long_logits"] = [[round(float(v), 5) for v in r] for r in rows]
    else:
        extra = {}
    golden = {
        **extra,
        "family": name,
        "generator": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": TOKENS,
        "logits": [[round(float(v), 5) for v in row] for row in logits],
        "greedy": [int(t) for t in greedy],
    }
    (folder / "golden.json").write_text(json.dumps(golden))
    if name == "gemma3-vision":
        write_vision_golden(ref, folder)
    if name == "mistral3-vision":
        write_mistral3_vision_golden(ref, folder)
    if name in ("gemma4-vision", "gemma4-vision-causal"):
        write_gemma4_vision_golden(ref, folder)
    if name in ("qwen3_5-vision", "qwen3_5_moe-vision", "qwen3_vl-vision", "qwen3_vl_moe-vision",
                "qwen2_5_vl-vision", "qwen2_vl-vision"):
        write_qwen35_vision_golden(ref, folder)
    size = sum(f.stat().st_size for f in folder.iterdir())
    print(f"wrote {folder} ({size:,} bytes)")
    if name == "gpt-oss-bf16":
        write_gpt_oss_mxfp4(folder, out / "gpt-oss")


# Gemma's chat template's handling of content lists: <start_of_image> where an image part is
VISION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for item in m['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>{% elif item['type'] == 'text' %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_MESSAGES = [
    {"role": "user", "content": "Hello there, look at these."},
    {"role": "assistant", "content": "Sure, send them."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this? And the other:"},
                                 {"type": "image"}]},
]


def vision_tokenizer(folder: Path, specials: list[str], marker: str, **config) -> tuple[Tokenizer, str]:
    """The fixture's tokenizer with the family's three image tokens at ids 317, 318, 319 (the config's), and
    its chat template writing `marker` where an image part is; `config`: more tokenizer_config.json keys."""
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    while tok.get_vocab_size() < 317:  # the image tokens at the config's ids
        tok.add_special_tokens([f"<unused{tok.get_vocab_size()}>"])
    tok.add_special_tokens(specials)
    assert [tok.token_to_id(t) for t in specials] == [317, 318, 319], specials
    tok.save(str(folder / "tokenizer.json"))
    template = VISION_TEMPLATE.replace("<start_of_image>", marker)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config |= {"chat_template": template, **config}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    return tok, template


def test_images() -> list:
    """Two small deterministic RGB pictures, neither square (the processor resizes them to 56 x 56)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(7)
    a = np.zeros((60, 80, 3), np.uint8)
    a[..., 0] = np.linspace(0, 255, 80)[None, :]
    a[..., 1] = np.linspace(255, 0, 60)[:, None]
    a[20:40, 30:50, 2] = 220
    b = rng.integers(0, 256, (70, 40, 3), dtype=np.uint8)
    return [Image.fromarray(a), Image.fromarray(b)]


def write_vision_golden(ref, folder: Path) -> None:
    """golden_vision.json for a Gemma 3 with a vision tower: the prompt as Gemma3Processor builds it (each
    <start_of_image> becomes "\n\n<start_of_image>" + image tokens + "<end_of_image>\n\n"), the pixels from
    transformers' PIL image processor, then the logits at every position, 8 greedy tokens, and each image's
    projected rows, from Gemma3ForConditionalGeneration with the bidirectional image mask (token_type_ids)."""
    import jinja2
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tok, _ = vision_tokenizer(folder, ["<image_soft_token>", "<start_of_image>", "<end_of_image>"],
                              "<start_of_image>")
    pre = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 56, "width": 56},
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
           "rescale_factor": 1 / 255, "do_convert_rgb": True, "do_pan_and_scan": False}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    images = test_images()
    for i, img in enumerate(images):
        img.save(folder / f"image{i}.png")
    text = jinja2.Template(VISION_TEMPLATE).render(messages=VISION_MESSAGES, add_generation_prompt=True)
    full = "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"
    ids = tok.encode(text.replace("<start_of_image>", full), add_special_tokens=False).ids
    processor = Gemma3ImageProcessorPil(**{k: v for k, v in pre.items() if k != "image_processor_type"})
    pixels = processor(images, return_tensors="pt")["pixel_values"].to(torch.float32)
    input_ids = torch.tensor([ids])
    token_type_ids = (input_ids == 317).long()
    with torch.no_grad():
        logits = ref(input_ids=input_ids, pixel_values=pixels, token_type_ids=token_type_ids).logits[0]
        greedy = ref.generate(input_ids=input_ids, pixel_values=pixels, token_type_ids=token_type_ids,
                              max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        greedy = greedy[0, len(ids) :]
        rows = ref.model.get_image_features(pixels).pooler_output
    golden = {
        "generator": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "messages": VISION_MESSAGES,
        "images": [f"image{i}.png" for i in range(len(images))],
        "prompt": text,
        "tokens": ids,
        "logits": [[round(float(v), 5) for v in row] for row in logits],
        "greedy": [int(t) for t in greedy],
        "image_rows": [[[round(float(v), 5) for v in r] for r in image] for image in rows],
        "pixels": [[round(float(v), 5) for v in image.reshape(-1)[:64]] for image in pixels],
    }
    (folder / "golden_vision.json").write_text(json.dumps(golden))


def write_mistral3_vision_golden(ref, folder: Path) -> None:
    """golden_vision.json for a Mistral 3 with a Pixtral tower: the prompt as PixtralProcessor builds it (each
    [IMG] becomes rows of [IMG] x width + [IMG_BREAK], the last break [IMG_END]), the pixels from
    transformers' PIL image processor (longest edge 84, multiples of 28, bicubic), then the logits at every
    position, 8 greedy tokens and each image's projected rows, from Mistral3ForConditionalGeneration."""
    import jinja2
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    tok, template = vision_tokenizer(folder, ["[IMG]", "[IMG_BREAK]", "[IMG_END]"], "[IMG]")
    pre = {"image_processor_type": "PixtralImageProcessor", "size": {"longest_edge": 84},
           "patch_size": {"height": 28, "width": 28}, "resample": 3, "rescale_factor": 1 / 255,
           "image_mean": [0.48145466, 0.4578275, 0.40821073],
           "image_std": [0.26862954, 0.26130258, 0.27577711],
           "do_convert_rgb": True}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    images = test_images()
    for i, img in enumerate(images):
        img.save(folder / f"image{i}.png")
    processor = PixtralImageProcessorPil(**{k: v for k, v in pre.items() if k != "image_processor_type"})
    out = processor(images, return_tensors="pt")
    pixels, sizes = out["pixel_values"].to(torch.float32), out["image_sizes"]
    text = jinja2.Template(template).render(messages=VISION_MESSAGES, add_generation_prompt=True)
    pieces = text.split("[IMG]")
    for i, (h, w) in enumerate(sizes.tolist()):
        rows = [["[IMG]"] * (w // 28) + ["[IMG_BREAK]"] for _ in range(h // 28)]
        flat = [t for row in rows for t in row]
        flat[-1] = "[IMG_END]"
        pieces[i] += "".join(flat)
    ids = tok.encode("".join(pieces), add_special_tokens=False).ids
    input_ids = torch.tensor([ids])
    with torch.no_grad():
        logits = ref(input_ids=input_ids, pixel_values=pixels, image_sizes=sizes).logits[0]
        greedy = ref.generate(input_ids=input_ids, pixel_values=pixels, image_sizes=sizes, max_new_tokens=8,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        greedy = greedy[0, len(ids) :]
        rows = ref.model.get_image_features(pixels, sizes, vision_feature_layer=-1).pooler_output
    golden = {
        "generator": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "messages": VISION_MESSAGES,
        "images": [f"image{i}.png" for i in range(len(images))],
        "image_sizes": sizes.tolist(),
        "prompt": text,
        "tokens": ids,
        "logits": [[round(float(v), 5) for v in row] for row in logits],
        "greedy": [int(t) for t in greedy],
        "image_rows": [[[round(float(v), 5) for v in r] for r in image] for image in rows],
    }
    (folder / "golden_vision.json").write_text(json.dumps(golden))


def write_gemma4_vision_golden(ref, folder: Path) -> None:
    """golden_vision.json for a Gemma 4 with a vision tower: the prompt as Gemma4Processor builds it (each
    <|image|> the template wrote becomes <|image> + one <|image|> per soft token + <image|>), the patches from
    transformers' PIL image processor (aspect kept within 70 soft tokens, bicubic, sides multiples of
    patch x pool), then the logits at every position, 8 greedy tokens and each image's projected rows, from
    Gemma4ForConditionalGeneration with the image rows marked in mm_token_type_ids."""
    import jinja2
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    tok, template = vision_tokenizer(folder, ["<|image|>", "<|image>", "<image|>"], "<|image|>",
                                     image_token="<|image|>", boi_token="<|image>", eoi_token="<image|>")
    pre = {"image_processor_type": "Gemma4ImageProcessor", "patch_size": 4, "pooling_kernel_size": 2,
           "max_soft_tokens": 70, "resample": 3, "rescale_factor": 1 / 255, "do_rescale": True,
           "do_normalize": False, "do_convert_rgb": True}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    images = test_images()
    for i, img in enumerate(images):
        img.save(folder / f"image{i}.png")
    processor = Gemma4ImageProcessorPil(**{k: v for k, v in pre.items() if k != "image_processor_type"})
    out = processor(images, return_tensors="pt")
    pixels, positions = out["pixel_values"].to(torch.float32), out["image_position_ids"]
    counts = [int(n) for n in out["num_soft_tokens_per_image"]]
    text = jinja2.Template(template).render(messages=VISION_MESSAGES, add_generation_prompt=True)
    pieces = text.split("<|image|>")
    for i, n in enumerate(counts):
        pieces[i] += "<|image>" + "<|image|>" * n + "<image|>"
    ids = tok.encode("".join(pieces), add_special_tokens=False).ids
    input_ids = torch.tensor([ids])
    kinds = (input_ids == 317).long()
    kw = dict(pixel_values=pixels, image_position_ids=positions, mm_token_type_ids=kinds)
    with torch.no_grad():
        logits = ref(input_ids=input_ids, **kw).logits[0]
        greedy = ref.generate(input_ids=input_ids, **kw, max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        greedy = greedy[0, len(ids) :]
        rows = ref.model.get_image_features(pixels, positions).pooler_output
    golden = {
        "generator": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "messages": VISION_MESSAGES,
        "images": [f"image{i}.png" for i in range(len(images))],
        "soft_tokens": counts,
        "prompt": text,
        "tokens": ids,
        "logits": [[round(float(v), 5) for v in row] for row in logits],
        "greedy": [int(t) for t in greedy],
        "image_rows": [[[round(float(v), 5) for v in r] for r in image] for image in rows],
    }
    (folder / "golden_vision.json").write_text(json.dumps(golden))


def write_qwen35_vision_golden(ref, folder: Path) -> None:
    """golden_vision.json for a Qwen3.5 with its vision tower: the prompt as Qwen3VLProcessor builds it (the
    template writes <|vision_start|><|image_pad|><|vision_end|>; the pad becomes one per merged row), the
    patches from transformers' PIL image processor (smart_resize to multiples of 8 px within 256 .. 1920
    pixels, bicubic), then the logits at every position, 8 greedy tokens and each image's merged rows, from
    Qwen3_5ForConditionalGeneration with the image rows marked in mm_token_type_ids (M-RoPE positions).
    Qwen3-VL's (Qwen3VLForConditionalGeneration) the same, with each image's deepstack rows too; Qwen2.5-VL's
    (Qwen2_5_VLForConditionalGeneration) and Qwen2-VL's (Qwen2VLForConditionalGeneration) the same."""
    import jinja2
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok, template = vision_tokenizer(folder, ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"],
                                     "<|vision_start|><|image_pad|><|vision_end|>")
    pre = {"image_processor_type": "Qwen2VLImageProcessor",
           "size": {"shortest_edge": 256, "longest_edge": 1920}, "patch_size": 4, "temporal_patch_size": 2,
           "merge_size": 2, "resample": 3,
           "rescale_factor": 1 / 255, "image_mean": [0.48145466, 0.4578275, 0.40821073],
           "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True}
    (folder / "preprocessor_config.json").write_text(json.dumps(pre, indent=1))
    images = test_images()
    for i, img in enumerate(images):
        img.save(folder / f"image{i}.png")
    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in pre.items() if k != "image_processor_type"})
    out = processor(images, return_tensors="pt")
    pixels, grids = out["pixel_values"].to(torch.float32), out["image_grid_thw"]
    text = jinja2.Template(template).render(messages=VISION_MESSAGES, add_generation_prompt=True)
    pieces = text.split("<|image_pad|>")
    for i, (_, h, w) in enumerate(grids.tolist()):
        pieces[i] += "<|image_pad|>" * (h * w // 4)
    ids = tok.encode("".join(pieces), add_special_tokens=False).ids
    input_ids = torch.tensor([ids])
    kw = dict(pixel_values=pixels, image_grid_thw=grids, mm_token_type_ids=(input_ids == 317).int())
    with torch.no_grad():
        logits = ref(input_ids=input_ids, **kw).logits[0]
        greedy = ref.generate(input_ids=input_ids, **kw, max_new_tokens=8, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        greedy = greedy[0, len(ids) :]
        features = ref.model.get_image_features(pixels, grids)
        rows = features.pooler_output
        deepstack = getattr(features, "deepstack_features", None) or []  # per merger: per image
    golden = {
        "generator": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "messages": VISION_MESSAGES,
        "images": [f"image{i}.png" for i in range(len(images))],
        "grids": grids.tolist(),
        "prompt": text,
        "tokens": ids,
        "logits": [[round(float(v), 5) for v in row] for row in logits],
        "greedy": [int(t) for t in greedy],
        "image_rows": [[[round(float(v), 5) for v in r] for r in image] for image in rows],
        **({"deepstack_rows": [[[[round(float(v), 5) for v in r] for r in image] for image in level]
                               for level in deepstack]} if deepstack else {}),
        "pixels": [[round(float(v), 5) for v in row] for row in pixels[:4]],
    }
    (folder / "golden_vision.json").write_text(json.dumps(golden))


# --- embedding models: golden.json holds pooled vectors as sentence-transformers computes them -------------

EMBED_TEXTS = ["the cat sat on the mat.", "Hello, world!", "embeddings of the world", "a"]
BERT_WORDS = ["the", "cat", "sat", "on", "mat", "hello", "world", "embed", "##ding", "##s", "of", "a", "is"]


def _normalized(v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(v, dim=-1)


def _embed_golden(model, tok: Tokenizer, texts: list[str], prompt: str = "") -> dict:
    """Token ids and the mean, CLS and last-token pools (raw and L2-normalised) of each text, from the
    model's last_hidden_state (one text at a time: no padding)."""
    out = {"texts": texts, "prompt": prompt, "ids": [], "mean": [], "cls": [], "last": []}
    for text in texts:
        ids = tok.encode(prompt + text).ids
        with torch.no_grad():
            hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
        out["ids"].append(ids)
        for key, v in (("mean", hidden.mean(0)), ("cls", hidden[0]), ("last", hidden[-1])):
            out[key].append([round(float(x), 6) for x in v])
    return out


def _wordpiece_tokenizer() -> tuple[Tokenizer, dict[str, int]]:
    """A BERT WordPiece tokenizer.json (lower-casing BertNormalizer, [CLS] $A [SEP]) over a small vocabulary
    of letters, word pieces and BERT_WORDS."""
    from tokenizers import normalizers, processors

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])}
    for t in [*".,!?'", *"abcdefghijklmnopqrstuvwxyz", *("##" + c for c in "abcdefghijklmnopqrstuvwxyz"),
              *BERT_WORDS]:
        vocab.setdefault(t, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return tok, vocab


def _bert_tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": max_length,
        "cls_token": "[CLS]",
        "sep_token": "[SEP]", "unk_token": "[UNK]", "pad_token": "[PAD]", "mask_token": "[MASK]",
    }


def _randomize_encoder(model) -> None:
    """Weights far from transformers' init (0.02 normal, unit norms), so that a wrong layer shows."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
            elif "norm.weight" in pname.lower():
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)


NOMIC_TEXTS = [*EMBED_TEXTS, "search_query: what is the world?",
               "search_document: the cat sat on the mat, and a cat is on a mat; hello world of embeddings."]


def write_nomic_embed(out: Path) -> None:
    """nomic-embed: a 2-layer transformers NomicBertModel (hidden 32, 4 heads of 8, SwiGLU FFN 64, rotary base
    1000) with bert-embed's WordPiece tokenizer, a vocabulary padded past the tokenizer's (as nomic's 30528
    rows for 30522 tokens) and nomic-embed-text-v1.5's sentence-transformers files (mean pooling, Normalize,
    max_seq_length 8192)."""
    torch.manual_seed(5151)
    tok, vocab = _wordpiece_tokenizer()
    config = transformers.NomicBertConfig(
        vocab_size=len(vocab) + 6, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=2048, type_vocab_size=2, layer_norm_eps=1e-12,
        hidden_act="silu", rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    model = transformers.NomicBertModel(config).eval()
    _randomize_encoder(model)
    folder = out / "nomic-embed"
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(_bert_tokenizer_config(8192), indent=2))
    _sentence_transformers_files(folder, "pooling_mode_mean_tokens", 32, max_seq_length=8192)
    golden = _embed_golden(model, tok, NOMIC_TEXTS)
    (folder / "embedding_golden.json").write_text(json.dumps({**golden, "family": "nomic_bert",
                                                             "pooling": "mean"}))
    print(f"wrote {folder}")


XLMR_CORPUS = """The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is.
Le renard brun rapide saute par-dessus le chien paresseux. Ça va très bien, merci! Où est la gare?
Der schnelle braune Fuchs springt über den faulen Hund. Straße, Mädchen, Größe, schön.
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la biblioteca? Mañana.
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!
敏捷的棕色狐狸跳过了懒狗。你好，世界。日本語のテキストです。東京は大きい。
Η γρήγορη καφέ αλεπού. Γειά σου κόσμε. مرحبا بالعالم. नमस्ते दुनिया।
query: how much protein should a female eat? passage: As a general guideline, eat 46 grams a day.
"""
XLMR_TEXTS = ["query: what is the capital of France?", "passage: Paris is the capital of France.",
              "Straße und Mädchen", "你好，世界。", "Привет, мир!", "ﬁne ＡＢＣ １２３", "a"]


def _protobuf_fields(buf: bytes):
    """(field number, value) of a protobuf message's wire format: enough to read a SentencePiece model's
    normalizer_spec.precompiled_charsmap without the protobuf package."""
    def varint(i: int) -> tuple[int, int]:
        out = shift = 0
        while True:
            b = buf[i]
            i += 1
            out |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return out, i

    i = 0
    while i < len(buf):
        key, i = varint(i)
        wire = key & 7
        if wire == 0:
            value, i = varint(i)
        elif wire == 2:
            n, i = varint(i)
            value, i = buf[i : i + n], i + n
        else:
            size = {1: 8, 5: 4}[wire]
            value, i = buf[i : i + size], i + size
        yield key >> 3, value


def _xlmr_tokenizer(folder: Path):
    """An XLM-RoBERTa tokenizer (SentencePiece unigram with the nmt_nfkc normalization table, fairseq's id
    layout: <s> <pad> </s> <unk>, the pieces, <mask>) trained on XLMR_CORPUS, saved by transformers'
    XLMRobertaTokenizer as tokenizer.json."""
    import io

    import sentencepiece as spm

    proto = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(XLMR_CORPUS.splitlines() * 20), model_writer=proto, vocab_size=400,
        model_type="unigram", normalization_rule_name="nmt_nfkc", character_coverage=1.0, pad_id=-1,
        bos_id=-1, eos_id=-1, unk_id=0, hard_vocab_limit=False, minloglevel=2,
    )
    raw = proto.getvalue()
    normalizer = next(v for n, v in _protobuf_fields(raw) if n == 3)
    charsmap = next(v for n, v in _protobuf_fields(normalizer) if n == 2)
    sp = spm.SentencePieceProcessor(model_proto=raw)
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [(sp.id_to_piece(i), sp.get_score(i)) for i in range(1, sp.get_piece_size())]
    vocab.append(("<mask>", 0.0))
    tok = transformers.XLMRobertaTokenizer(vocab=vocab, _spm_precompiled_charsmap=charsmap)
    tok.save_pretrained(str(folder))
    return Tokenizer.from_file(str(folder / "tokenizer.json")), len(vocab)


def write_xlmr_embed(out: Path) -> None:
    """xlmr-embed: a 2-layer XLMRobertaModel (hidden 32, 4 heads, positions from pad_token_id + 1, one token
    type) with a SentencePiece unigram tokenizer.json, laid out as bge-m3 (CLS pooling, Normalize)."""
    folder = out / "xlmr-embed"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    tok, n_vocab = _xlmr_tokenizer(folder)
    torch.manual_seed(6262)
    config = transformers.XLMRobertaConfig(
        vocab_size=n_vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64 + 2, type_vocab_size=1, layer_norm_eps=1e-5, hidden_act="gelu",
        pad_token_id=1, bos_token_id=0, eos_token_id=2,
    )
    model = transformers.XLMRobertaModel(config, add_pooling_layer=False).eval()
    _randomize_encoder(model)
    model.save_pretrained(folder, safe_serialization=True)
    _sentence_transformers_files(folder, "pooling_mode_cls_token", 32, max_seq_length=64)
    golden = _embed_golden(model, tok, XLMR_TEXTS)
    (folder / "embedding_golden.json").write_text(json.dumps({**golden, "family": "xlm_roberta",
                                                             "pooling": "cls"}))
    print(f"wrote {folder}")


def write_modernbert_embed(out: Path) -> None:
    """modernbert-embed: a 3-layer ModernBertModel (hidden 32, 4 heads, GeGLU FFN 48, layer 0 global, layers 1
    and 2 windowed to 4 tokens either side, rotary bases 160000 / 10000) with a byte-level BPE tokenizer.json
    ([CLS] $A [SEP]) and modernbert-embed-base's sentence-transformers files (mean pooling, Normalize)."""
    from tokenizers import processors

    tok = tiny_tokenizer()
    tok.add_special_tokens(["[CLS]", "[SEP]", "[PAD]"])
    cls_id, sep_id, pad_id = (tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    torch.manual_seed(7373)
    config = transformers.ModernBertConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, max_position_embeddings=512, norm_eps=1e-5, local_attention=8,
        global_attn_every_n_layers=3, hidden_activation="gelu", pad_token_id=pad_id, bos_token_id=cls_id,
        eos_token_id=sep_id, cls_token_id=cls_id, sep_token_id=sep_id,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 160000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    )
    config._attn_implementation = "eager"
    model = transformers.ModernBertModel(config).eval()
    _randomize_encoder(model)
    folder = out / "modernbert-embed"
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "model_max_length": 512,
    }, indent=2))
    _sentence_transformers_files(folder, "pooling_mode_mean_tokens", 32, max_seq_length=512)
    texts = [*EMBED_TEXTS, "the window of a local layer is shorter than this text"]
    golden = _embed_golden(model, tok, texts)
    (folder / "embedding_golden.json").write_text(json.dumps({**golden, "family": "modernbert",
                                                             "pooling": "mean"}))
    print(f"wrote {folder}")


def write_bert_embed(out: Path) -> None:
    """bert-embed: a 2-layer BertModel (hidden 32, 4 heads) with a WordPiece tokenizer.json and the
    sentence-transformers files of a bge-style model (CLS pooling, Normalize, max_seq_length 24)."""
    torch.manual_seed(4242)
    tok, vocab = _wordpiece_tokenizer()
    config = transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu",
    )
    model = transformers.BertModel(config).eval()
    _randomize_encoder(model)
    folder = out / "bert-embed"
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(_bert_tokenizer_config(24), indent=2))
    _sentence_transformers_files(folder, "pooling_mode_cls_token", 32, max_seq_length=24)
    golden = _embed_golden(model, tok, EMBED_TEXTS)
    golden["long_ids"] = tok.encode(" ".join(["hello world"] * 20)).ids  # past max_seq_length
    (folder / "embedding_golden.json").write_text(json.dumps({**golden, "family": "bert", "pooling": "cls"}))
    print(f"wrote {folder}")


def _sentence_transformers_files(folder: Path, mode: str, dim: int, max_seq_length: int | None = None,
                                 prompts: dict | None = None) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens",
             "lasttoken")
    pooling = {"word_embedding_dimension": dim,
               **{f"pooling_mode_{m}": f"pooling_mode_{m}" == mode for m in modes}}
    pooling["include_prompt"] = True
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
        )
    if prompts is not None:
        (folder / "config_sentence_transformers.json").write_text(json.dumps(
            {"prompts": prompts, "default_prompt_name": None, "similarity_fn_name": "cosine"}, indent=2
        ))


def write_qwen3_embed(out: Path) -> None:
    """qwen3-embed: a tiny Qwen3 (float32) laid out as Qwen3-Embedding: its tokenizer appends <|endoftext|>
    (a TemplateProcessing post-processor), last-token pooling, Normalize, a "query" instruction prompt."""
    from tokenizers import processors

    torch.manual_seed(3003)
    config = transformers.Qwen3Config(**{**COMMON, "tie_word_embeddings": True, "head_dim": 32})
    model = transformers.Qwen3Model(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
            elif "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    tok = tiny_tokenizer()
    tok.add_special_tokens(["<|endoftext|>"])
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", eot)],
    )
    folder = out / "qwen3-embed"
    shutil.rmtree(folder, ignore_errors=True)
    model.save_pretrained(folder, safe_serialization=True)
    config_json = json.loads((folder / "config.json").read_text())
    config_json["architectures"] = ["Qwen3ForCausalLM"]  # as Qwen3-Embedding's own config.json names it
    (folder / "config.json").write_text(json.dumps(config_json, indent=2))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    prompts = {"query": "Instruct: find the answer\nQuery:", "document": ""}
    _sentence_transformers_files(folder, "pooling_mode_lasttoken", 64, prompts=prompts)
    golden = _embed_golden(model, tok, EMBED_TEXTS)
    golden["query"] = _embed_golden(model, tok, EMBED_TEXTS[:2], prompts["query"])
    golden |= {"family": "qwen3", "pooling": "last"}
    (folder / "embedding_golden.json").write_text(json.dumps(golden))
    print(f"wrote {folder}")


EMBEDDING_FAMILIES = {"bert-embed": write_bert_embed, "qwen3-embed": write_qwen3_embed,
                      "nomic-embed": write_nomic_embed, "xlmr-embed": write_xlmr_embed,
                      "modernbert-embed": write_modernbert_embed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "tiny")
    parser.add_argument("families", nargs="*", default=sorted(FAMILIES) + sorted(EMBEDDING_FAMILIES))
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.families:
        if name in EMBEDDING_FAMILIES:
            EMBEDDING_FAMILIES[name](args.out)
        else:
            write_family(name, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
