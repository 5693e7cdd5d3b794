"""BERT-family encoders (all-MiniLM, bge-*-en-v1.5, mxbai-embed-large, snowflake-arctic-embed; XLM-RoBERTa:
bge-m3, multilingual-e5): embedding models only.

Bidirectional self-attention over the whole input, learned absolute position and token-type embeddings
added to the word embeddings, post-LN blocks (LayerNorm after each residual add) and an erf GELU FFN, as
transformers' BertModel. Tensor names are llama.cpp's `bert` GGUF names (gguf-py constants/tensor_mapping:
token_embd, position_embd, token_types, token_embd_norm, blk.N.attn_q/k/v, attn_output, attn_output_norm,
ffn_up, ffn_down, layer_output_norm, each with a bias); a Hugging Face folder's BertModel names are mapped
to them (hf_names). XLM-RoBERTa is the same network with positions counted from padding_idx + 1 in a
folder (position_offset; llama.cpp's converter drops those rows, so a GGUF counts from 0) and one token type.
The model has no logits and no KV cache: `hidden_states` (engine/arch/encoder.py) is its one entry point,
and `forward` (chat) raises EmbeddingOnlyModelError.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from engine.arch import register
from engine.arch.base import gguf_key
from engine.arch.encoder import Encoder, attend_segments
from engine.backends import cpu as ops
from engine.backends.cpu.ops import gelu_erf_fast
from engine.vision.tower import layernorm, linear

# llama.cpp's pooling types ({arch}.pooling_type; gguf-py PoolingType)
POOLING_NAMES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}


@dataclass
class BertConfig:
    """Hyper-parameters, named as in Hugging Face config.json (BertConfig)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    # llama.cpp's pooling type name ("mean", "cls", ...); None: the file says nothing (a folder's
    # sentence-transformers files decide, engine.embed)
    pooling: str | None = None
    architecture: str = "bert"
    # RoBERTa / XLM-RoBERTa folders: the position embedding rows before padding_idx + 1 are never used (their
    # positions count from there); llama.cpp's converter drops them, so a GGUF's offset is 0
    position_offset: int = 0
    # derived in __post_init__ (the memory estimate reads these as it does a decoder's)
    head_dim: int = field(init=False)
    num_key_value_heads: int = field(init=False)

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.num_key_value_heads = self.num_attention_heads

    @classmethod
    def from_gguf(cls, metadata: dict, vocab_size: int) -> BertConfig:
        """From a llama.cpp `bert` GGUF's metadata (convert_hf_to_gguf.py BertModel's keys)."""
        key = gguf_key(metadata)
        causal = bool(key("attention.causal", False))
        if causal:
            raise ValueError("bert.attention.causal is true; a BERT encoder attends both ways")
        pooling = metadata.get(f"{metadata['general.architecture']}.pooling_type")
        return cls(
            hidden_size=int(key("embedding_length")),
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=int(key("attention.head_count")),
            vocab_size=vocab_size,
            max_position_embeddings=int(key("context_length")),
            type_vocab_size=int(metadata.get("tokenizer.ggml.token_type_count", 2)),
            layer_norm_eps=float(key("attention.layer_norm_epsilon", 1e-12)),
            pooling=None if pooling is None else POOLING_NAMES.get(int(pooling), f"type {int(pooling)}"),
        )

    @classmethod
    def from_hf(cls, config: dict) -> BertConfig:
        """From a BertModel config.json (KeyError / ValueError for a malformed one)."""
        act = config.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"hidden_act {act!r} (Hearth's BERT computes the erf GELU, 'gelu')")
        position = config.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ValueError(f"position_embedding_type {position!r} (only 'absolute' is supported)")
        # XLM-RoBERTa (bge-m3, multilingual-e5): positions from pad_token_id + 1 (transformers'
        # create_position_ids_from_input_ids on an unpadded input)
        roberta = config.get("model_type") in ("xlm-roberta", "xlm_roberta")
        offset = int(config.get("pad_token_id", 1)) + 1 if roberta else 0
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=int(config["num_hidden_layers"]),
            num_attention_heads=int(config["num_attention_heads"]),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 512)) - offset,
            type_vocab_size=int(config.get("type_vocab_size", 2)),
            layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
            position_offset=offset,
        )


# a Hugging Face BertModel's tensor names (with or without a "bert." prefix) -> llama.cpp's
_HF_GLOBAL = {
    "embeddings.word_embeddings.weight": "token_embd.weight",
    "embeddings.position_embeddings.weight": "position_embd.weight",
    "embeddings.token_type_embeddings.weight": "token_types.weight",
    "embeddings.LayerNorm.weight": "token_embd_norm.weight",
    "embeddings.LayerNorm.bias": "token_embd_norm.bias",
}
_HF_LAYER = {
    "attention.self.query": "attn_q",
    "attention.self.key": "attn_k",
    "attention.self.value": "attn_v",
    "attention.output.dense": "attn_output",
    "attention.output.LayerNorm": "attn_output_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "layer_output_norm",
}
_HF_LAYER_RE = re.compile(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)")


def hf_names(hf_tensors) -> dict[str, str]:
    """GGUF name -> Hugging Face name for a BertModel's or XLMRobertaModel's tensors (the pooler and MLM heads
    left out)."""
    out = {}
    for hf in hf_tensors:
        name = hf.removeprefix("bert.").removeprefix("roberta.")
        # transformers 4 wrote LayerNorm's parameters as gamma/beta in old checkpoints
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if name in _HF_GLOBAL:
            out[_HF_GLOBAL[name]] = hf
        elif (m := _HF_LAYER_RE.fullmatch(name)) and m.group(2) in _HF_LAYER:
            out[f"blk.{m.group(1)}.{_HF_LAYER[m.group(2)]}.{m.group(3)}"] = hf
    return out


@dataclass
class BertLayer:
    wq: object
    wk: object
    wv: object
    wo: object
    bq: np.ndarray
    bk: np.ndarray
    bv: np.ndarray
    bo: np.ndarray
    attn_norm_w: np.ndarray  # attn_output_norm: after the attention's residual add
    attn_norm_b: np.ndarray
    w_up: object
    b_up: np.ndarray
    w_down: object
    b_down: np.ndarray
    out_norm_w: np.ndarray  # layer_output_norm: after the FFN's residual add
    out_norm_b: np.ndarray


@register("bert")
class BertModel(Encoder):
    """A BERT encoder over weights that stay in their file format; `hidden_states` gives its output rows."""

    config_class = BertConfig
    family = "a BERT encoder"

    def __init__(self, cfg: BertConfig, weights):
        """Args: cfg; weights: a weight source with matrix(name, rows, cols), vector(name, n), has(name)."""
        self.cfg = cfg
        d, ff = cfg.hidden_size, cfg.intermediate_size
        self.token_embd = weights.matrix("token_embd.weight", cfg.vocab_size, d)
        positions, offset = cfg.max_position_embeddings, cfg.position_offset
        self.position_embd = weights.matrix("position_embd.weight", positions + offset, d)
        if offset:
            self.position_embd = self.position_embd.row_block(offset, offset + positions)
        self.token_types = weights.matrix("token_types.weight", cfg.type_vocab_size, d)
        self.embd_norm = (
            weights.vector("token_embd_norm.weight", d), weights.vector("token_embd_norm.bias", d)
        )
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"blk.{i}."
            self.layers.append(
                BertLayer(
                    wq=weights.matrix(p + "attn_q.weight", d, d),
                    wk=weights.matrix(p + "attn_k.weight", d, d),
                    wv=weights.matrix(p + "attn_v.weight", d, d),
                    wo=weights.matrix(p + "attn_output.weight", d, d),
                    bq=weights.vector(p + "attn_q.bias", d),
                    bk=weights.vector(p + "attn_k.bias", d),
                    bv=weights.vector(p + "attn_v.bias", d),
                    bo=weights.vector(p + "attn_output.bias", d),
                    attn_norm_w=weights.vector(p + "attn_output_norm.weight", d),
                    attn_norm_b=weights.vector(p + "attn_output_norm.bias", d),
                    w_up=weights.matrix(p + "ffn_up.weight", ff, d),
                    b_up=weights.vector(p + "ffn_up.bias", ff),
                    w_down=weights.matrix(p + "ffn_down.weight", d, ff),
                    b_down=weights.vector(p + "ffn_down.bias", d),
                    out_norm_w=weights.vector(p + "layer_output_norm.weight", d),
                    out_norm_b=weights.vector(p + "layer_output_norm.bias", d),
                )
            )
        matrices = [self.token_embd] + [w for layer in self.layers for w in vars(layer).values()
                                        if not isinstance(w, np.ndarray)]
        self._small_max = ops.small_batch_limit(matrices)

    def _hidden(self, ids: np.ndarray, starts: np.ndarray, positions: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        n, d = len(ids), cfg.hidden_size
        x = np.empty((n, d), np.float32)
        rows = np.empty((n, d), np.float32)
        ops.get_rows(x, self.token_embd, ids)
        ops.get_rows(rows, self.position_embd, positions)
        x += rows
        ops.get_rows(rows[:1], self.token_types, np.zeros(1, np.int64))
        x += rows[:1]
        eps = cfg.layer_norm_eps
        layernorm(x, x, *self.embd_norm, eps)
        heads, hd = cfg.num_attention_heads, cfg.head_dim
        for layer in self.layers:
            q = linear(layer.wq, x, layer.bq).reshape(n, heads, hd).transpose(1, 0, 2)
            k = linear(layer.wk, x, layer.bk).reshape(n, heads, hd).transpose(1, 0, 2)
            v = linear(layer.wv, x, layer.bv).reshape(n, heads, hd).transpose(1, 0, 2)
            x += linear(layer.wo, attend_segments(q, k, v, starts), layer.bo)  # rows see their own sequence
            layernorm(x, x, layer.attn_norm_w, layer.attn_norm_b, eps)
            h = linear(layer.w_up, x, layer.b_up)
            gelu_erf_fast(h)
            x += linear(layer.w_down, h, layer.b_down)
            layernorm(x, x, layer.out_norm_w, layer.out_norm_b, eps)
        return x
