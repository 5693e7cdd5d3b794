"""What a Hugging Face config.json says about the language model in it.

Multimodal folders (Gemma 3 4B and up, Mistral Small 3.1, Ministral 3) nest the language model's fields in
text_config, and Google's Gemma 3 configs give only the sizes that differ from transformers' defaults; the
text-only model's fields are those defaults overlaid with text_config.
"""

from __future__ import annotations

from typing import Any

# wrapper model_type -> its language model's model_type when text_config does not name it
_MULTIMODAL = {
    "gemma3": "gemma3_text",
    "gemma4": "gemma4_text",
    "gemma3n": "gemma3n_text",
    "mistral3": "mistral",
    "qwen3_5": "qwen3_5_text",
    "qwen3_5_moe": "qwen3_5_moe_text",
    "qwen3_vl": "qwen3_vl_text",
    "qwen3_vl_moe": "qwen3_vl_moe_text",
    "qwen2_5_vl": "qwen2_5_vl_text",
    "qwen2_vl": "qwen2_vl_text",
}
# transformers' defaults (Gemma3TextConfig, Ministral3Config) for what a text_config may leave out
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6, "sliding_window": 4096,
        "query_pre_attn_scalar": 256,
    },
    "ministral3": {
        "vocab_size": 131_072, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 34,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "max_position_embeddings": 262_144, "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 1_000_000.0, "factor": 16.0,
            "original_max_position_embeddings": 16384, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1,
        },
    },
}


def language_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json fields: a multimodal folder's text_config (with transformers' defaults
    for what it leaves out), else the config itself."""
    text = config.get("text_config")
    wrapper = config.get("model_type")
    if wrapper not in _MULTIMODAL or not isinstance(text, dict):
        return config
    model_type = text.get("model_type") or _MULTIMODAL[wrapper]
    return {**_TEXT_DEFAULTS.get(model_type, {}), **text, "model_type": model_type}


def gemma4_global_shape(config: dict[str, Any]) -> tuple[int, int]:
    """(head_dim, n_kv_heads) of a gemma4_text config's global layers: global_head_dim and
    num_global_key_value_heads as released configs give them, or per_layer_config as transformers writes
    them back (defaults: 512 and the windowed layers' KV heads)."""
    types = config.get("layer_types") or []
    per_layer = {int(i): v for i, v in (config.get("per_layer_config") or {}).items()}
    full = next((per_layer.get(i, {}) for i, t in enumerate(types) if t == "full_attention"), {})
    kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = int(config.get("global_head_dim") or full.get("head_dim") or 512)
    return head_dim, int(config.get("num_global_key_value_heads") or full.get("num_key_value_heads") or kv)
