"""ModernBERT encoders (modernbert-embed-base, gte-modernbert-base): embedding models only, from Hugging Face
`modernbert` folders.

Pre-LN blocks (no norm before the first layer's attention), LayerNorms without biases, one fused q|k|v
projection, NeoX rotary embeddings with a base per layer kind, attention over the whole input on every
`global_attn_every_n_layers`-th layer (the "full_attention" layer_types) and a bidirectional window of
local_attention / 2 tokens each side on the others, a GeGLU FFN (Wi gives input | gate: gelu(input) * gate),
a final LayerNorm. Tensor names follow llama.cpp's GGUF names (token_embd, token_embd_norm, blk.N.attn_norm,
attn_qkv, attn_output, ffn_norm, ffn_up = Wi, ffn_down, output_norm); llama.cpp's `modern-bert` GGUFs are
not read yet (from_gguf refuses them), nor does `hearth convert` write them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from engine.arch import register
from engine.arch.encoder import Encoder, attend_segments, hf_tensor_names
from engine.backends import cpu as ops
from engine.backends.cpu.ops import gelu_erf_fast
from engine.vision.tower import layernorm, linear


@dataclass
class ModernBertConfig:
    """Hyper-parameters, named as in transformers' ModernBertConfig (config.json)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    max_position_embeddings: int = 8192
    norm_eps: float = 1e-5
    local_attention: int = 128
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    # one per layer: True for the windowed ("sliding_attention") layers
    sliding: tuple[bool, ...] = ()
    architecture: str = "modern-bert"
    # derived in __post_init__
    head_dim: int = field(init=False)
    num_key_value_heads: int = field(init=False)
    window: int = field(init=False)
    inv_freq_global: np.ndarray = field(init=False, repr=False)
    inv_freq_local: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")
        if len(self.sliding) != self.num_hidden_layers:
            raise ValueError(f"{len(self.sliding)} layer types for {self.num_hidden_layers} layers")
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.num_key_value_heads = self.num_attention_heads
        self.window = self.local_attention // 2  # keys within this distance, either side
        exponents = np.arange(0, self.head_dim, 2, dtype=np.float32) / np.float32(self.head_dim)
        one = np.float32(1.0)
        self.inv_freq_global = (one / np.float32(self.global_rope_theta) ** exponents).astype(np.float32)
        self.inv_freq_local = (one / np.float32(self.local_rope_theta) ** exponents).astype(np.float32)

    @classmethod
    def from_gguf(cls, metadata: dict, vocab_size: int) -> ModernBertConfig:
        raise ValueError("modern-bert GGUFs are not supported yet; load the model's Hugging Face folder")

    @classmethod
    def from_hf(cls, config: dict) -> ModernBertConfig:
        """From a modernbert config.json (KeyError / ValueError for a malformed one or biases, another
        activation or rope type, which Hearth does not compute)."""
        act = config.get("hidden_activation", "gelu")
        if act != "gelu":
            raise ValueError(f"hidden_activation {act!r} (Hearth's ModernBERT computes the erf GELU, 'gelu')")
        for name in ("attention_bias", "mlp_bias", "norm_bias"):
            if config.get(name):
                raise ValueError(f"{name} true (Hearth's ModernBERT has no biases)")
        n = int(config["num_hidden_layers"])
        types = config.get("layer_types")
        if not types:
            every = int(config.get("global_attn_every_n_layers", 3))
            types = ["sliding_attention" if i % every else "full_attention" for i in range(n)]
        rope = config.get("rope_parameters") or {}
        thetas = {}
        for kind, old, default in (
            ("full_attention", "global_rope_theta", 160_000.0),
            ("sliding_attention", "local_rope_theta", 10_000.0),
        ):
            params = rope.get(kind) or {}
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"{kind} rope_type {params['rope_type']!r} (only the default rotary)")
            thetas[kind] = float(params.get("rope_theta", config.get(old, default)))
        return cls(
            hidden_size=int(config["hidden_size"]),
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=int(config["num_attention_heads"]),
            vocab_size=int(config["vocab_size"]),
            max_position_embeddings=int(config.get("max_position_embeddings", 8192)),
            norm_eps=float(config.get("norm_eps", 1e-5)),
            local_attention=int(config.get("local_attention", 128)),
            global_rope_theta=thetas["full_attention"],
            local_rope_theta=thetas["sliding_attention"],
            sliding=tuple(t == "sliding_attention" for t in types),
        )


_HF_GLOBAL = {
    "embeddings.tok_embeddings.weight": "token_embd.weight",
    "embeddings.norm.weight": "token_embd_norm.weight",
    "final_norm.weight": "output_norm.weight",
}
_HF_LAYER = {
    "attn_norm.weight": "attn_norm.weight",
    "attn.Wqkv.weight": "attn_qkv.weight",
    "attn.Wo.weight": "attn_output.weight",
    "mlp_norm.weight": "ffn_norm.weight",
    "mlp.Wi.weight": "ffn_up.weight",
    "mlp.Wo.weight": "ffn_down.weight",
}
_HF_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")


def hf_names(hf_tensors) -> dict[str, str]:
    """GGUF name -> Hugging Face name for a ModernBertModel's tensors (MLM head left out)."""
    return hf_tensor_names(hf_tensors, ("model.",), _HF_GLOBAL, _HF_LAYER, _HF_LAYER_RE)


@dataclass
class ModernBertLayer:
    attn_norm: np.ndarray | None  # None on layer 0 (transformers' Identity)
    wqkv: object
    wo: object
    ffn_norm: np.ndarray
    w_in: object  # (2 * intermediate, hidden): input | gate
    w_out: object
    sliding: bool


@register("modern-bert")
class ModernBertModel(Encoder):
    """A ModernBERT encoder over weights that stay in their file format; `hidden_states` gives its rows."""

    config_class = ModernBertConfig
    family = "a ModernBERT encoder"

    def __init__(self, cfg: ModernBertConfig, weights):
        """Args: cfg; weights: a weight source with matrix(name, rows, cols), vector(name, n), has(name)."""
        self.cfg = cfg
        d, ff = cfg.hidden_size, cfg.intermediate_size
        self.token_embd = weights.matrix("token_embd.weight", cfg.vocab_size, d)
        self.embd_norm = weights.vector("token_embd_norm.weight", d)
        self.output_norm = weights.vector("output_norm.weight", d)
        self.zeros = np.zeros(d, np.float32)  # the LayerNorms' absent bias
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"blk.{i}."
            self.layers.append(
                ModernBertLayer(
                    attn_norm=weights.vector(p + "attn_norm.weight", d) if i else None,
                    wqkv=weights.matrix(p + "attn_qkv.weight", 3 * d, d),
                    wo=weights.matrix(p + "attn_output.weight", d, d),
                    ffn_norm=weights.vector(p + "ffn_norm.weight", d),
                    w_in=weights.matrix(p + "ffn_up.weight", 2 * ff, d),
                    w_out=weights.matrix(p + "ffn_down.weight", d, ff),
                    sliding=cfg.sliding[i],
                )
            )
        matrices = [self.token_embd]
        for lay in self.layers:
            matrices += [lay.wqkv, lay.wo, lay.w_in, lay.w_out]
        self._small_max = ops.small_batch_limit(matrices)

    def _hidden(self, ids: np.ndarray, starts: np.ndarray, positions: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        n, d, ff = len(ids), cfg.hidden_size, cfg.intermediate_size
        heads, hd, eps = cfg.num_attention_heads, cfg.head_dim, cfg.norm_eps
        x = np.empty((n, d), np.float32)
        ops.get_rows(x, self.token_embd, ids)
        layernorm(x, x, self.embd_norm, self.zeros, eps)
        h = np.empty((n, d), np.float32)
        for layer in self.layers:
            if layer.attn_norm is None:
                h[:] = x
            else:
                layernorm(h, x, layer.attn_norm, self.zeros, eps)
            qkv = linear(layer.wqkv, h)
            q = np.ascontiguousarray(qkv[:, :d]).reshape(n, heads, hd)
            k = np.ascontiguousarray(qkv[:, d : 2 * d]).reshape(n, heads, hd)
            v = qkv[:, 2 * d :].reshape(n, heads, hd)
            inv_freq = cfg.inv_freq_local if layer.sliding else cfg.inv_freq_global
            ops.rope(q, positions, inv_freq, hd, True)
            ops.rope(k, positions, inv_freq, hd, True)
            t = (1, 0, 2)
            window = cfg.window if layer.sliding else 0
            attn = attend_segments(q.transpose(t), k.transpose(t), v.transpose(t), starts, window)
            x += linear(layer.wo, attn)
            layernorm(h, x, layer.ffn_norm, self.zeros, eps)
            up = linear(layer.w_in, h)
            act = np.ascontiguousarray(up[:, :ff])
            gelu_erf_fast(act)
            act *= up[:, ff:]
            x += linear(layer.w_out, act)
        layernorm(x, x, self.output_norm, self.zeros, eps)
        return x
