"""Hugging Face model folders (config.json + safetensors + tokenizer.json) as Hearth models.

Weights stay mapped from the safetensors files (F32/F16/BF16 are kernel formats already); HF tensor
names are mapped to the canonical GGUF names, so each architecture has one code path. The
config.json is translated into the same config dataclass a GGUF's metadata gives.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from engine.arch.deepseek2 import DeepSeek2Config
from engine.arch.deltanet import DeltaShape
from engine.arch.gemma3 import Gemma3Config
from engine.arch.gemma3n import Gemma3nConfig
from engine.arch.gemma4 import Gemma4Config
from engine.arch.llama import LlamaConfig, gpt_oss_layer_types, smollm3_rope_layers, windowed_rope_layers
from engine.arch.mamba2 import MambaShape
from engine.arch.nemotron_h import NemotronHConfig
from engine.errors import MissingTensorError, ModelFormatError, UnsupportedArchitectureError
from engine.hf_experts import FusedExperts
from engine.rope import RopeScaling
from engine.tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    Tokenizer,
    UnsupportedTokenizer,
)
from engine.weights import FLOAT_DTYPES, Weight, float32_of
from models.formats.safetensors import SafetensorsModel, open_safetensors_repo
from models.hf_config import gemma4_global_shape, language_config

# HF model_type -> Hearth architecture name (the GGUF `general.architecture` of the same family)
_FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "ministral3": "mistral3",  # Ministral 3 (text): llama.cpp's mistral3
    "smollm3": "smollm3",
    "granite": "granite",
    "granitemoehybrid": "granite",  # Granite 4.0's non-hybrid members (Micro): attention layers only
    "glm4": "glm4",
    "olmo2": "olmo2",
    "olmo3": "olmo2",  # llama.cpp's name for OLMo 3 too: OLMo 2 with sliding-window layers
    "ernie4_5": "ernie4_5",
    "ernie4_5_moe": "ernie4_5-moe",  # ERNIE-4.5-21B-A3B, 300B-A47B (text): llama.cpp's ernie4_5-moe
    "exaone4": "exaone4",
    "cohere": "command-r",  # Command R (llama.cpp's name)
    "cohere2": "cohere2",  # Command R7B, Command A
    "seed_oss": "seed_oss",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2moe",  # LFM2-8B-A1B
    "qwen3_5_text": "qwen35",  # Qwen3.5 (dense; llama.cpp's name)
    "qwen3_5_moe_text": "qwen35moe",  # Qwen3.5-MoE (35B-A3B, 122B-A10B, ...)
    "qwen3_next": "qwen3next",  # Qwen3-Next (80B-A3B): Qwen3.5-MoE's forerunner
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_vl_text": "qwen3vl",  # Qwen3-VL's language model: Qwen3 with M-RoPE and deepstack
    # Qwen2.5-VL's and Qwen2-VL's language model: Qwen2 with M-RoPE, llama.cpp's qwen2vl (the published
    # configs keep its fields at the top level, transformers 5 in text_config)
    "qwen2_5_vl_text": "qwen2vl",
    "qwen2_5_vl": "qwen2vl",
    "qwen2_vl_text": "qwen2vl",  # Qwen2-VL's: the same
    "qwen2_vl": "qwen2vl",
    "phi3": "phi3",
    "gemma3_text": "gemma3",
    "gemma2": "gemma2",
    "gemma4_text": "gemma4",
    "gemma3n_text": "gemma3n",  # Gemma 3n's language model (E2B, E4B)
    "nemotron_h": "nemotron_h",  # dense Nemotron-H (Mamba-2, attention and MLP blocks)
    "mixtral": "llama",  # llama.cpp's name for Mixtral too: a llama with experts
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "qwen3_vl_moe_text": "qwen3vlmoe",  # Qwen3-VL-30B-A3B, 235B-A22B: Qwen3-MoE with M-RoPE and deepstack
    "glm4_moe": "glm4moe",  # GLM-4.5 / 4.6 / 4.7 (MoE)
    "gpt_oss": "gpt-oss",
    "deepseek_v2": "deepseek2",  # DeepSeek-V2(-Lite): multi-head latent attention (engine/arch/deepseek2.py)
    "deepseek_v3": "deepseek2",  # DeepSeek-V3's architecture (Moonlight-16B-A3B)
    "glm4_moe_lite": "deepseek2",  # GLM-4.7-Flash
}

# HF per-layer name -> GGUF per-layer name
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",  # gpt-oss
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",  # gate rows then up rows, as GGUF's phi3 stores it
    "mlp.gate.weight": "ffn_gate_inp.weight",  # mixture-of-experts routers: Qwen3-MoE, Mixtral
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",  # gpt-oss
    "mlp.router.bias": "ffn_gate_inp.bias",
    "post_self_attn_layernorm.weight": "post_attention_norm.weight",  # GLM-4's norms of the branch outputs
    "post_mlp_layernorm.weight": "post_ffw_norm.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",  # Qwen2-MoE's shared expert
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",  # GLM-4.5's (ungated) shared experts
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",  # GLM-4.5's routing bias
    "mlp.moe_statics.e_score_correction_bias": "exp_probs_b.bias",  # ERNIE 4.5 MoE's, (1, experts)
    "shared_mlp.input_linear.weight": "ffn_up.weight",  # Granite 4.0: gate rows then up rows, as Phi-3's
    "shared_mlp.output_linear.weight": "ffn_down.weight",
}
# experts: HF keeps one tensor per expert, GGUF one (experts, rows, cols) tensor; expert e of GGUF tensor T
# is named T.e here (HFWeights.experts)
_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe|feed_forward)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_KIND = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_EXPERT_KIND |= {"w1": "gate", "w3": "up", "w2": "down"}  # Mixtral's names
_GEMMA = ("gemma3", "gemma2")  # the architectures of engine/arch/gemma3.py
# Gemma 3 has four norms per layer; HF's post_attention_layernorm is the llama family's ffn_norm
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# OLMo 2 and EXAONE 4 norm the branch outputs: HF's post_attention_layernorm is llama.cpp's
# post_attention_norm
_OLMO2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# gpt-oss and GLM-4.5 keep the pre-FFN norm, which llama.cpp names post_attention_norm for them (the llama
# architecture reads it as the FFN norm when no ffn_norm is present)
_POST_ATTN_FFN_NORM = {**_LAYER_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight"}
# LFM2: its own names for the norms, FFN and attention output; the short convolution in its other layers
_LFM2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "operator_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "feed_forward.w1.weight": "ffn_gate.weight",
    "feed_forward.w3.weight": "ffn_up.weight",
    "feed_forward.w2.weight": "ffn_down.weight",
    "self_attn.q_layernorm.weight": "attn_q_norm.weight",
    "self_attn.k_layernorm.weight": "attn_k_norm.weight",
    "self_attn.out_proj.weight": "attn_output.weight",
    "conv.conv.weight": "shortconv.conv.weight",  # (hidden, 1, taps) in HF, (hidden, taps) in GGUF
    "conv.in_proj.weight": "shortconv.in_proj.weight",
    "conv.out_proj.weight": "shortconv.out_proj.weight",
    "feed_forward.gate.weight": "ffn_gate_inp.weight",  # LFM2-MoE's router and its choice bias
    "feed_forward.expert_bias": "exp_probs_b.bias",
}
# Qwen3.5: its gated DeltaNet layers (llama.cpp's qwen35 names); A_log is read as -exp(A_log) (ssm_a)
_QWEN35_LAYER_NAMES = {
    **_LAYER_NAMES,
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
    "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight",
    "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",  # (conv_dim, 1, taps) in HF, (conv_dim, taps) in GGUF
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",  # the pre-FFN norm (llama.cpp's name)
}
# Qwen3-Next: Qwen3.5's names, its DeltaNet's input projections fused per key head (engine.arch.deltanet;
# llama.cpp's names for them as they stand: ssm_in, as its older qwen3next GGUFs keep it, and ssm_ba)
_QWEN3NEXT_LAYER_NAMES = {
    **_QWEN35_LAYER_NAMES,
    "linear_attn.in_proj_qkvz.weight": "ssm_in.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
}
# Gemma 4: Gemma 3's four norms, its layer scalar, per-layer-embedding pieces and experts beside the MLP
# (llama.cpp's gemma4 names; the router's per-expert scale is its ffn_down_exps.scale)
_GEMMA4_LAYER_NAMES = {
    **_GEMMA3_LAYER_NAMES,
    "layer_scalar": "layer_output_scale.weight",
    "per_layer_input_gate.weight": "inp_gate.weight",
    "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight",
    "router.proj.weight": "ffn_gate_inp.weight",
    "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale",
    "experts.gate_up_proj": "ffn_gate_up_exps.weight",  # (experts, 2 ff, hidden): gate rows, then up rows
    "experts.down_proj": "ffn_down_exps.weight",
    "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
}
# Gemma 3n: Gemma 4's names (no layer scalar, experts) plus AltUp's and LAuReL's (llama.cpp's gemma3n names)
_GEMMA3N_LAYER_NAMES = {
    **_GEMMA4_LAYER_NAMES,
    "altup.correct_output_scale": "altup_correct_scale.weight",
    "altup.correction_coefs.weight": "altup_correct_coef.weight",
    "altup.prediction_coefs.weight": "altup_predict_coef.weight",
    "altup.modality_router.weight": "altup_router.weight",
    "altup.router_norm.weight": "altup_router_norm.weight",
    "laurel.linear_left.weight": "laurel_l.weight",
    "laurel.linear_right.weight": "laurel_r.weight",
    "laurel.post_laurel_norm.weight": "laurel_post_norm.weight",
}
# Gemma 3n's AltUp stream projections, one HF tensor per extra stream: GGUF's stacked tensor's name, entry .k
_ALTUP_PROJ_RE = re.compile(r"model\.altup_(unembed_)?projections\.(\d+)\.weight")
# Granite 4.0-H: its Mamba-2 layers (llama.cpp's granitehybrid names); A_log is read as -exp(A_log) (ssm_a)
_GRANITE_HYBRID_LAYER_NAMES = {
    **_LAYER_NAMES,
    "mamba.in_proj.weight": "ssm_in.weight",
    "mamba.conv1d.weight": "ssm_conv1d.weight",  # (conv_dim, 1, taps) in HF, (conv_dim, taps) in GGUF
    "mamba.conv1d.bias": "ssm_conv1d.bias",
    "mamba.dt_bias": "ssm_dt.bias",
    "mamba.A_log": "ssm_a",
    "mamba.D": "ssm_d",
    "mamba.norm.weight": "ssm_norm.weight",
    "mamba.out_proj.weight": "ssm_out.weight",
}
# Granite 4.0-H Tiny / Small: experts (input_linear: each expert's gate rows then up rows) beside the shared
# MLP, which is their shared expert
_GRANITE_HYBRID_MOE_LAYER_NAMES = {
    **_GRANITE_HYBRID_LAYER_NAMES,
    "block_sparse_moe.input_linear.weight": "ffn_gate_up_exps.weight",
    "block_sparse_moe.output_linear.weight": "ffn_down_exps.weight",
    "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight",
    "shared_mlp.input_linear.weight": "ffn_up_shexp.weight",  # gate rows, then up rows
    "shared_mlp.output_linear.weight": "ffn_down_shexp.weight",
}
# Nemotron-H: each block's norm and its one mixer (llama.cpp's nemotron_h names)
_NEMOTRON_H_LAYER_NAMES = {
    "norm.weight": "attn_norm.weight",
    **{
        "mixer." + hf.removeprefix("mamba."): gguf
        for hf, gguf in _GRANITE_HYBRID_LAYER_NAMES.items()
        if hf.startswith("mamba.")
    },
    "mixer.q_proj.weight": "attn_q.weight",
    "mixer.k_proj.weight": "attn_k.weight",
    "mixer.v_proj.weight": "attn_v.weight",
    "mixer.o_proj.weight": "attn_output.weight",
    "mixer.up_proj.weight": "ffn_up.weight",
    "mixer.down_proj.weight": "ffn_down.weight",
}
# DeepSeek-V2/V3, GLM-4.7-Flash: multi-head latent attention (llama.cpp's deepseek2 names; kv_b_proj stays
# whole, engine/arch/deepseek2.py splits it)
_DEEPSEEK2_LAYER_NAMES = {
    **_LAYER_NAMES,
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
}
_ARCH_LAYER_NAMES = {
    "deepseek2": _DEEPSEEK2_LAYER_NAMES,
    "gemma4": _GEMMA4_LAYER_NAMES,
    "gemma3n": _GEMMA3N_LAYER_NAMES,
    "nemotron_h": _NEMOTRON_H_LAYER_NAMES,
    "granitehybrid": _GRANITE_HYBRID_LAYER_NAMES,
    "qwen35": _QWEN35_LAYER_NAMES,
    "qwen35moe": _QWEN35_LAYER_NAMES,
    "qwen3next": _QWEN3NEXT_LAYER_NAMES,
    "lfm2": _LFM2_LAYER_NAMES,
    "lfm2moe": _LFM2_LAYER_NAMES,
    "olmo2": _OLMO2_LAYER_NAMES,
    "exaone4": _OLMO2_LAYER_NAMES,
    "gpt-oss": _POST_ATTN_FFN_NORM,
    "glm4moe": _POST_ATTN_FFN_NORM,
}
_QWEN35_ARCHS = ("qwen35", "qwen35moe", "qwen3next")  # gated DeltaNet beside gated attention
_COHERE = ("cohere", "cohere2")  # model types: LayerNorm, parallel blocks, adjacent RoPE pairs, logit_scale
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.embedding_norm.weight": "token_embd_norm.weight",  # LFM2's final norm (llama.cpp's name)
    "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",  # Gemma 4's per-layer embeddings
    "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
    "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight",
    "model.embeddings.weight": "token_embd.weight",  # Nemotron-H (its backbone.* names)
    "model.norm_f.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# multimodal folders (Gemma 3 4B and up, Mistral Small 3.1, Ministral 3): the language model's tensors under
# these prefixes (transformers' layouts of 2025 and of 2026), the vision tower's left out
_LANGUAGE_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("backbone.", "model."),  # Nemotron-H's text model
)
# gpt-oss's and Qwen3-VL-MoE's fused expert tensors (engine/hf_experts.py), by the GGUF names they stand for
_FUSED_EXPERTS_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(?:gate_up|down)_proj(?:_blocks)?")
_GGUF_EXPERTS_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.(weight|bias)")


# the encoder families (embedding models): config.json model_type -> architecture
ENCODER_TYPES = {
    "bert": "bert", "nomic_bert": "nomic-bert", "xlm-roberta": "bert", "xlm_roberta": "bert",
    "modernbert": "modern-bert",
}


def encoder_family(arch: str):
    """(config class, hf_names) of an encoder architecture (engine/arch/bert.py, nomic_bert.py,
    modernbert.py)."""
    if arch == "nomic-bert":
        from engine.arch.nomic_bert import NomicBertConfig, hf_names

        return NomicBertConfig, hf_names
    if arch == "modern-bert":
        from engine.arch.modernbert import ModernBertConfig, hf_names

        return ModernBertConfig, hf_names
    from engine.arch.bert import BertConfig, hf_names

    return BertConfig, hf_names


def is_hf_repo(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelFormatError(path, "missing; a Hugging Face model folder needs it") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelFormatError(path, f"not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelFormatError(path, "expected a JSON object")
    return data


class HFWeights:
    """A weight source (has/matrix/vector by GGUF name) over a mapped safetensors repo.

    Fused HF tensors (Phi-3's qkv_proj, gate_up_proj) keep their GGUF names (attn_qkv, a 2*ff-row
    ffn_up); the architecture splits them into row blocks.
    """

    def __init__(self, st: SafetensorsModel, folder: Path, arch: str):
        self.st = st
        self.folder = folder
        layer_names = _GEMMA3_LAYER_NAMES if arch in _GEMMA else _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
        if arch == "granitehybrid" and any(".block_sparse_moe." in t for t in st.tensors):
            layer_names = _GRANITE_HYBRID_MOE_LAYER_NAMES
        self.names = {g: hf for hf in st.tensors if (g := _gguf_name(hf, layer_names))}
        if arch in ENCODER_TYPES.values():  # an encoder's own names (engine/arch/bert.py, nomic_bert.py)
            self.names = encoder_family(arch)[1](st.tensors)
        # AutoAWQ linears (prefix + qweight/qzeros/scales) run as Q4_1: engine/quant/awq_pack.py
        self.awq = {
            g: hf[: -len("qweight")]
            for hf in st.tensors
            if hf.endswith(".qweight") and (g := _gguf_name(hf[: -len("qweight")] + "weight", layer_names))
        }
        # Gemma's, Qwen3.5's and Qwen3-Next's RMSNorms multiply by (1 + w); GGUF files (and so our
        # architecture) store 1 + w (not the gated norm in their DeltaNet layers, which multiplies by w)
        self.norm_offset = 1.0 if arch in _GEMMA or arch in _QWEN35_ARCHS else 0.0
        # FP8 / NVFP4 linears: engine/quant/fp_load.py (compressed-tensors NVFP4 codes are weight_packed)
        for hf in st.tensors:
            if hf.endswith(".weight_packed") and (g := _gguf_name(hf[: -len("_packed")], layer_names)):
                self.names.setdefault(g, hf)
        # gpt-oss, Qwen3-VL-MoE (gate and up as halves): per layer, the fused experts the GGUF-named expert
        # tensors are cut from
        self.fused = {
            int(m.group(1)): FusedExperts(st, folder, hf[: hf.rindex("experts.") + len("experts.")],
                                          halves=arch == "qwen3vlmoe")
            for hf in st.tensors
            if (m := _FUSED_EXPERTS_RE.fullmatch(_language_name(hf)))
        }

    def _fused(self, name: str) -> tuple[FusedExperts, str, str] | None:
        """(the layer's fused experts, kind, "weight"/"bias") for a GGUF expert tensor name they hold."""
        m = _GGUF_EXPERTS_RE.fullmatch(name)
        fused = self.fused.get(int(m.group(1))) if m else None
        if fused is None or not fused.has(m.group(2), m.group(3)):
            return None
        return fused, m.group(2), m.group(3)

    def has(self, name: str) -> bool:
        return name in self.names or name in self.awq or self._fused(name) is not None

    def _tensor(self, name: str):
        hf_name = self.names.get(name)
        if hf_name is None:
            raise MissingTensorError(
                self.folder, f"tensor for {name!r} is missing from the safetensors files"
            )
        dtype = self.st.tensors[hf_name].dtype
        if dtype not in FLOAT_DTYPES:
            raise ModelFormatError(
                self.folder,
                f"tensor {hf_name!r} is {dtype}; Hearth loads F32, F16 and BF16 safetensors weights "
                "(convert or pick another repo)",
            )
        return self.st.array(hf_name), dtype

    def matrix(self, name: str, rows: int, cols: int) -> Weight:
        if name in self.awq:
            from engine.quant.awq_pack import awq_weight

            return awq_weight(self.st, self.awq[name], rows, cols, self.folder)
        hf_name = self.names.get(name)
        if hf_name is not None and self.st.tensors[hf_name].dtype in ("F8_E4M3", "U8"):
            from engine.quant.fp_load import fp_matrix

            return fp_matrix(self.st, self.folder, hf_name, rows, cols)
        array, dtype = self._tensor(name)
        if array.shape != (rows, cols):
            raise MissingTensorError(
                self.folder, f"tensor for {name!r} has shape {array.shape}, expected {(rows, cols)}"
            )
        raw = np.ascontiguousarray(array).view(np.uint8)
        return Weight(FLOAT_DTYPES[dtype], raw, rows, cols)

    def experts(self, name: str, n: int, rows: int, cols: int) -> list[Weight]:
        """The n (rows, cols) matrices of GGUF expert tensor `name`: one HF tensor each, or row blocks of
        gpt-oss's fused tensors."""
        stack = self.expert_stack(name, n, rows, cols)
        if stack is not None:
            return [stack.row_block(e * rows, (e + 1) * rows) for e in range(n)]
        return [self.matrix(f"{name}.{e}", rows, cols) for e in range(n)]

    def expert_stack(self, name: str, n: int, rows: int, cols: int) -> Weight | None:
        """The (n * rows, cols) merged weight of GGUF expert tensor `name` (gpt-oss's fused tensors, Gemma 4's
        (experts, rows, cols) ones), None for experts kept one tensor each."""
        fused = self._fused(name)
        if fused is not None:
            return fused[0].stack(fused[1], n, rows, cols)
        if name not in self.names:
            return None
        array, dtype = self._tensor(name)
        if array.shape != (n, rows, cols):
            raise MissingTensorError(
                self.folder, f"tensor for {name!r} has shape {array.shape}, expected {(n, rows, cols)}"
            )
        raw = np.ascontiguousarray(array).view(np.uint8).reshape(n * rows, -1)
        return Weight(FLOAT_DTYPES[dtype], raw, n * rows, cols)

    def vector(self, name: str, n: int) -> np.ndarray:
        return self.floats(name, (n,))

    def floats(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A small tensor (norms, biases, sinks) of `shape` as float32."""
        fused = self._fused(name)
        if fused is not None:
            return fused[0].bias(fused[1], *shape)
        array, dtype = self._tensor(name)
        array = conv_kernel_2d(name, array)
        if array.shape != shape:
            raise MissingTensorError(
                self.folder, f"tensor for {name!r} has shape {array.shape}, expected {shape}"
            )
        vector = float32_of(array, dtype == "BF16")
        if self.norm_offset and name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
            vector = vector + np.float32(self.norm_offset)
        if name.endswith(".ssm_a"):  # HF's A_log
            vector = -np.exp(vector)
        return vector


def conv_kernel_shape(gguf_name: str, shape) -> tuple[int, ...]:
    """A tensor's shape as GGUF keeps it: LFM2's convolution kernels lose the middle axis of HF's
    (hidden, 1, taps)."""
    shape = tuple(int(n) for n in shape)
    kernels = ("shortconv.conv.weight", "ssm_conv1d.weight")
    if gguf_name.endswith(kernels) and len(shape) == 3 and shape[1] == 1:
        return shape[0], shape[2]
    return shape


def conv_kernel_2d(gguf_name: str, array):
    """The array with conv_kernel_shape's shape (a view)."""
    return array.reshape(conv_kernel_shape(gguf_name, array.shape))


def _language_name(hf_name: str) -> str:
    """A multimodal folder's language-model tensor under the text-only model's name."""
    for prefix, plain in _LANGUAGE_PREFIXES:
        if hf_name.startswith(prefix):
            return plain + hf_name[len(prefix) :]
    if hf_name.startswith(("layers.", "embed_tokens.", "norm.")):  # a bare base model (Qwen3-Embedding's)
        return "model." + hf_name
    return hf_name


def _gguf_name(hf_name: str, layer_names: dict[str, str]) -> str | None:
    hf_name = _language_name(hf_name)
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    if a := _ALTUP_PROJ_RE.fullmatch(hf_name):
        return f"altup_{'unembd_' if a.group(1) else ''}proj.weight.{a.group(2)}"
    m = _LAYER_RE.fullmatch(hf_name)
    if m and m.group(2) in layer_names:
        return f"blk.{m.group(1)}.{layer_names[m.group(2)]}"
    e = _EXPERT_RE.fullmatch(m.group(2)) if m else None
    if e and e.group(2) in _EXPERT_KIND:
        return f"blk.{m.group(1)}.ffn_{_EXPERT_KIND[e.group(2)]}_exps.weight.{e.group(1)}"
    return None


def _rope_scaling(config: dict) -> tuple[float, RopeScaling]:
    """(rope theta, scaling) from either the transformers-5 `rope_parameters` or older fields; for OLMo 3's
    parameters per layer type, the full-attention layers' (its windowed layers rotate unscaled with the
    same theta: LlamaConfig.window_rope_unscaled)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "full_attention" in params:  # OLMo 3: parameters per layer type
        local, params = params.get("sliding_attention") or {}, params["full_attention"]
        same_theta = local.get("rope_theta", params.get("rope_theta")) == params.get("rope_theta")
        if (local.get("rope_type") or "default") != "default" or not same_theta:
            raise UnsupportedArchitectureError(
                f"RoPE parameters per layer type {config.get('rope_parameters')} are not supported yet "
                "(the sliding-window layers' must be unscaled, with the full layers' theta)"
            )
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind in ("default", "mrope"):  # Qwen2.5-VL's published "mrope": plain frequencies, turned per axis
        return theta, RopeScaling()
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "yarn":  # transformers' _compute_yarn_parameters
        original = int(params.get("original_max_position_embeddings") or config["max_position_embeddings"])
        factor = params.get("factor") or int(config["max_position_embeddings"]) / original
        attention = params.get("attention_factor")
        return theta, RopeScaling(
            "yarn",
            float(factor),
            original_max_position=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=None if attention is None else float(attention),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            truncate=bool(params.get("truncate", True)),
        )
    if kind in ("longrope", "su"):  # Phi-3.5 / Phi-4-mini: transformers' _compute_longrope_parameters
        max_pos = int(config["max_position_embeddings"])
        key = "original_max_position_embeddings"
        original = int(params.get(key) or config.get(key) or max_pos)
        attention = params.get("attention_factor")
        return theta, RopeScaling(
            "longrope",
            float(params.get("factor") or max_pos / original),
            original_max_position=original,
            attention_factor=None if attention is None else float(attention),
            short_factor=tuple(float(f) for f in params["short_factor"]),
            long_factor=tuple(float(f) for f in params["long_factor"]),
        )
    if kind == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params.get("low_freq_factor", 1.0)),
            float(params.get("high_freq_factor", 4.0)),
            int(params.get("original_max_position_embeddings", 8192)),
        )
    raise UnsupportedArchitectureError(
        f"RoPE scaling {kind!r} is not supported yet (supported: linear, llama3, yarn, longrope)"
    )


def _gemma3_config(config: dict, arch: str = "gemma3") -> Gemma3Config:
    params = config.get("rope_parameters") or {}
    # transformers 5's parameters per layer type, or older configs' rope_scaling (the global layers')
    full = params.get("full_attention", params) or config.get("rope_scaling") or {}
    local = params.get("sliding_attention", {})
    _, scaling = _rope_scaling({"rope_parameters": full})
    heads = int(config["num_attention_heads"])
    gemma2 = arch == "gemma2"  # one RoPE base for all layers, the window on every other layer
    return Gemma3Config(
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(config["vocab_size"]),
        head_dim=int(config.get("head_dim", 256)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(full.get("rope_theta", config.get("rope_theta", 1_000_000.0))),
        rope_local_base_freq=float(
            full.get("rope_theta", config.get("rope_theta", 10_000.0)) if gemma2
            else local.get("rope_theta", config.get("rope_local_base_freq", 10_000.0))
        ),
        rope_scaling=scaling,
        sliding_window=int(config.get("sliding_window") or 4096),
        sliding_window_pattern=int(
            config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
            or (2 if gemma2 else 6)
        ),
        layer_types=config.get("layer_types"),
        max_position_embeddings=int(config.get("max_position_embeddings", 32768)),
        query_pre_attn_scalar=float(config.get("query_pre_attn_scalar") or 0),
        final_logit_softcapping=config.get("final_logit_softcapping"),
        attn_logit_softcapping=config.get("attn_logit_softcapping"),
        architecture=arch,
    )


def _gemma4_config(config: dict) -> Gemma4Config:
    """Gemma4TextConfig's fields; the global layers' head size and KV heads from global_head_dim /
    num_global_key_value_heads, or per_layer_config as transformers writes it back."""
    types = config.get("layer_types")
    n = int(config["num_hidden_layers"])
    head_dim = int(config.get("head_dim", 256))
    global_head_dim, global_kv = gemma4_global_shape(config)
    kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    if config.get("use_bidirectional_attention") == "all":
        raise UnsupportedArchitectureError("bidirectional Gemma 4 is an encoder, not a chat model")
    params = config.get("rope_parameters") or {}
    full_rope, local_rope = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    for kind, rope in (("full_attention", full_rope), ("sliding_attention", local_rope)):
        if (rope.get("rope_type") or "default") not in ("default", "proportional"):
            kind_name = rope.get("rope_type")
            raise UnsupportedArchitectureError(f"Gemma 4 {kind} RoPE {kind_name!r} is not supported")
    global_rotary = float(full_rope.get("partial_rotary_factor", 1.0)) if full_rope.get(
        "rope_type") == "proportional" else 1.0
    experts = int(config.get("num_experts") or 0) if config.get("enable_moe_block") else 0
    return Gemma4Config(
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=n,
        num_attention_heads=int(config["num_attention_heads"]),
        num_key_value_heads=kv,
        num_global_key_value_heads=global_kv,
        vocab_size=int(config["vocab_size"]),
        head_dim=head_dim,
        global_head_dim=global_head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(full_rope.get("rope_theta", 1_000_000.0)),
        rope_local_base_freq=float(local_rope.get("rope_theta", 10_000.0)),
        global_rotary_factor=global_rotary,
        global_rope_factor=float(full_rope.get("factor") or 1.0),
        local_rotary_dim=int(head_dim * float(local_rope.get("partial_rotary_factor", 1.0))),
        sliding_window=int(config.get("sliding_window") or 512),
        layer_types=types,
        max_position_embeddings=int(config.get("max_position_embeddings", 131_072)),
        final_logit_softcapping=config.get("final_logit_softcapping"),
        num_kv_shared_layers=int(config.get("num_kv_shared_layers") or 0),
        hidden_size_per_layer_input=int(config.get("hidden_size_per_layer_input") or 0),
        vocab_size_per_layer_input=int(config.get("vocab_size_per_layer_input") or 0),
        use_double_wide_mlp=bool(config.get("use_double_wide_mlp")),
        num_experts=experts,
        num_experts_per_tok=int(config.get("top_k_experts") or 0) if experts else 0,
        moe_intermediate_size=int(config.get("moe_intermediate_size") or 0) if experts else 0,
    )


def _gemma3n_config(config: dict) -> Gemma3nConfig:
    """Gemma3nTextConfig's fields (intermediate_size: one length or one per layer)."""
    params = config.get("rope_parameters") or {}
    full_rope, local_rope = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    for kind, rope in (("full_attention", full_rope), ("sliding_attention", local_rope)):
        if (rope.get("rope_type") or "default") != "default":
            kind_name = rope.get("rope_type")
            raise UnsupportedArchitectureError(f"Gemma 3n {kind} RoPE {kind_name!r} is not supported")
    n = int(config["num_hidden_layers"])
    ff = config["intermediate_size"]
    ff = [int(v) for v in ff] if isinstance(ff, list) else [int(ff)] * n
    heads = int(config["num_attention_heads"])
    return Gemma3nConfig(
        hidden_size=int(config["hidden_size"]),
        intermediate_size=ff[0],
        intermediate_sizes=ff,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(config["vocab_size"]),
        head_dim=int(config.get("head_dim", 256)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=float(full_rope.get("rope_theta", config.get("rope_theta", 1_000_000.0))),
        rope_local_base_freq=float(local_rope.get("rope_theta", 10_000.0)),
        sliding_window=int(config.get("sliding_window") or 512),
        layer_types=config.get("layer_types"),
        max_position_embeddings=int(config.get("max_position_embeddings", 32_768)),
        final_logit_softcapping=config.get("final_logit_softcapping"),
        num_kv_shared_layers=int(config.get("num_kv_shared_layers", 15)),
        hidden_size_per_layer_input=int(config.get("hidden_size_per_layer_input", 256)),
        vocab_size_per_layer_input=int(config.get("vocab_size_per_layer_input", 262_144)),
        altup_num_inputs=int(config.get("altup_num_inputs", 4)),
        altup_active_idx=int(config.get("altup_active_idx", 0)),
        altup_correct_scale=bool(config.get("altup_correct_scale", True)),
        laurel_rank=int(config.get("laurel_rank", 64)),
        activation_sparsity_pattern=config.get("activation_sparsity_pattern"),
    )


_NEMOTRON_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe", "linear_attention": "mamba",
                   "full_attention": "attention", "mamba": "mamba", "attention": "attention", "mlp": "mlp",
                   "moe": "moe"}


def _nemotron_h_config(config: dict) -> NemotronHConfig:
    """NemotronHConfig's fields: block kinds from layers_block_type or the older hybrid_override_pattern
    ("M" Mamba-2, "*" attention, "-" MLP); the mixtures of experts (Nemotron 3) are refused."""
    types = config.get("layers_block_type") or config.get("layer_types")
    types = types or list(config["hybrid_override_pattern"])
    kinds = tuple(_NEMOTRON_KINDS.get(t, t) for t in types)
    if "moe" in kinds:
        raise UnsupportedArchitectureError("Nemotron-H mixtures of experts (Nemotron 3) are not supported")
    if config.get("mlp_hidden_act", "relu2") != "relu2" or config.get("mamba_hidden_act", "silu") != "silu":
        raise UnsupportedArchitectureError("Nemotron-H needs relu2 MLPs and SiLU in its Mamba-2 layers")
    if config.get("mlp_bias") or config.get("attention_bias") or config.get("mamba_proj_bias"):
        raise UnsupportedArchitectureError("Nemotron-H with linear biases is not supported yet")
    heads = int(config.get("mamba_num_heads") or 128)
    lo, hi = (float(v["__float__"] if isinstance(v, dict) else v)
              for v in config.get("time_step_limit") or (0.0, float("inf")))
    n_heads = int(config["num_attention_heads"])
    return NemotronHConfig(
        hidden_size=int(config["hidden_size"]),
        vocab_size=int(config["vocab_size"]),
        kinds=kinds,
        num_attention_heads=n_heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or n_heads),
        head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // n_heads),
        intermediate_size=int(config["intermediate_size"]),
        mamba=MambaShape(
            heads=heads, head_dim=int(config.get("mamba_head_dim") or 64),
            state_size=int(config.get("ssm_state_size") or 128), groups=int(config.get("n_groups") or 8),
            taps=int(config.get("conv_kernel") or 4), dt_min=lo, dt_max=hi,
        ),
        rms_norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
    )


def config_from_hf(folder: Path, config: dict):
    """The architecture config for a config.json (a multimodal folder's: its language model's). Raises
    UnsupportedArchitectureError for other families."""
    if config.get("model_type") in ENCODER_TYPES:  # an encoder (embeddings only): engine/arch/bert.py, ...
        config_class, _ = encoder_family(ENCODER_TYPES[config["model_type"]])
        try:
            return config_class.from_hf(config)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(folder / "config.json", f"missing or invalid hyper-parameter ({e})") from e
    deepstack = _deepstack_layers(config)
    config = language_config(config)
    model_type = config.get("model_type")
    arch = _FAMILIES.get(model_type)
    if arch is None:
        raise UnsupportedArchitectureError(
            f"{folder}: model_type {model_type!r} is not supported from safetensors yet "
            f"(supported: {', '.join(sorted(_FAMILIES))})"
        )
    if arch == "deepseek2":
        try:
            return DeepSeek2Config.from_hf(config, *_rope_scaling(config))
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(folder / "config.json", f"missing or invalid hyper-parameter ({e})") from e
    if arch in (*_GEMMA, "gemma4", "gemma3n", "nemotron_h"):
        try:
            if arch == "nemotron_h":
                return _nemotron_h_config(config)
            if arch == "gemma3n":
                return _gemma3n_config(config)
            return _gemma4_config(config) if arch == "gemma4" else _gemma3_config(config, arch)
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(folder / "config.json", f"missing or invalid hyper-parameter ({e})") from e
    # partial rotary embeddings (Phi-4-mini: 0.75): the first part of each head turns, the rest does not
    rotary = float(
        config.get("partial_rotary_factor")
        or (config.get("rope_parameters") or {}).get("partial_rotary_factor")
        or 1.0
    )
    theta, scaling = _rope_scaling(config)
    _refuse_linear_biases(config)
    lfm2 = _lfm2(config)
    granite4 = _granite4(config)
    arch = granite4.pop("architecture", arch)  # Granite 4.0-H: llama.cpp's granitehybrid
    qwen35 = _qwen35(config)
    try:
        ernie = _ernie4_5_moe(config)
        experts = ernie.pop("num_experts", 0) or config.get("num_experts") or config.get("num_local_experts")
        experts = int(experts or config.get("n_routed_experts") or 0)
        sparse_steps = config.get("mlp_only_layers") or int(config.get("decoder_sparse_step") or 1) != 1
        if experts and sparse_steps and model_type != "qwen3_next":
            raise UnsupportedArchitectureError(
                f"{folder}: mixture-of-experts models with dense layers between the sparse ones "
                "(mlp_only_layers / decoder_sparse_step) are not supported yet"
            )
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        qwen_moe = model_type in ("qwen2_moe", "qwen3_moe", "qwen3_5_moe_text", "qwen3_vl_moe_text",
                                  "qwen3_next")
        # the experts' FFN length (GLM-4.5's intermediate_size is its dense layers')
        expert_sized = qwen_moe or (experts and model_type in ("glm4_moe", "lfm2_moe", "ernie4_5_moe"))
        # LFM2 sizes its FFN from block_ff_dim (_lfm2)
        ff_key = "moe_intermediate_size" if expert_sized else "intermediate_size"
        ff = (lfm2.pop("intermediate_size", 0) or granite4.pop("intermediate_size", 0)
              or ernie.pop("intermediate_size", 0) or int(config[ff_key]))
        top_k = ernie.pop("num_experts_per_tok", 0)
        # Mixtral always renormalizes the chosen experts' weights (gpt-oss's softmax over the chosen
        # logits is the same numbers); Qwen2/3-MoE say so in their configs; GLM-4.5 routes its own way
        moe = {
            # Qwen3.5-MoE and Qwen3-VL-MoE always renormalize (their configs have no key for it), Qwen3-Next
            # unless its config says otherwise
            "norm_topk_prob": bool(config.get("norm_topk_prob", model_type == "qwen3_next"))
            if qwen_moe and model_type not in ("qwen3_5_moe_text", "qwen3_vl_moe_text") else True,
            "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size") or 0)
            if model_type in ("qwen2_moe", "qwen3_5_moe_text", "qwen3_next")
            else granite4.pop("shared_expert_intermediate_size", 0),
        } | _sigmoid_moe(config, ff) | ernie
        return LlamaConfig(
            hidden_size=hidden,
            intermediate_size=ff,
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            vocab_size=int(config["vocab_size"]),
            rms_norm_eps=float(lfm2.pop("rms_norm_eps", config.get(
                "layer_norm_eps" if model_type in _COHERE else "rms_norm_eps", 1e-5))),
            rope_theta=theta,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            head_dim=head_dim,
            rotary_dim=int(head_dim * rotary),
            # HF checkpoints keep q/k in the half-split layout (rotate_half); only llama.cpp's
            # converter permutes them for adjacent-pair RoPE. GLM-4, ERNIE 4.5 and Cohere rotate adjacent
            # pairs.
            rope_neox=model_type not in ("glm4", "ernie4_5", "ernie4_5_moe", *_COHERE),
            rope_scaling=scaling,
            architecture=arch,
            num_experts=experts,
            num_experts_per_tok=int(top_k or config["num_experts_per_tok"]) if experts else 0,
            **moe,
            expert_act="swiglu_oai" if model_type == "gpt_oss" else "silu",
            swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(config.get("swiglu_limit", 7.0)),
            **_sliding_window(config),
            rope_layers=granite4.pop("rope_layers", None) or _rope_layers(config),
            window_rope_unscaled=model_type == "olmo3",
            **_granite_constants(config),
            logit_scale=float(config.get("logit_scale") or 1.0) if model_type in _COHERE else 1.0,
            **_attn_temperature(config),
            **lfm2,
            **granite4,
            **qwen35,
            deepstack_layers=deepstack,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(folder / "config.json", f"missing or invalid hyper-parameter ({e})") from e


def _deepstack_layers(config: dict) -> int:
    """How many deepstack sets a Qwen3-VL (dense or MoE) folder's vision tower adds to its first text layers
    (transformers' default deepstack_visual_indexes (8, 16, 24) when its vision_config gives none); 0 for
    other folders."""
    vision = config.get("vision_config")
    if config.get("model_type") not in ("qwen3_vl", "qwen3_vl_moe") or not isinstance(vision, dict):
        return 0
    return len(vision.get("deepstack_visual_indexes", (8, 16, 24)))


def _sigmoid_moe(config: dict, expert_ff: int) -> dict:
    """GLM-4.5's and LFM2-MoE's mixtures of experts (LlamaConfig fields): sigmoid routing scaled by
    routed_scaling_factor; GLM-4.5's n_shared_experts ungated shared experts, first_k_dense_replace
    leading dense layers and group-limited routing (n_group, topk_group), LFM2-MoE's num_dense_layers."""
    if config.get("model_type") == "lfm2_moe":
        return {
            "expert_gating": "sigmoid",
            "expert_weights_scale": float(config.get("routed_scaling_factor", 1.0)),
            "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
            "first_dense_layers": int(config.get("num_dense_layers") or 0),
            "dense_intermediate_size": int(config["intermediate_size"]),
        }
    if config.get("model_type") != "glm4_moe":
        return {}
    return {
        "expert_groups": int(config.get("n_group") or 1),
        "expert_groups_used": int(config.get("topk_group") or 0),
        "expert_gating": "sigmoid",
        "expert_weights_scale": float(config.get("routed_scaling_factor", 1.0)),
        "norm_topk_prob": bool(config.get("norm_topk_prob", True)),
        "shared_expert_intermediate_size": expert_ff * int(config.get("n_shared_experts") or 0),
        "first_dense_layers": int(config.get("first_k_dense_replace") or 0),
        "dense_intermediate_size": int(config["intermediate_size"]),
    }


def _ernie4_5_moe(config: dict) -> dict:
    """ERNIE 4.5 MoE's LlamaConfig fields (with num_experts, num_experts_per_tok and the experts'
    intermediate_size, which the caller takes out), transformers' defaults where the config leaves a key out:
    moe_num_experts routed experts, moe_k a token, softmax probabilities plus a choice bias, renormalized
    (moe.route), beside moe_num_shared_experts shared experts of moe_intermediate_size each, one ungated
    SwiGLU; experts in layers moe_layer_start_index to moe_layer_end_index (-1: the last) whose number + 1
    is a multiple of moe_layer_interval, dense FFNs of intermediate_size in the others."""
    if config.get("model_type") != "ernie4_5_moe":
        return {}
    n = int(config["num_hidden_layers"])
    start = int(config.get("moe_layer_start_index", 1))
    end = int(config.get("moe_layer_end_index", -1))
    end = n - 1 if end == -1 else end
    every = int(config.get("moe_layer_interval") or 1)
    experts = {i for i in range(n) if (i + 1) % every == 0 and start <= i <= end}
    ff = int(config.get("moe_intermediate_size", 1536))
    return {
        "num_experts": int(config.get("moe_num_experts", 64)),
        "num_experts_per_tok": int(config.get("moe_k", 6)),
        "intermediate_size": ff,
        "norm_topk_prob": True,
        "shared_expert_intermediate_size": ff * int(config.get("moe_num_shared_experts", 2)),
        "first_dense_layers": start,
        "dense_layers": tuple(i for i in range(start, n) if i not in experts),
        "dense_intermediate_size": int(config.get("intermediate_size", 12288)),
    }


def _attn_temperature(config: dict) -> dict:
    """Ministral 3's Llama 4 attention temperature (LlamaConfig fields) from its rope_parameters."""
    params = config.get("rope_parameters") or {}
    beta = float(params.get("llama_4_scaling_beta") or 0.0)
    if not beta:
        return {}
    return {
        "attn_temperature_beta": beta,
        "attn_temperature_length": int(params["original_max_position_embeddings"]),
    }


def _lfm2(config: dict) -> dict:
    """LFM2's and LFM2-MoE's LlamaConfig fields: norm_eps, which layers convolve (layer_types, or the older
    full_attn_idxs) with conv_L_cache taps; the dense LFM2's FFN length (block_ff_dim adjusted as its MLP
    does: 2/3, times block_ffn_dim_multiplier, rounded up to block_multiple_of)."""
    if config.get("model_type") not in ("lfm2", "lfm2_moe"):
        return {}
    if config.get("conv_bias"):
        raise UnsupportedArchitectureError(
            "LFM2 models with convolution biases (conv_bias) are not supported yet"
        )
    fields = {}
    if config["model_type"] == "lfm2":
        ff = int(config.get("block_ff_dim") or config["intermediate_size"])
        if config.get("block_auto_adjust_ff_dim", True):
            ff = int(2 * ff / 3)
            if config.get("block_ffn_dim_multiplier") is not None:
                ff = int(float(config["block_ffn_dim_multiplier"]) * ff)
            multiple = int(config.get("block_multiple_of") or 256)
            ff = multiple * -(-ff // multiple)
        fields["intermediate_size"] = ff
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        full = set(config.get("full_attn_idxs") or [])
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    types = tuple("conv" if t == "conv" else "full_attention" for t in types)
    return fields | {
        "rms_norm_eps": float(config.get("norm_eps", 1e-5)),
        "layer_types": types,
        "conv_taps": int(config.get("conv_L_cache") or 3),
    }


def _refuse_linear_biases(config: dict) -> None:
    """A config asking for biases on every linear (a llama's or Granite's mlp_bias, ERNIE 4.5's use_bias) is
    refused: the llama family's FFN takes none."""
    if config.get("mlp_bias") or config.get("use_bias"):
        raise UnsupportedArchitectureError(
            f"{config.get('model_type')} models with FFN biases (mlp_bias / use_bias) are not supported yet"
        )


def _qwen35(config: dict) -> dict:
    """Qwen3.5's and Qwen3-Next's LlamaConfig fields: which layers run the gated DeltaNet (layer_types
    "linear_attention"), its sizes, and the attention layers' output gate; Qwen3-Next's dense layers among
    its experts' (mlp_only_layers, and the layers decoder_sparse_step skips) with intermediate_size."""
    model_type = config.get("model_type")
    if model_type not in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):
        return {}
    if config.get("attention_bias"):
        raise UnsupportedArchitectureError(f"{model_type} models with attention biases are not supported yet")
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        every = int(config.get("full_attention_interval") or 4)
        types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    dense = {}
    if model_type == "qwen3_next" and int(config.get("num_experts") or 0):
        step, only = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or ())
        layers = tuple(i for i in range(n) if i in only or (i + 1) % step)
        if layers:
            dense = {"dense_layers": layers, "dense_intermediate_size": int(config["intermediate_size"])}
    return dense | {
        "layer_types": tuple(types),
        "delta": DeltaShape(
            k_heads=int(config.get("linear_num_key_heads", 16)),
            v_heads=int(config.get("linear_num_value_heads", 32)),
            head_k=int(config.get("linear_key_head_dim", 128)),
            head_v=int(config.get("linear_value_head_dim", 128)),
            taps=int(config.get("linear_conv_kernel_dim", 4)),
        ),
        "attn_output_gate": True,
    }


def _granite4(config: dict) -> dict:
    """Granite 4.0 (granitemoehybrid) as LlamaConfig fields: a Granite 3 whose FFN is the "shared MLP" of
    shared_intermediate_size, RoPE only with position_embedding_type "rope", and in the hybrid members
    (Granite-4.0-H) Mamba-2 layers (llama.cpp's granitehybrid). Mixtures of experts are refused."""
    if config.get("model_type") != "granitemoehybrid":
        return {}
    n = int(config["num_hidden_layers"])
    types = list(config.get("layer_types") or config.get("layers_block_type") or ["mamba"] * n)
    mamba = [t in ("mamba", "linear_attention") for t in types]
    if any(not m and t not in ("attention", "full_attention") for m, t in zip(mamba, types)):
        raise UnsupportedArchitectureError(f"Granite 4.0 layer types {sorted(set(types))} are not supported")
    experts = int(config.get("num_local_experts") or 0)
    if experts and not any(mamba):
        raise UnsupportedArchitectureError(
            "Granite 4.0 mixtures of experts without Mamba-2 layers are not supported yet (hybrid ones are)"
        )
    rope = config.get("position_embedding_type") == "rope"
    out = {
        "intermediate_size": int(config["shared_intermediate_size"]),
        "rope_layers": None if rope else (False,) * n,
    }
    if experts:  # Tiny / Small: softmax over the chosen k experts; the shared MLP is their shared expert
        out |= {
            "intermediate_size": int(config["intermediate_size"]),
            "shared_expert_intermediate_size": int(config["shared_intermediate_size"]),
        }
    if any(mamba):
        hidden = int(config["hidden_size"])
        heads = int(config.get("mamba_n_heads") or 128)
        d_head = config.get("mamba_d_head") or "auto"
        d_head = int(config.get("mamba_expand") or 2) * hidden // heads if d_head == "auto" else int(d_head)
        if config.get("hidden_act", "silu") != "silu" or config.get("mamba_proj_bias"):
            raise UnsupportedArchitectureError("Granite 4.0-H's Mamba-2 layers need SiLU and no in/out bias")
        # transformers 5 writes infinity as {"__float__": "Infinity"}
        lo, hi = (float(v["__float__"] if isinstance(v, dict) else v)
                  for v in config.get("time_step_limit") or (0.0, float("inf")))
        out |= {
            "architecture": "granitehybrid",
            "layer_types": tuple("linear_attention" if m else "full_attention" for m in mamba),
            "mamba": MambaShape(
                heads=heads, head_dim=d_head, state_size=int(config.get("mamba_d_state") or 256),
                groups=int(config.get("mamba_n_groups") or 1), taps=int(config.get("mamba_d_conv") or 4),
                dt_min=lo, dt_max=hi,
            ),
        }
    return out


def _granite_constants(config: dict) -> dict:
    """Granite's multipliers (LlamaConfig's embedding/residual/attention_multiplier, logits_scaling)."""
    if config.get("model_type") not in ("granite", "granitemoehybrid"):
        return {}
    return {
        "embedding_multiplier": float(config.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(config.get("residual_multiplier", 1.0)),
        "attention_multiplier": float(config.get("attention_multiplier", 1.0)),
        "logits_scaling": float(config.get("logits_scaling", 1.0)),
    }


def _rope_layers(config: dict) -> tuple[bool, ...] | None:
    """SmolLM3's per-layer RoPE flags (no_rope_layers: 1 rotates, 0 does not; by default every
    no_rope_layer_interval-th layer does not); EXAONE 4 with a window rotates in the windowed layers only;
    None for the other families."""
    if config.get("model_type") in ("exaone4", "cohere2"):
        types = _sliding_window(config).get("layer_types")
        return None if types is None else windowed_rope_layers(types)
    if config.get("model_type") != "smollm3":
        return None
    flags = config.get("no_rope_layers")
    if flags is None:
        n = int(config["num_hidden_layers"])
        return smollm3_rope_layers(n, int(config.get("no_rope_layer_interval") or 4))
    return tuple(bool(f) for f in flags)


def _sliding_window(config: dict) -> dict:
    """LlamaConfig's sliding_window and layer_types from a config.json (transformers' rules: Mistral,
    Mixtral and gpt-oss use `sliding_window` when set; Qwen2/3 only with use_sliding_window, from layer
    max_window_layers on)."""
    model_type = config.get("model_type")
    window = int(config.get("sliding_window") or 0)
    if config.get("use_sliding_window") is False or (
        model_type not in ("mistral", "mixtral", "gpt_oss", "olmo3", "exaone4", "cohere2")
        and not config.get("use_sliding_window")
    ):
        window = 0
    if not window:
        return {}
    types = config.get("layer_types")
    pattern = config.get("sliding_window_pattern")  # EXAONE 4 configs without layer_types: 4, or "LLLG"
    if model_type == "cohere2":  # transformers' default for Command R7B / A: the fourth layers attend fully
        pattern = pattern or 4
    if types is None and model_type in ("exaone4", "cohere2") and pattern:
        n = int(config["num_hidden_layers"])
        if isinstance(pattern, str):
            local = [pattern[i % len(pattern)] == "L" for i in range(n)]
            types = ["sliding_attention" if w else "full_attention" for w in local]
        else:
            types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n)]
    if types is None and config.get("use_sliding_window"):
        first = int(config.get("max_window_layers") or 0)
        n = int(config["num_hidden_layers"])
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    if types is None and model_type == "gpt_oss":  # transformers' default
        types = gpt_oss_layer_types(int(config["num_hidden_layers"]))
    return {"sliding_window": window, "layer_types": None if types is None else tuple(types)}


def _token_id(value, vocab: dict[str, int]) -> int | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        value = value.get("content")
    return vocab.get(value) if isinstance(value, str) else None


def load_hf_tokenizer(path: Path) -> HFTokenizer:
    """The `tokenizers` library's Tokenizer of the tokenizer.json at path.

    Raises:
        ModelFormatError: the library cannot read it.
    """
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as e:  # the Rust side reports malformed files as generic exceptions
        raise ModelFormatError(path, f"cannot be read ({e})") from e


def hf_vocab(path: Path, hf: HFTokenizer, spec: dict) -> dict[str, int]:
    """token -> id of a tokenizer.json, added tokens included, as the `tokenizers` library (and so
    transformers) encodes them.

    The library does not keep an added token's "id" from the file: it gives it the model vocabulary's id
    of the same text, or else the next id after the model vocabulary and the added tokens before it. A file
    whose added tokens sit below model vocabulary ids that no model entry fills thus has one id for two
    tokens, and text encoded with it cannot be decoded.

    Raises:
        ModelFormatError: two tokens have the same id.
    """
    vocab = hf.get_vocab(with_added_tokens=True)
    if len(set(vocab.values())) == len(vocab):
        return vocab
    by_id: dict[int, list[str]] = {}
    for text, i in vocab.items():
        by_id.setdefault(i, []).append(text)
    i, texts = next((i, t) for i, t in sorted(by_id.items()) if len(t) > 1)
    declared = {a["content"]: a.get("id") for a in spec.get("added_tokens", [])}
    moved = [f"{t!r} (id {declared[t]} in the file)" for t in texts if t in declared and declared[t] != i]
    raise ModelFormatError(
        path,
        f"tokens {', '.join(map(repr, texts))} all get id {i}: the tokenizers library ignores an added "
        f"token's id and numbers it after the model vocabulary, which moves {', '.join(moved) or 'one'} onto "
        "a model token; add the added tokens' texts to model.vocab at their ids, or give them ids after it",
    )


def tokenizer_from_hf(folder: Path, tok_config: dict, gen_config: dict) -> Tokenizer:
    """Our Tokenizer over the repo's own tokenizer.json (the reference tokenizer, used as is)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ModelFormatError(path, "missing; Hearth needs the fast tokenizer file (tokenizer.json)")
    hf = load_hf_tokenizer(path)
    spec = json.loads(path.read_text(encoding="utf-8"))
    kind, add_space_prefix = _tokenizer_kind(path, spec)
    vocab = hf_vocab(path, hf, spec)
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    types = [TOKEN_NORMAL] * len(tokens)
    if kind == "llama":
        for i, text in enumerate(tokens):
            if _BYTE_PIECE.fullmatch(text):
                types[i] = TOKEN_BYTE
    for added in spec.get("added_tokens", []):
        types[vocab[added["content"]]] = TOKEN_CONTROL if added.get("special") else TOKEN_USER_DEFINED
    bos = _token_id(tok_config.get("bos_token"), vocab)
    eos = _token_id(tok_config.get("eos_token"), vocab)
    if kind == "bert":  # [CLS] text [SEP] (the tokenizer.json post-processor adds them: encode_embedding)
        bos = _token_id(tok_config.get("cls_token", "[CLS]"), vocab)
        eos = _token_id(tok_config.get("sep_token", "[SEP]"), vocab)
    if kind == "t5":  # XLM-RoBERTa's <s> text </s>, likewise
        bos = _token_id(tok_config.get("cls_token", "<s>"), vocab)
        eos = _token_id(tok_config.get("sep_token", "</s>"), vocab)
        unk = _token_id(tok_config.get("unk_token", "<unk>"), vocab)
        if unk is not None:
            types[unk] = TOKEN_UNKNOWN
    gen_eos = gen_config.get("eos_token_id")
    eot = {eos} if eos is not None else set()
    eot.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else [])
    for text in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|endoftext|>", "<|end|>",
                 "<|END_OF_TURN_TOKEN|>"):
        if text in vocab and types[vocab[text]] == TOKEN_CONTROL:
            eot.add(vocab[text])
    return Tokenizer(
        hf,
        tokens,
        types,
        bos_id=bos,
        eos_id=eos,
        unk_id=_token_id(tok_config.get("unk_token"), vocab),
        pad_id=_token_id(tok_config.get("pad_token"), vocab),
        eot_ids=eot,
        add_bos=bool(tok_config.get("add_bos_token", False)),
        add_eos=bool(tok_config.get("add_eos_token", False)),
        pre="hf",
        kind=kind,
        add_space_prefix=add_space_prefix,
    )


_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _tokenizer_kind(path: Path, spec: dict) -> tuple[str, bool]:
    """("gpt2", False) for byte-level BPE; ("llama", prefix?) for SentencePiece-style (U+2581 spaces,
    <0xXX> byte fallback), where prefix says whether a space is put before the text."""
    decoder = spec.get("decoder") or {}
    if decoder.get("type") == "ByteLevel":
        return "gpt2", False
    if (spec.get("model") or {}).get("type") == "WordPiece":  # BERT encoders
        return "bert", False
    if (spec.get("model") or {}).get("type") == "Unigram":  # SentencePiece unigram (XLM-RoBERTa encoders)
        return "t5", True
    parts = [decoder, *decoder.get("decoders", [])]
    if any(p.get("type") == "ByteFallback" for p in parts) or (spec.get("model") or {}).get("byte_fallback"):
        normalizer = spec.get("normalizer") or {}
        steps = [normalizer, *normalizer.get("normalizers", [])]
        pre = spec.get("pre_tokenizer") or {}
        prefix = any(s.get("type") == "Prepend" for s in steps) or (
            pre.get("type") == "Metaspace" and pre.get("prepend_scheme", "always") != "never"
        )
        return "llama", prefix
    raise UnsupportedTokenizer(
        f"{path}: this kind of tokenizer.json (decoder {decoder.get('type')!r}) is not supported yet; "
        "byte-level BPE and SentencePiece-style BPE with byte fallback are"
    )


def chat_template_source(folder: Path, tok_config: dict) -> str | None:
    """The folder's chat template: chat_template.jinja, or chat_template.json's, or tokenizer_config.json's
    (transformers saves it in a file of its own since 2025 and prefers that file, as here); a string, or the
    "default" of a named list."""
    jinja, json_file = folder / "chat_template.jinja", folder / "chat_template.json"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ModelFormatError(jinja, f"cannot be read ({e})") from e
    template = (read_json(json_file) if json_file.is_file() else tok_config).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def folder_tokenizer(folder: Path) -> tuple[Tokenizer, dict]:
    """(the folder's tokenizer, its tokenizer_config.json or {}), from its own files."""
    tok_path, gen_path = folder / "tokenizer_config.json", folder / "generation_config.json"
    tok_config = read_json(tok_path) if tok_path.exists() else {}
    gen_config = read_json(gen_path) if gen_path.exists() else {}
    return tokenizer_from_hf(folder, tok_config, gen_config), tok_config


def open_hf_repo(folder: Path):
    """Map a Hugging Face folder. Returns (config, weights, tokenizer, template source, metadata, nbytes)."""
    config = read_json(folder / "config.json")
    cfg = config_from_hf(folder, config)
    st = open_safetensors_repo(folder)
    tokenizer, tok_config = folder_tokenizer(folder)
    metadata = {
        "general.architecture": cfg.architecture,
        "general.name": folder.name,
        "general.source": "huggingface",
        f"{cfg.architecture}.context_length": cfg.max_position_embeddings,
    }
    nbytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return (
        cfg,
        HFWeights(st, folder, cfg.architecture),
        tokenizer,
        chat_template_source(folder, tok_config),
        metadata,
        nbytes,
    )
