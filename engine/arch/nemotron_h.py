"""Nemotron-H (dense: Nemotron-H 8B/47B, Nemotron Nano 9B/12B v2), as transformers' modeling_nemotron_h.

Each block is an RMSNorm, one mixer and a residual add. The mixer is Mamba-2 (engine/arch/mamba2.py, as in
Granite 4.0-H), attention without positions (GQA, scale head_dim ** -0.5), or an MLP down(relu(up x) ** 2)
without a gate. The cache keeps the attention layers' keys and values and each Mamba-2 layer's state at the
cache's end (RecurrentKVCache, with its snapshots), as for Qwen3.5 and Granite 4.0-H.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.arch import mamba2, register
from engine.arch.base import Decoder, gguf_key
from engine.arch.mamba2 import Mamba2, MambaShape, load_mamba2
from engine.backends import cpu as ops
from engine.kv_cache import RecurrentKVCache
from engine.weights import Weight

MAMBA, ATTENTION, MLP = "mamba", "attention", "mlp"


@dataclass
class NemotronHConfig:
    hidden_size: int
    vocab_size: int
    kinds: tuple[str, ...]  # per block: "mamba", "attention" or "mlp"
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba: MambaShape
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    architecture: str = "nemotron_h"

    def __post_init__(self):
        if set(self.kinds) - {MAMBA, ATTENTION, MLP}:
            raise ValueError(f"Nemotron-H block kinds must be {MAMBA}, {ATTENTION} or {MLP}: {self.kinds}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def num_hidden_layers(self) -> int:
        return len(self.kinds)

    def is_recurrent(self, layer: int) -> bool:
        return self.kinds[layer] == MAMBA

    @property
    def n_recurrent_layers(self) -> int:
        return self.kinds.count(MAMBA)

    @property
    def kv_widths(self) -> list[int]:
        """n_kv_heads * head_dim of each layer keeping keys and values (the attention ones)."""
        return [self.num_key_value_heads * self.head_dim] * self.kinds.count(ATTENTION)

    def keeps_kv(self, layer: int) -> bool:
        """Block `layer` keeps keys and values in the cache (an attention block)."""
        return self.kinds[layer] == ATTENTION

    def slot(self, layer: int, first: int = 0) -> int:
        """The layer's index among the cache's layers of its kind from block `first` on."""
        return self.kinds[first:layer].count(self.kinds[layer])

    @property
    def recurrent_shapes(self) -> tuple[tuple[int, ...], tuple[int, int]]:
        """A Mamba-2 layer's state shape (per head (head_dim, state_size)) and its convolution's kept inputs
        (taps - 1, conv_dim), as RecurrentKVCache holds them."""
        return self.mamba.state_dims, (self.mamba.taps - 1, self.mamba.conv_dim)

    @classmethod
    def from_gguf(cls, metadata: dict, vocab_size: int) -> NemotronHConfig:
        """Config from llama.cpp's nemotron_h keys: KV heads per layer (0 but in attention layers), FFN
        lengths per layer (0 but in MLP layers), the ssm.* sizes."""
        key = gguf_key(metadata)
        n = int(key("block_count"))

        def per_layer(name):
            value = key(name)
            values = [int(v) for v in value] if np.ndim(value) else [int(value)] * n
            if len(values) != n:
                raise ValueError(f"{name} has {len(values)} entries for {n} layers")
            return values

        kv, ff = per_layer("attention.head_count_kv"), per_layer("feed_forward_length")
        heads = int(key("ssm.time_step_rank"))
        hidden = int(key("embedding_length"))
        n_heads = int(key("attention.head_count"))
        return cls(
            hidden_size=hidden,
            vocab_size=vocab_size,
            kinds=tuple(ATTENTION if k else MLP if f else MAMBA for k, f in zip(kv, ff)),
            num_attention_heads=n_heads,
            num_key_value_heads=max(kv) or n_heads,
            head_dim=int(key("attention.key_length", hidden // n_heads)),
            intermediate_size=max(ff),
            mamba=MambaShape(
                heads=heads, head_dim=int(key("ssm.inner_size")) // heads,
                state_size=int(key("ssm.state_size")), groups=int(key("ssm.group_count")),
                taps=int(key("ssm.conv_kernel")),
            ),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(key("context_length", 8192)),
        )


@dataclass
class NemotronHLayer:
    norm: np.ndarray
    kind: str
    mamba: Mamba2 | None = None
    wq: Weight | None = None
    wk: Weight | None = None
    wv: Weight | None = None
    wo: Weight | None = None
    w_up: Weight | None = None
    w_down: Weight | None = None


@register("nemotron_h")
class NemotronHModel(Decoder):
    """A dense Nemotron-H decoder over weights that stay in their file format (see the module docstring)."""

    config_class = NemotronHConfig

    def __init__(self, cfg: NemotronHConfig, weights):
        self.cfg = cfg
        d = cfg.hidden_size
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.token_embd = weights.matrix("token_embd.weight", cfg.vocab_size, d)
        self.output_norm = weights.vector("output_norm.weight", d)
        self.output = self.token_embd
        if weights.has("output.weight"):
            self.output = weights.matrix("output.weight", cfg.vocab_size, d)
        self.layers = []
        for i, kind in enumerate(cfg.kinds):
            p = f"blk.{i}."
            layer = NemotronHLayer(norm=weights.vector(p + "attn_norm.weight", d), kind=kind)
            if kind == MAMBA:
                layer.mamba = load_mamba2(weights, p, d, cfg.mamba)
            elif kind == ATTENTION:
                layer.wq = weights.matrix(p + "attn_q.weight", q, d)
                layer.wk = weights.matrix(p + "attn_k.weight", kv, d)
                layer.wv = weights.matrix(p + "attn_v.weight", kv, d)
                layer.wo = weights.matrix(p + "attn_output.weight", d, q)
            else:
                layer.w_up = weights.matrix(p + "ffn_up.weight", cfg.intermediate_size, d)
                layer.w_down = weights.matrix(p + "ffn_down.weight", d, cfg.intermediate_size)
            self.layers.append(layer)
        self.scale = np.float32(cfg.head_dim**-0.5)
        self._logits = np.empty((1, cfg.vocab_size), np.float32)

    def new_cache(self, n_ctx: int, dtype=np.float32) -> RecurrentKVCache:
        cfg = self.cfg
        return RecurrentKVCache(
            cfg.kinds.count(ATTENTION), cfg.num_key_value_heads, cfg.head_dim, n_ctx, dtype,
            cfg.n_recurrent_layers, *cfg.recurrent_shapes,
        )

    def _forward(self, tokens, cache: RecurrentKVCache, all_logits: bool, first=0, hidden=None):
        """As Decoder._forward; from block `first` on, starting from the residual stream `hidden`, with a
        cache of those blocks only (partial GPU offload: engine.backends.cuda.hybrid)."""
        n = len(tokens)
        # recurrent states to return to (RecurrentKVCache.trim): a pass's start and its end - 1
        with cache.forward_pass(tokens):
            x = self._layers(tokens, [cache], [cache.offset], first, hidden)
        if all_logits:
            return self._output(x, np.empty((n, self.cfg.vocab_size), np.float32))
        return self._output(x[n - 1 :], self._logits)

    def _forward_batch(self, tokens, caches: list[RecurrentKVCache], first=0, hidden=None):
        x = self._layers(tokens, caches, [c.offset for c in caches], first, hidden)
        for b, cache in enumerate(caches):
            cache.advance(tokens[b : b + 1])
        return self._output(x, np.empty((len(x), self.cfg.vocab_size), np.float32))

    def _output(self, rows: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """logits (written and returned) of the residual stream's rows: the final norm, then the output."""
        h = np.empty_like(rows)
        ops.rmsnorm(h, rows, self.output_norm, self.cfg.rms_norm_eps)
        ops.linear(logits, self.output, h)
        return logits

    def _layers(self, tokens, caches: list[RecurrentKVCache], offsets: list[int], first: int = 0,
                hidden=None) -> np.ndarray:
        """The residual stream after every block for tokens: all of them for one cache (a pass over a prompt
        or a decode step), one each for several (a batched decode step); from block `first` on, starting
        from `hidden` (the residual stream entering it; None: the tokens' embeddings)."""
        cfg = self.cfg
        n, d = len(tokens), cfg.hidden_size
        x = np.empty((n, d), np.float32)
        if hidden is None:
            ops.get_rows(x, self.token_embd, np.asarray(tokens, dtype=np.int64))
        else:
            x[:] = hidden
        h, o = np.empty_like(x), np.empty_like(x)
        # rows of each sequence: a single cache takes them all
        parts = [slice(0, n)] if len(caches) == 1 else [slice(b, b + 1) for b in range(n)]
        for i, layer in enumerate(self.layers[first:], first):
            ops.rmsnorm(h, x, layer.norm, cfg.rms_norm_eps)
            slot = cfg.slot(i, first)
            if layer.kind == MAMBA:
                (proj,) = mamba2.project(layer.mamba, h)

                def run(rows, conv_state, state, net=layer.mamba):
                    return mamba2.mix(net, cfg.mamba, cfg.rms_norm_eps, *rows, conv_state, state)

                inner = np.concatenate([c.mix(slot, run, (proj[rows],)) for rows, c in zip(parts, caches)])
                ops.linear(o, layer.mamba.out_proj, inner)
            elif layer.kind == ATTENTION:
                self._attention(o, h, layer, slot, caches, offsets, parts)
            else:  # down(relu(up h) ** 2)
                up = np.empty((n, cfg.intermediate_size), np.float32)
                ops.linear(up, layer.w_up, h)
                np.maximum(up, 0.0, out=up)
                up *= up
                ops.linear(o, layer.w_down, up)
            x += o
        return x

    def _attention(self, out, h, layer: NemotronHLayer, slot: int, caches, offsets, parts) -> None:
        cfg = self.cfg
        n, hd = len(h), cfg.head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        q = np.empty((n, heads * hd), np.float32)
        k = np.empty((n, kv_heads * hd), np.float32)
        v = np.empty_like(k)
        ops.linear(q, layer.wq, h)
        ops.linear(k, layer.wk, h)
        ops.linear(v, layer.wv, h)
        q3, k3, v3 = q.reshape(n, heads, hd), k.reshape(n, kv_heads, hd), v.reshape(n, kv_heads, hd)
        attn = np.empty_like(q)
        attn3 = attn.reshape(n, heads, hd)
        for rows, cache, pos in zip(parts, caches, offsets):
            k_cache, v_cache = cache.update_and_fetch(slot, k3[rows], v3[rows])
            ops.attention(attn3[rows], q3[rows], k_cache, v_cache, pos, self.scale)
        ops.linear(out, layer.wo, attn)
