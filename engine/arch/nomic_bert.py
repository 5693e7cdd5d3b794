"""nomic-bert encoders (nomic-embed-text-v1, v1.5; CodeRankEmbed): embedding models only.

A BERT with rotary position embeddings in place of learned ones (NeoX rotate-half pairs, base
`rotary_emb_base`, 1000 in nomic's models), one fused q|k|v projection and a SwiGLU FFN (silu(gate) * up),
no biases on the linears, post-LN blocks (LayerNorm after each residual add) as BERT's. Tensor names are
llama.cpp's `nomic-bert` GGUF names (gguf-py MODEL_ARCH.NOMIC_BERT: token_embd, token_types,
token_embd_norm, blk.N.attn_qkv, attn_output, attn_output_norm, ffn_gate, ffn_up, ffn_down,
layer_output_norm); Hugging Face folders come in two namings, mapped here (hf_names): nomic's own
(remote code: emb_ln, encoder.layers.N.attn.Wqkv, mlp.fc11 = up, mlp.fc12 = gate, mlp.fc2, norm1, norm2,
with a GPT-2-style config.json: n_embd, n_head, n_layer, n_inner) and transformers' NomicBertModel
(layers.N.self_attn.q/k/v/o_proj, mlp.gate/up/down_proj, post_attention_layernorm, post_mlp_layernorm).

The context is 2048 positions whatever the config says (llama.cpp's converter sets it so: nomic's config
claims 8192 through a rotary scaling that only acts past the 2048 positions it was trained on).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from engine.arch import register
from engine.arch.base import gguf_key
from engine.arch.bert import POOLING_NAMES
from engine.arch.encoder import Encoder, attend_segments, hf_tensor_names
from engine.backends import cpu as ops
from engine.vision.tower import layernorm, linear

# the positions nomic's models were trained on (llama.cpp's nomic-bert context_length)
TRAINED_POSITIONS = 2048


@dataclass
class NomicBertConfig:
    """Hyper-parameters, named as in transformers' NomicBertConfig (config.json)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int = TRAINED_POSITIONS
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    rope_theta: float = 1000.0
    # llama.cpp's pooling type name ("mean", "cls", ...); None: the file says nothing
    pooling: str | None = None
    architecture: str = "nomic-bert"
    # derived in __post_init__
    head_dim: int = field(init=False)
    num_key_value_heads: int = field(init=False)
    inv_freq: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.num_key_value_heads = self.num_attention_heads
        # transformers computes these in float32 (LlamaRotaryEmbedding's default rope)
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float32) / np.float32(self.head_dim)
        self.inv_freq = (np.float32(1.0) / np.float32(self.rope_theta) ** exponents).astype(np.float32)

    @classmethod
    def from_gguf(cls, metadata: dict, vocab_size: int) -> NomicBertConfig:
        """From a llama.cpp `nomic-bert` GGUF's metadata (convert_hf_to_gguf.py NomicBertModel's keys)."""
        key = gguf_key(metadata)
        if bool(key("attention.causal", False)):
            raise ValueError("nomic-bert.attention.causal is true; the encoder attends both ways")
        pooling = key("pooling_type", -1)
        return cls(
            hidden_size=int(key("embedding_length")),
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=int(key("attention.head_count")),
            vocab_size=vocab_size,
            max_position_embeddings=int(key("context_length")),
            type_vocab_size=int(metadata.get("tokenizer.ggml.token_type_count", 2)),
            layer_norm_eps=float(key("attention.layer_norm_epsilon", 1e-12)),
            rope_theta=float(key("rope.freq_base", 1000.0)),
            pooling=None if int(pooling) < 0 else POOLING_NAMES.get(int(pooling), f"type {int(pooling)}"),
        )

    @classmethod
    def from_hf(cls, config: dict) -> NomicBertConfig:
        """From a nomic_bert config.json, transformers' naming or nomic's own (KeyError / ValueError for a
        malformed one or a variant Hearth does not compute: biases, pre-norm, partial or interleaved
        rotary, a GELU MLP or a mixture of experts as nomic-embed-text-v2-moe has)."""
        if "n_embd" in config:  # nomic's remote-code config (GPT-2 names)
            checks = {
                "activation_function": "swiglu",
                "qkv_proj_bias": False,
                "mlp_fc1_bias": False,
                "mlp_fc2_bias": False,
                "prenorm": False,
                "rotary_emb_fraction": 1.0,
                "rotary_emb_interleaved": False,
                "causal": False,
            }
            for name, want in checks.items():
                if config.get(name, want) != want:
                    raise ValueError(f"{name} {config[name]!r} (Hearth's nomic-bert needs {want!r})")
            if config.get("moe_every_n_layers"):
                raise ValueError("a mixture-of-experts nomic-bert (nomic-embed-text-v2-moe) is not supported")
            positions = config.get("max_trained_positions") or config.get("n_positions") or TRAINED_POSITIONS
            return cls(
                hidden_size=int(config["n_embd"]),
                intermediate_size=int(config.get("n_inner") or 4 * int(config["n_embd"])),
                num_hidden_layers=int(config["n_layer"]),
                num_attention_heads=int(config["n_head"]),
                vocab_size=int(config["vocab_size"]),
                max_position_embeddings=min(int(positions), TRAINED_POSITIONS),
                type_vocab_size=int(config.get("type_vocab_size", 2)),
                layer_norm_eps=float(config.get("layer_norm_epsilon", 1e-12)),
                rope_theta=float(config.get("rotary_emb_base", 1000.0)),
            )
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act {act!r} (Hearth's nomic-bert computes SwiGLU, 'silu')")
        rope = config.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} (only the default rotary embedding)")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        if int(config.get("head_dim") or hidden // heads) * heads != hidden:
            raise ValueError("head_dim * num_attention_heads must equal hidden_size")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=min(
                int(config.get("max_position_embeddings", TRAINED_POSITIONS)), TRAINED_POSITIONS
            ),
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 1000.0))),
        )


# Hugging Face names (either naming, with or without a model prefix) -> llama.cpp's
_HF_GLOBAL = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "emb_ln.weight": "token_embd_norm.weight",
    "emb_ln.bias": "token_embd_norm.bias",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
}
_HF_LAYER = {
    "attn.Wqkv.weight": "attn_qkv.weight",
    "attn.out_proj.weight": "attn_output.weight",
    "mlp.fc11.weight": "ffn_up.weight",
    "mlp.fc12.weight": "ffn_gate.weight",
    "mlp.fc2.weight": "ffn_down.weight",
    "norm1.weight": "attn_output_norm.weight",
    "norm1.bias": "attn_output_norm.bias",
    "norm2.weight": "layer_output_norm.weight",
    "norm2.bias": "layer_output_norm.bias",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "post_attention_layernorm.weight": "attn_output_norm.weight",
    "post_attention_layernorm.bias": "attn_output_norm.bias",
    "post_mlp_layernorm.weight": "layer_output_norm.weight",
    "post_mlp_layernorm.bias": "layer_output_norm.bias",
}
_HF_LAYER_RE = re.compile(r"(?:encoder\.)?layers\.(\d+)\.(.+)")


def hf_names(hf_tensors) -> dict[str, str]:
    """GGUF name -> Hugging Face name for a nomic_bert folder's tensors (MLM heads left out)."""
    prefixes = ("nomic_bert.", "bert.", "model.")
    return hf_tensor_names(hf_tensors, prefixes, _HF_GLOBAL, _HF_LAYER, _HF_LAYER_RE)


@dataclass
class NomicBertLayer:
    wqkv: list  # [q|k|v] fused (3 hidden, hidden), as GGUFs hold it, or [q, k, v]
    wo: object
    attn_norm_w: np.ndarray  # attn_output_norm: after the attention's residual add
    attn_norm_b: np.ndarray
    w_gate: object
    w_up: object
    w_down: object
    out_norm_w: np.ndarray  # layer_output_norm: after the FFN's residual add
    out_norm_b: np.ndarray


@register("nomic-bert")
class NomicBertModel(Encoder):
    """A nomic-bert encoder over weights that stay in their file format; `hidden_states` gives its rows."""

    config_class = NomicBertConfig
    family = "a nomic-bert encoder"

    def __init__(self, cfg: NomicBertConfig, weights):
        """Args: cfg; weights: a weight source with matrix(name, rows, cols), vector(name, n), has(name)."""
        self.cfg = cfg
        d, ff = cfg.hidden_size, cfg.intermediate_size
        self.token_embd = weights.matrix("token_embd.weight", cfg.vocab_size, d)
        self.token_types = (
            weights.matrix("token_types.weight", cfg.type_vocab_size, d)
            if weights.has("token_types.weight")
            else None
        )
        self.embd_norm = (
            weights.vector("token_embd_norm.weight", d),
            weights.vector("token_embd_norm.bias", d),
        )
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"blk.{i}."
            if weights.has(p + "attn_qkv.weight"):
                wqkv = [weights.matrix(p + "attn_qkv.weight", 3 * d, d)]
            else:
                wqkv = [weights.matrix(p + f"attn_{x}.weight", d, d) for x in "qkv"]
            self.layers.append(
                NomicBertLayer(
                    wqkv=wqkv,
                    wo=weights.matrix(p + "attn_output.weight", d, d),
                    attn_norm_w=weights.vector(p + "attn_output_norm.weight", d),
                    attn_norm_b=weights.vector(p + "attn_output_norm.bias", d),
                    w_gate=weights.matrix(p + "ffn_gate.weight", ff, d),
                    w_up=weights.matrix(p + "ffn_up.weight", ff, d),
                    w_down=weights.matrix(p + "ffn_down.weight", d, ff),
                    out_norm_w=weights.vector(p + "layer_output_norm.weight", d),
                    out_norm_b=weights.vector(p + "layer_output_norm.bias", d),
                )
            )
        matrices = [self.token_embd]
        for layer in self.layers:
            matrices += [*layer.wqkv, layer.wo, layer.w_gate, layer.w_up, layer.w_down]
        self._small_max = ops.small_batch_limit(matrices)

    def _hidden(self, ids: np.ndarray, starts: np.ndarray, positions: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        n, d = len(ids), cfg.hidden_size
        x = np.empty((n, d), np.float32)
        ops.get_rows(x, self.token_embd, ids)
        if self.token_types is not None:
            row = np.empty((1, d), np.float32)
            ops.get_rows(row, self.token_types, np.zeros(1, np.int64))
            x += row
        eps = cfg.layer_norm_eps
        layernorm(x, x, *self.embd_norm, eps)
        heads, hd = cfg.num_attention_heads, cfg.head_dim
        h = np.empty((n, cfg.intermediate_size), np.float32)
        for layer in self.layers:
            qkv = np.concatenate([linear(w, x) for w in layer.wqkv], axis=1)  # one matrix: no copy
            q = np.ascontiguousarray(qkv[:, :d]).reshape(n, heads, hd)
            k = np.ascontiguousarray(qkv[:, d : 2 * d]).reshape(n, heads, hd)
            v = qkv[:, 2 * d :].reshape(n, heads, hd)
            ops.rope(q, positions, cfg.inv_freq, hd, True)
            ops.rope(k, positions, cfg.inv_freq, hd, True)
            t = (1, 0, 2)
            x += linear(layer.wo, attend_segments(q.transpose(t), k.transpose(t), v.transpose(t), starts))
            layernorm(x, x, layer.attn_norm_w, layer.attn_norm_b, eps)
            ops.silu_mul(h, linear(layer.w_gate, x), linear(layer.w_up, x))
            x += linear(layer.w_down, h)
            layernorm(x, x, layer.out_norm_w, layer.out_norm_b, eps)
        return x
