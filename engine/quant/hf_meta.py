"""Model description between the two worlds: GGUF metadata <-> Hugging Face config.json + tokenizer files.

`metadata_from_hf` builds the GGUF keys (hyper-parameters, tokenizer.ggml.*, chat template) a converted
GGUF must carry to be self-contained; `hf_files_from_metadata` writes the reverse for an export.

Tokenizers: byte-level BPE vocabularies map one to one (tokens, merges, pre-tokenizer name recovered
from the split regexes). SentencePiece-BPE vocabularies (Gemma) are stored by HF as BPE merges; GGUF's
SentencePiece tokenizer needs per-token scores instead, so a merged token's score is minus its merge
rank (earlier merge = higher score), which reproduces the merge order; tokens no merge produces get
a score below every merge.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from engine.arch.gemma3 import SLIDING, pattern_layer_types
from engine.arch.llama import (
    COHERE_ARCHS,
    gpt_oss_layer_types,
    olmo3_layer_types,
    qwen35_layer_types,
    smollm3_rope_layers,
)
from engine.errors import ModelFormatError
from engine.rope import rope_attention_factor
from engine.tokenizer import (
    _PRE_REGEXES,
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    Tokenizer,
)

_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# regex family (engine.tokenizer) -> the tokenizer.ggml.pre name written for it
_FAMILY_PRE = {
    "default": "default",
    "gpt2": "gpt2",
    "llama3": "llama-bpe",
    "qwen2": "qwen2",
    "gpt4o": "gpt-4o",
    "tekken": "tekken",
    "seed-coder": "seed-coder",
    "starcoder": "smollm",
    "falcon": "falcon",
    "deepseek-llm": "deepseek-llm",
    "deepseek-v3": "deepseek-v3",
    "deepseek-coder": "deepseek-coder",
}


def _gemma4_hparams(cfg) -> dict[str, Any]:
    """llama.cpp's gemma4 keys: head sizes, KV heads and FFN lengths per layer kind, the layer pattern, the
    shared-KV layers, per-layer embeddings and experts (the global RoPE goes in the rope_freqs tensor)."""
    a = "gemma4"
    n = cfg.num_hidden_layers
    windowed = [not cfg.is_global(i) for i in range(n)]
    md: dict[str, Any] = {
        "general.architecture": a,
        f"{a}.block_count": n,
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.feed_forward_length": [int(ff) for ff in cfg.intermediate_sizes],
        f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": [cfg.layer_kv_heads(i) for i in range(n)],
        f"{a}.attention.key_length": cfg.global_head_dim,
        f"{a}.attention.value_length": cfg.global_head_dim,
        f"{a}.attention.key_length_swa": cfg.head_dim,
        f"{a}.attention.value_length_swa": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{a}.attention.sliding_window": cfg.sliding_window,
        f"{a}.attention.sliding_window_pattern": np.array(windowed),
        f"{a}.attention.shared_kv_layers": cfg.num_kv_shared_layers,
        f"{a}.rope.freq_base": float(cfg.rope_theta),
        f"{a}.rope.freq_base_swa": float(cfg.rope_local_base_freq),
        f"{a}.rope.dimension_count": cfg.global_head_dim,
        f"{a}.rope.dimension_count_swa": cfg.local_rotary_dim,
        f"{a}.embedding_length_per_layer_input": cfg.hidden_size_per_layer_input,
    }
    if cfg.final_logit_softcapping:
        md[f"{a}.final_logit_softcapping"] = float(cfg.final_logit_softcapping)
    if cfg.num_experts:
        md[f"{a}.expert_count"] = cfg.num_experts
        md[f"{a}.expert_used_count"] = cfg.num_experts_per_tok
        md[f"{a}.expert_feed_forward_length"] = cfg.moe_intermediate_size
    return md


def _gemma3n_hparams(cfg) -> dict[str, Any]:
    """llama.cpp's gemma3n keys (its Gemma3NModel converter): Gemma 3's, FFN lengths per layer, the window
    flags, AltUp's inputs, per-layer embeddings, shared-KV layers and the sparsity's cut-offs as standard
    normal quantiles (-inf on dense layers). The windowed layers' RoPE base is written too (llama.cpp's
    converter leaves it out and takes 10000)."""
    a = "gemma3n"
    return {
        "general.architecture": a,
        f"{a}.block_count": cfg.num_hidden_layers,
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.feed_forward_length": [int(ff) for ff in cfg.intermediate_sizes],
        f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{a}.attention.sliding_window": cfg.sliding_window,
        f"{a}.attention.sliding_window_pattern": np.array([not cfg.is_global(i)
                                                            for i in range(cfg.num_hidden_layers)]),
        f"{a}.attention.shared_kv_layers": cfg.num_kv_shared_layers,
        f"{a}.rope.freq_base": float(cfg.rope_theta),
        f"{a}.rope.freq_base_swa": float(cfg.rope_local_base_freq),
        f"{a}.embedding_length_per_layer_input": cfg.hidden_size_per_layer_input,
        f"{a}.altup.active_idx": cfg.altup_active_idx,
        f"{a}.altup.num_inputs": cfg.altup_num_inputs,
        f"{a}.activation_sparsity_scale": np.array(cfg.sparsity_stds, np.float32),
        **({f"{a}.final_logit_softcapping": float(cfg.final_logit_softcapping)}
           if cfg.final_logit_softcapping else {}),
    }


def _mamba_hparams(a: str, shape) -> dict[str, Any]:
    """llama.cpp's ssm.* keys for Mamba-2 layers (granitehybrid, nemotron_h)."""
    if (shape.dt_min, shape.dt_max) != (0.0, float("inf")):
        raise ModelFormatError("config.json", f"a {a} GGUF has no key for time_step_limit")
    return {
        f"{a}.ssm.conv_kernel": shape.taps,
        f"{a}.ssm.state_size": shape.state_size,
        f"{a}.ssm.group_count": shape.groups,
        f"{a}.ssm.time_step_rank": shape.heads,
        f"{a}.ssm.inner_size": shape.d_inner,
    }


def _nemotron_h_hparams(cfg) -> dict[str, Any]:
    """llama.cpp's nemotron_h keys: KV heads per layer (0 but in attention blocks), FFN lengths per layer
    (0 but in MLP blocks), the head size, Mamba-2's sizes, no RoPE."""
    a = "nemotron_h"
    return {
        "general.architecture": a,
        f"{a}.block_count": cfg.num_hidden_layers,
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.vocab_size": cfg.vocab_size,
        f"{a}.feed_forward_length": [cfg.intermediate_size * (k == "mlp") for k in cfg.kinds],
        f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": [cfg.num_key_value_heads * (k == "attention") for k in cfg.kinds],
        f"{a}.attention.key_length": cfg.head_dim,
        f"{a}.attention.value_length": cfg.head_dim,
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{a}.rope.scaling.finetuned": False,
        **_mamba_hparams(a, cfg.mamba),
    }


def _deepseek2_hparams(cfg) -> dict[str, Any]:
    """llama.cpp's deepseek2 keys (convert_hf_to_gguf.py's DeepseekV2Model): MLA run as one key-value head of
    the latent (key_length kv_lora_rank + qk_rope_head_dim, value_length kv_lora_rank) with the per-head
    sizes in the _mla keys; the MoE keys of its graph; YaRN with mscale_all_dim as yarn_log_multiplier
    0.1 * mscale_all_dim."""
    if cfg.rope_neox:
        raise ModelFormatError(
            "config.json",
            "rope_interleave false (half-split RoPE) cannot be written to a deepseek2 GGUF, whose RoPE turns "
            "adjacent pairs; run the folder as it is",
        )
    a = "deepseek2"
    rope, r = cfg.qk_rope_head_dim, cfg.kv_lora_rank
    dense = cfg.first_dense_layers if cfg.num_experts else cfg.num_hidden_layers
    md: dict[str, Any] = {
        "general.architecture": a,
        f"{a}.block_count": cfg.num_hidden_layers,
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.feed_forward_length": cfg.dense_intermediate_size or cfg.intermediate_size,
        f"{a}.vocab_size": cfg.vocab_size,
        f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": 1,
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
        f"{a}.rope.freq_base": float(cfg.rope_theta),
        f"{a}.rope.dimension_count": rope,
        f"{a}.attention.kv_lora_rank": r,
        f"{a}.attention.key_length": r + rope,
        f"{a}.attention.value_length": r,
        f"{a}.attention.key_length_mla": cfg.qk_nope_head_dim + rope,
        f"{a}.attention.value_length_mla": cfg.v_head_dim,
        f"{a}.leading_dense_block_count": dense,
        f"{a}.expert_feed_forward_length": cfg.intermediate_size,
        f"{a}.expert_shared_count": cfg.shared_expert_intermediate_size // cfg.intermediate_size,
    }
    # written as 0 without a q LoRA too: llama.cpp requires the key unless the layer count is V2-Lite's (27),
    # and takes attn_q for 0
    md[f"{a}.attention.q_lora_rank"] = cfg.q_lora_rank
    if cfg.num_experts:
        md |= {
            f"{a}.expert_count": cfg.num_experts,
            f"{a}.expert_used_count": cfg.num_experts_per_tok,
            f"{a}.expert_weights_scale": float(cfg.expert_weights_scale),
            f"{a}.expert_weights_norm": bool(cfg.norm_topk_prob),
            f"{a}.expert_gating_func": 2 if cfg.expert_gating == "sigmoid" else 1,
            f"{a}.expert_group_count": cfg.expert_groups,
            f"{a}.expert_group_used_count": cfg.expert_groups_used or cfg.expert_groups,
        }
    scaling = cfg.rope_scaling
    if scaling.kind == "yarn":
        md |= {
            f"{a}.rope.scaling.type": "yarn",
            f"{a}.rope.scaling.factor": float(scaling.factor),
            f"{a}.rope.scaling.original_context_length": int(scaling.original_max_position),
            f"{a}.rope.scaling.yarn_beta_fast": float(scaling.beta_fast),
            f"{a}.rope.scaling.yarn_beta_slow": float(scaling.beta_slow),
            f"{a}.rope.scaling.attn_factor": float(rope_attention_factor(scaling)),
            f"{a}.rope.scaling.yarn_log_multiplier": 0.1 * float(cfg.mscale_all_dim),
        }
    elif scaling.kind not in ("none", "default", ""):
        raise ModelFormatError("config.json", f"RoPE scaling {scaling.kind!r} cannot be written to deepseek2")
    return md


def _hparams(arch: str, config: dict, cfg) -> dict[str, Any]:
    if arch == "deepseek2":
        return _deepseek2_hparams(cfg)
    if arch == "gemma4":
        return _gemma4_hparams(cfg)
    if arch == "gemma3n":
        return _gemma3n_hparams(cfg)
    if arch == "nemotron_h":
        return _nemotron_h_hparams(cfg)
    a = arch
    md: dict[str, Any] = {
        "general.architecture": arch,
        f"{a}.block_count": cfg.num_hidden_layers,
        f"{a}.context_length": cfg.max_position_embeddings,
        f"{a}.embedding_length": cfg.hidden_size,
        f"{a}.feed_forward_length": cfg.intermediate_size,
        f"{a}.attention.head_count": cfg.num_attention_heads,
        f"{a}.attention.head_count_kv": cfg.num_key_value_heads,
        f"{a}.rope.freq_base": float(cfg.rope_theta),
        f"{a}.attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
    }
    if arch in COHERE_ARCHS:  # llama.cpp's keys: a LayerNorm's epsilon, the logits' multiplier
        del md[f"{a}.attention.layer_norm_rms_epsilon"]
        md[f"{a}.attention.layer_norm_epsilon"] = float(cfg.rms_norm_eps)
        md[f"{a}.logit_scale"] = float(cfg.logit_scale)
    if arch in ("gemma3", "gemma2"):
        # GGUF has no key for the score scale: readers take head_dim, or hidden / heads on the 27B models
        wide = cfg.num_hidden_layers == (46 if arch == "gemma2" else 62)
        implied = cfg.hidden_size / cfg.num_attention_heads if wide else cfg.head_dim
        if cfg.query_pre_attn_scalar != implied:
            raise ModelFormatError(
                "config.json",
                f"query_pre_attn_scalar {cfg.query_pre_attn_scalar:g} differs from the {implied:g} a {arch} "
                "GGUF implies; this model cannot be converted to GGUF (run the folder as it is)",
            )
        md[f"{a}.attention.key_length"] = cfg.head_dim
        md[f"{a}.attention.value_length"] = cfg.head_dim
        md[f"{a}.attention.sliding_window"] = cfg.sliding_window
        types = list(cfg.layer_types or [])
        if arch == "gemma3" and types and types != pattern_layer_types(cfg.num_hidden_layers):
            # windowed layers other than Gemma 3's five of six: one flag per layer, as llama.cpp's key allows
            md[f"{a}.attention.sliding_window_pattern"] = np.array([t == SLIDING for t in types])
        for cap in ("attn_logit_softcapping", "final_logit_softcapping"):  # Gemma 2's (llama.cpp's keys)
            if getattr(cfg, cap):
                md[f"{a}.{cap}"] = float(getattr(cfg, cap))
    else:
        md[f"{a}.vocab_size"] = cfg.vocab_size
        md[f"{a}.rope.dimension_count"] = cfg.rotary_dim
        if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
            md[f"{a}.attention.key_length"] = cfg.head_dim
            md[f"{a}.attention.value_length"] = cfg.head_dim
    if getattr(cfg, "num_experts", 0):  # the keys llama.cpp writes for Mixtral ("llama") and Qwen2/3-MoE
        md[f"{a}.expert_count"] = cfg.num_experts
        md[f"{a}.expert_used_count"] = cfg.num_experts_per_tok
        md[f"{a}.expert_weights_norm"] = bool(cfg.norm_topk_prob)
        if arch in ("qwen2moe", "qwen3moe", "gpt-oss", "glm4moe", "lfm2moe", "qwen35moe", "qwen3next",
                    "granitehybrid", "qwen3vlmoe", "ernie4_5-moe"):
            md[f"{a}.expert_feed_forward_length"] = cfg.intermediate_size
            md[f"{a}.feed_forward_length"] = int(config.get("intermediate_size") or cfg.intermediate_size)
        if cfg.expert_gating == "sigmoid":  # llama.cpp's keys: sigmoid gating, scale, dense layers
            md[f"{a}.expert_gating_func"] = 2
            md[f"{a}.expert_weights_scale"] = float(cfg.expert_weights_scale)
            md[f"{a}.leading_dense_block_count"] = cfg.first_dense_layers
        if arch == "glm4moe":  # shared experts counted
            md[f"{a}.expert_shared_count"] = cfg.shared_expert_intermediate_size // cfg.intermediate_size
            md[f"{a}.nextn_predict_layers"] = 0
        elif cfg.shared_expert_intermediate_size:  # Qwen2-MoE (llama.cpp's key)
            md[f"{a}.expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
        if arch == "ernie4_5-moe":
            md.update(_ernie4_5_moe_keys(config, cfg))
        if arch == "gpt-oss":  # Hearth's keys (llama.cpp fixes 1.702 and 7.0)
            md[f"{a}.expert_swiglu_alpha"] = float(cfg.swiglu_alpha)
            md[f"{a}.expert_swiglu_limit"] = float(cfg.swiglu_limit)
    if arch == "mistral3" and cfg.attn_temperature_beta:  # llama.cpp's keys (its length: YaRN's original)
        yarn = cfg.rope_scaling
        if yarn.kind != "yarn" or yarn.original_max_position != cfg.attn_temperature_length:
            raise ModelFormatError(
                "config.json",
                "a Ministral 3 GGUF keeps the attention temperature over YaRN's original context only",
            )
        md[f"{a}.attention.temperature_scale"] = float(cfg.attn_temperature_beta)
        md[f"{a}.rope.scaling.yarn_log_multiplier"] = float(cfg.rope_scaling.mscale_all_dim or 1.0)
    # llama.cpp's qwen35 / qwen3next keys: the DeltaNet's sizes, every n-th layer attending
    if arch in ("qwen35", "qwen35moe", "qwen3next"):
        shape = cfg.delta
        every = next((e for e in range(2, cfg.num_hidden_layers + 1)
                      if tuple(cfg.layer_types) == qwen35_layer_types(cfg.num_hidden_layers, e)), 0)
        if not every:
            raise ModelFormatError(
                "config.json", f"layers {cfg.layer_types} cannot be written to a {arch} GGUF"
            )
        md[f"{a}.full_attention_interval"] = every
        md[f"{a}.ssm.conv_kernel"] = shape.taps
        md[f"{a}.ssm.state_size"] = shape.head_k
        md[f"{a}.ssm.group_count"] = shape.k_heads
        md[f"{a}.ssm.time_step_rank"] = shape.v_heads
        md[f"{a}.ssm.inner_size"] = shape.value_dim
        if arch != "qwen3next":  # Qwen3-Next turns plain RoPE
            md.update(_mrope_sections(a, config, [11, 11, 10]))
    if getattr(cfg, "dense_layers", ()) and arch != "ernie4_5-moe":
        # Hearth's key (llama.cpp's qwen3next has every layer's FFN experts)
        md[f"{a}.mlp_only_layers"] = [int(i) for i in cfg.dense_layers]
    if arch in ("qwen3vl", "qwen3vlmoe"):  # llama.cpp's keys: M-RoPE's 4 sections, the deepstack sets' count
        md.update(_mrope_sections(a, config, [24, 20, 20]))
        md[f"{a}.n_deepstack_layers"] = cfg.deepstack_layers
    if arch == "qwen2vl":  # Qwen2.5-VL's language model: llama.cpp's M-RoPE sections (in a row)
        md.update(_mrope_sections(a, config, [16, 24, 24]))
    if arch in ("lfm2", "lfm2moe"):  # llama.cpp's keys: KV heads per layer (0 in convolution layers), taps
        md[f"{a}.attention.head_count_kv"] = [
            0 if cfg.is_conv(i) else cfg.num_key_value_heads for i in range(cfg.num_hidden_layers)
        ]
        md[f"{a}.shortconv.l_cache"] = cfg.conv_taps
    if arch == "granitehybrid":  # llama.cpp's keys: Mamba-2's sizes, KV heads per layer (0 in Mamba-2 layers)
        md.update(_mamba_hparams(a, cfg.mamba))
        md[f"{a}.attention.head_count_kv"] = [
            0 if cfg.is_recurrent(i) else cfg.num_key_value_heads for i in range(cfg.num_hidden_layers)
        ]
        # RoPE in the attention layers or none (Granite 4.0-H), as llama.cpp reads this key for the family
        md[f"{a}.rope.scaling.finetuned"] = cfg.rope_layers is None
    if arch in ("granite", "granitehybrid"):  # llama.cpp's keys
        md[f"{a}.embedding_scale"] = float(cfg.embedding_multiplier)
        md[f"{a}.residual_scale"] = float(cfg.residual_multiplier)
        md[f"{a}.attention.scale"] = float(cfg.attention_multiplier)
        md[f"{a}.logit_scale"] = float(cfg.logits_scaling)
    rope_layers = getattr(cfg, "rope_layers", None)
    if arch in ("exaone4", "cohere2"):  # implied by the window, as llama.cpp reads it
        rope_layers = None
    if arch == "granitehybrid" and rope_layers is not None and not any(rope_layers):  # rope.scaling.finetuned
        rope_layers = None
    if rope_layers is not None and rope_layers != smollm3_rope_layers(cfg.num_hidden_layers):
        # llama.cpp fixes SmolLM3's NoPE layers at every fourth, and GGUF has no key for others
        raise ModelFormatError("config.json", f"RoPE on layers {rope_layers} cannot be written to a GGUF")
    window = getattr(cfg, "sliding_window", 0)
    if window and arch not in ("gemma3", "gemma2"):
        # the layers are implied by the architecture, as LlamaConfig.from_gguf reads them back: every layer
        # for a "llama" (Mistral v0.1), the even ones for gpt-oss (llama.cpp's pattern)
        n = cfg.num_hidden_layers
        implied = {"llama": None, "gpt-oss": gpt_oss_layer_types(n), "olmo2": olmo3_layer_types(n),
                   "exaone4": olmo3_layer_types(n), "cohere2": olmo3_layer_types(n)}
        if arch not in implied or cfg.layer_types != implied[arch]:
            raise ModelFormatError(
                "config.json",
                f"a sliding window on layers {cfg.layer_types} cannot be written to a {arch} GGUF",
            )
        md[f"{a}.attention.sliding_window"] = int(window)
    scaling = cfg.rope_scaling
    if scaling.kind not in ("none", "default", ""):
        md[f"{a}.rope.scaling.type"] = scaling.kind
        md[f"{a}.rope.scaling.factor"] = float(scaling.factor)
    if scaling.kind == "longrope":  # llama.cpp's Phi-3 keys; the factors go in rope_factors_* tensors
        md[f"{a}.rope.scaling.original_context_length"] = int(scaling.original_max_position)
        md[f"{a}.rope.scaling.attn_factor"] = float(rope_attention_factor(scaling))
    if scaling.kind == "yarn":  # llama.cpp's keys (engine.rope.rope_scaling_from_gguf reads them back)
        md[f"{a}.rope.scaling.original_context_length"] = int(scaling.original_max_position)
        md[f"{a}.rope.scaling.yarn_beta_fast"] = float(scaling.beta_fast)
        md[f"{a}.rope.scaling.yarn_beta_slow"] = float(scaling.beta_slow)
        md[f"{a}.rope.scaling.attn_factor"] = float(rope_attention_factor(scaling))
    return md


def _ernie4_5_moe_keys(config: dict, cfg) -> dict[str, Any]:
    """llama.cpp's ernie4_5-moe keys (its Ernie4_5MoeModel converter): the leading dense layers, the step of
    the expert layers after them, the shared experts' count and their whole FFN length (llama.cpp's converter
    writes intermediate_size // num_key_value_heads there, the same number in the released models); the dense
    layers that rule leaves out (a moe_layer_end_index short of the last layer) under Hearth's
    mlp_only_layers."""
    a = "ernie4_5-moe"
    n, lead = cfg.num_hidden_layers, cfg.first_dense_layers
    step = int(config.get("moe_layer_interval") or 1)
    implied = {i for i in range(lead, n) if (i + 1) % step}
    md: dict[str, Any] = {
        f"{a}.leading_dense_block_count": lead,
        f"{a}.interleave_moe_layer_step": step,
        f"{a}.expert_shared_count": cfg.shared_expert_intermediate_size // cfg.intermediate_size,
    }
    if extra := sorted(set(cfg.dense_layers) - implied):
        md[f"{a}.mlp_only_layers"] = [int(i) for i in extra]
    return md


def _mrope_sections(a: str, config: dict, default: list[int]) -> dict[str, Any]:
    """llama.cpp's rope.dimension_sections (t, h, w and a fourth, 0) from mrope_section (transformers 5's
    rope_parameters, or the rope_scaling of published Qwen2.5-VL configs)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    sections = list(rope.get("mrope_section") or default)
    return {f"{a}.rope.dimension_sections": [int(v) for v in sections] + [0] * (4 - len(sections))}


def _pre_name(spec: dict) -> str:
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    patterns = tuple((s.get("pattern") or {}).get("Regex") for s in steps if s.get("type") == "Split")
    for family, regexes in _PRE_REGEXES.items():
        if patterns == regexes:
            return _FAMILY_PRE[family]
    kinds = [s.get("type") for s in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    raise ModelFormatError(
        "tokenizer.json", f"its pre-tokenizer {json.dumps(pre)[:120]} is not one conversion can name for GGUF"
    )


def read_vocab(folder: Path, kind: str) -> tuple[dict, dict, dict[str, int], list[str]]:
    """A folder's tokenizer.json of model type `kind` ("BPE", "WordPiece", "Unigram"): (the file, its model,
    token -> id with the added tokens, the tokens by id; ids nothing names become "[PAD<i>]").

    Raises:
        ModelFormatError: no tokenizer.json, or one of another model type.
    """
    from engine.hf_repo import hf_vocab, load_hf_tokenizer

    path = folder / "tokenizer.json"
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(path, "missing; conversion needs the fast tokenizer file") from None
    model = spec.get("model") or {}
    if model.get("type") != kind:
        raise ModelFormatError(
            path, f"tokenizer model {model.get('type')!r} cannot be converted here ({kind} only)"
        )
    hf = load_hf_tokenizer(path)
    # the ids the folder's own tokenizer encodes with, which the GGUF must keep (not the file's added ids)
    vocab = hf_vocab(path, hf, spec)
    tokens = [f"[PAD{i}]" for i in range(max(vocab.values()) + 1)]
    for text, i in vocab.items():
        tokens[i] = text
    return spec, model, vocab, tokens


def _tokenizer_metadata(folder: Path, tok_config: dict, arch: str = "") -> dict[str, Any]:
    spec, model, vocab, tokens = read_vocab(folder, "BPE")
    n = len(tokens)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    spm = bool(model.get("byte_fallback"))
    types = np.full(n, TOKEN_NORMAL, np.int32)
    if spm:
        for i, t in enumerate(tokens):
            if _BYTE_PIECE.fullmatch(t):
                types[i] = TOKEN_BYTE
    for added in spec.get("added_tokens", []):
        types[vocab[added["content"]]] = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED

    def tid(key):
        v = tok_config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return vocab.get(v) if isinstance(v, str) else None

    md: dict[str, Any] = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types}
    if spm:
        unk = tid("unk_token")
        if unk is not None:
            types[unk] = TOKEN_UNKNOWN
        scores = np.full(n, -1e9, np.float32)
        for rank, m in enumerate(merges):
            left, _, right = m.partition(" ")
            merged = vocab.get(left + right)
            if merged is not None and scores[merged] == -1e9:
                scores[merged] = -float(rank)
        normalizer = spec.get("normalizer") or {}
        steps = [normalizer, *normalizer.get("normalizers", [])]
        md.update(
            {
                "tokenizer.ggml.model": "llama",
                "tokenizer.ggml.pre": "default",
                "tokenizer.ggml.scores": scores,
                "tokenizer.ggml.add_space_prefix": any(s.get("type") == "Prepend" for s in steps),
            }
        )
        if arch == "gemma4":  # llama.cpp reads Gemma 4's vocabulary by its merges (its "gemma4" model)
            md.update({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.pre": "gemma4",
                       "tokenizer.ggml.merges": merges})
    else:
        md.update(
            {
                "tokenizer.ggml.model": "gpt2",
                "tokenizer.ggml.pre": _pre_name(spec),
                "tokenizer.ggml.merges": merges,
            }
        )
    for key, gguf_key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        if (i := tid(key)) is not None:
            md[f"tokenizer.ggml.{gguf_key}"] = i
    md["tokenizer.ggml.add_bos_token"] = bool(tok_config.get("add_bos_token", False))
    md["tokenizer.ggml.add_eos_token"] = bool(tok_config.get("add_eos_token", False))
    return md


_GLM_TYPES = ("glm4", "glm4_moe", "glm4_moe_lite")


def metadata_from_hf(folder: Path, config: dict, cfg) -> dict[str, Any]:
    """GGUF metadata for a Hugging Face folder: hyper-parameters, tokenizer.ggml.*, chat template."""
    from engine.hf_repo import chat_template_source, read_json

    tok_path = folder / "tokenizer_config.json"
    tok_config = read_json(tok_path) if tok_path.exists() else {}
    md = {"general.type": "model", "general.name": folder.name, **_hparams(cfg.architecture, config, cfg)}
    md.update(_tokenizer_metadata(folder, tok_config, cfg.architecture))
    if config.get("model_type") in _GLM_TYPES and md.get("tokenizer.ggml.pre") == "llama-bpe":
        # GLM-4-0414, GLM-4.5/4.6/4.7, GLM-4.7-Flash: llama.cpp's converter names GLM's Llama-3 split glm4
        # (merges applied, no BOS)
        md["tokenizer.ggml.pre"] = "glm4"
    if cfg.architecture in COHERE_ARCHS and md.get("tokenizer.ggml.pre") == "smollm":
        md["tokenizer.ggml.pre"] = "command-r"  # llama.cpp's name for Cohere's split (the same regexes)
    template = chat_template_source(folder, tok_config)
    if template:
        md["tokenizer.chat_template"] = template
    md.update(_embedding_metadata(folder, cfg.architecture, md))
    return md


def _embedding_metadata(folder: Path, arch: str, md: dict[str, Any]) -> dict[str, Any]:
    """A sentence-transformers decoder's keys, as llama.cpp's converter writes them (Qwen3-Embedding):
    `{arch}.pooling_type` from its Pooling module and, when its tokenizer.json post-processor closes every
    input with a special token, that token as EOS with add_eos_token set (gguf-py SpecialVocab's reading of
    TemplateProcessing; the EOS it replaces stays an end of turn as eot_token_id). {} for other folders."""
    from engine.embed import EmbeddingSpec, read_sentence_transformers

    spec = EmbeddingSpec(pooling="mean")
    read_sentence_transformers(folder, spec)
    if not spec.dedicated:
        return {}
    out: dict[str, Any] = {f"{arch}.pooling_type": {"mean": 1, "cls": 2, "last": 3}[spec.pooling]}
    post = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("post_processor") or {}
    for processor in post.get("processors", [post]):
        single = processor.get("single", []) if processor.get("type") == "TemplateProcessing" else []
        last = single[-1].get("SpecialToken", {}).get("id") if len(single) > 1 else None
        if last is None:
            continue
        tokens = md["tokenizer.ggml.tokens"]
        if last in tokens:
            eos = md.get("tokenizer.ggml.eos_token_id")
            new = tokens.index(last)
            if eos is not None and eos != new:
                out["tokenizer.ggml.eot_token_id"] = eos
            out["tokenizer.ggml.eos_token_id"] = new
            out["tokenizer.ggml.add_eos_token"] = True
    return out


# --- export: GGUF metadata -> config.json, tokenizer.json, tokenizer_config.json -------------------

_HF_MODEL = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}


def config_json(metadata: dict[str, Any], vocab_size: int, tied: bool) -> dict[str, Any]:
    """The config.json of a GGUF model (for the families conversion supports)."""
    from engine.arch import model_class

    arch = metadata["general.architecture"]
    if arch not in _HF_MODEL:
        raise ModelFormatError("config.json", f"no Hugging Face layout is known for {arch} models")
    cfg = model_class(arch).config_class.from_gguf(metadata, vocab_size=vocab_size)
    if getattr(cfg, "num_experts", 0):
        raise ModelFormatError(
            "config.json", "exporting mixture-of-experts models to safetensors is not supported yet"
        )
    cls, model_type = _HF_MODEL[arch]
    out: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "vocab_size": vocab_size,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": tied,
        "torch_dtype": "float16",
    }
    scaling = cfg.rope_scaling
    if scaling.kind not in ("none", "default", ""):
        out["rope_scaling"] = {"rope_type": scaling.kind, "factor": scaling.factor}
    if scaling.kind == "yarn":
        out["rope_scaling"].update(
            original_max_position_embeddings=scaling.original_max_position, beta_fast=scaling.beta_fast,
            beta_slow=scaling.beta_slow, attention_factor=rope_attention_factor(scaling),
        )
    if arch == "gemma3":
        out.update(
            {
                "sliding_window": cfg.sliding_window,
                "rope_local_base_freq": cfg.rope_local_base_freq,
                "sliding_window_pattern": cfg.sliding_window_pattern,
                "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
                "final_logit_softcapping": cfg.final_logit_softcapping,
                "attn_logit_softcapping": cfg.attn_logit_softcapping,
                "hidden_activation": "gelu_pytorch_tanh",
            }
        )
        if cfg.layer_types is not None:
            out["layer_types"] = list(cfg.layer_types)
    else:
        out["hidden_act"] = "silu"
    for key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        v = metadata.get(f"tokenizer.ggml.{gguf_key}")
        if v is not None:
            out[key] = int(v)
    return out


def tokenizer_files(metadata: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(tokenizer.json text, tokenizer_config.json object) for a GGUF's vocabulary and chat template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders

    tok = Tokenizer.from_gguf_metadata(metadata)
    hf = HFTokenizer.from_str(tok._hf.to_str())  # a copy: the decoder is set for HF users below
    if tok.kind == "llama":
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if tok.add_space_prefix:
            steps.append(decoders.Strip(" ", 1, 0))
        hf.decoder = decoders.Sequence(steps)
    tok_config: dict[str, Any] = {
        "add_bos_token": tok.add_bos,
        "add_eos_token": tok.add_eos,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
    }
    for key, tid in (
        ("bos_token", tok.bos_id),
        ("eos_token", tok.eos_id),
        ("unk_token", tok.unk_id),
        ("pad_token", tok.pad_id),
    ):
        if tid is not None:
            tok_config[key] = tok.token_text(tid)
    template = metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template:
        tok_config["chat_template"] = template
    return hf.to_str(), tok_config
