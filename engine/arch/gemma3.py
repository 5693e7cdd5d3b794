"""Gemma 3 text decoder (gemma-3-270m ... 27b): the Llama skeleton plus Gemma's changes.

What differs from engine.arch.llama, following Hugging Face's modeling_gemma3:
- embeddings are multiplied by sqrt(hidden_size) (a float32 constant, as HF computes it in the
  weights' dtype);
- RMSNorm multiplies by (1 + w). llama.cpp's converter writes (1 + w) into the GGUF, so GGUF norm
  weights are used as they are (HF's GGUF loader subtracts the 1 again before its own 1 + w);
- q and k are RMS-normalised per head (attn_q_norm / attn_k_norm) before RoPE;
- extra norms after attention and after the MLP (post_attention_norm, post_ffw_norm), applied to
  the branch output before it is added to the residual stream;
- GeGLU MLP with the tanh GELU; NeoX (half-split) RoPE;
- layers alternate: five sliding-window ("local") layers, then one global layer. Local layers use
  their own RoPE base (10000) and see only the last `sliding_window` positions; RoPE scaling
  applies to the global layers only;
- scores are scaled by query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5 on every size);
- optional tanh soft-capping of the final logits and of the attention scores (Gemma 2 style).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.arch import register
from engine.arch.base import Decoder, Scratch, gguf_key
from engine.backends import cpu as ops
from engine.kv_cache import KVCache
from engine.rope import RopeScaling, rope_attention_factor, rope_inv_freq, rope_scaling_from_gguf
from engine.weights import Weight

SLIDING = "sliding_attention"
FULL = "full_attention"


def pattern_layer_types(n_layers: int, period: int = 6) -> list[str]:
    """A window on every layer but each period-th (Gemma 3: five of six)."""
    return [SLIDING if (i + 1) % period else FULL for i in range(n_layers)]


def softcap(logits: np.ndarray, cap: float | None) -> np.ndarray:
    """cap * tanh(logits / cap) in place (Gemma's final-logit soft-capping); no change when cap is None."""
    if cap is not None:
        np.multiply(logits, np.float32(1.0 / cap), out=logits)
        np.tanh(logits, out=logits)
        np.multiply(logits, np.float32(cap), out=logits)
    return logits


@dataclass
class Gemma3Config:
    """Hyper-parameters, named as in Hugging Face's Gemma3TextConfig."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_base_freq: float = 10_000.0  # sliding-window layers
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # global layers only
    sliding_window: int = 4096
    sliding_window_pattern: int = 6  # every 6th layer is global
    layer_types: list[str] | None = None  # None: derived from sliding_window_pattern
    max_position_embeddings: int = 32768
    query_pre_attn_scalar: float = 0.0  # 0: head_dim
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    architecture: str = "gemma3"
    # derived in __post_init__
    n_rep: int = field(init=False)
    q_dim: int = field(init=False)
    kv_dim: int = field(init=False)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.query_pre_attn_scalar == 0:
            self.query_pre_attn_scalar = float(self.head_dim)
        if self.layer_types is None:
            period = self.sliding_window_pattern
            if period < 1:
                raise ValueError(f"sliding_window_pattern must be positive, got {period}")
            self.layer_types = pattern_layer_types(self.num_hidden_layers, period)
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must list {SLIDING!r}/{FULL!r} for each of the layers")
        self.n_rep = self.num_attention_heads // self.num_key_value_heads
        self.q_dim = self.num_attention_heads * self.head_dim
        self.kv_dim = self.num_key_value_heads * self.head_dim

    def window(self, layer: int) -> int | None:
        """Layer's attention window (ops.attention's `window`), None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    @classmethod
    def from_gguf(cls, metadata: dict, vocab_size: int) -> Gemma3Config:
        """Config from GGUF metadata (`gemma3.*` keys as llama.cpp's converter writes them).

        Raises:
            KeyError: a required key is missing.
            ValueError: values are inconsistent (e.g. key and value head sizes differ).
        """
        arch = metadata["general.architecture"]
        key = gguf_key(metadata)

        def optional_float(name):
            value = metadata.get(f"{arch}.{name}")
            return float(value) if value is not None and float(value) > 0 else None

        n_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        n_layers = int(key("block_count"))
        head_dim = int(key("attention.key_length", hidden // n_heads))
        value_dim = int(key("attention.value_length", head_dim))
        if value_dim != head_dim:
            raise ValueError(f"attention.value_length {value_dim} differs from key_length {head_dim}")
        scaling = rope_scaling_from_gguf(metadata, arch)
        if scaling.kind == "linear" and scaling.factor == 1.0:
            scaling = RopeScaling()
        # llama.cpp writes the local/global layout only for some models: an int period or one bool
        # per layer (True = sliding window). Without it, Gemma 3's fixed pattern of 6 holds.
        pattern = metadata.get(f"{arch}.attention.sliding_window_pattern")
        layer_types = None
        period = 6
        if pattern is not None and np.ndim(pattern) == 0:
            period = int(pattern)
        elif pattern is not None:
            flags = [bool(v) for v in pattern]
            if len(flags) != n_layers:
                raise ValueError(
                    f"attention.sliding_window_pattern has {len(flags)} entries for {n_layers} layers"
                )
            layer_types = [SLIDING if f else FULL for f in flags]
        # GGUF does not store query_pre_attn_scalar. HF's configs use head_dim except on the 27B models
        # (Gemma 3: 62 layers, Gemma 2: 46), which use hidden_size / num_heads; llama.cpp does the same.
        scalar = hidden / n_heads if n_layers == (46 if arch == "gemma2" else 62) else float(head_dim)
        if arch == "gemma2":  # one RoPE base for every layer, and a sliding window on every other layer
            period = 2 if pattern is None else period
        return cls(
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(key("attention.head_count_kv", n_heads)),
            vocab_size=vocab_size,
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 1_000_000.0)),
            rope_local_base_freq=float(
                key("rope.freq_base", 10_000.0) if arch == "gemma2" else key("rope.freq_base_swa", 10_000.0)
            ),
            rope_scaling=scaling,
            sliding_window=int(key("attention.sliding_window", 4096)),
            sliding_window_pattern=period,
            layer_types=layer_types,
            max_position_embeddings=int(key("context_length", 32768)),
            query_pre_attn_scalar=scalar,
            final_logit_softcapping=optional_float("final_logit_softcapping"),
            attn_logit_softcapping=optional_float("attn_logit_softcapping"),
            architecture=arch,
        )


@dataclass
class Gemma3Layer:
    attn_norm: np.ndarray  # (hidden,), (1 + w) as stored in GGUF
    wq: Weight  # (q_dim, hidden)
    wk: Weight  # (kv_dim, hidden)
    wv: Weight  # (kv_dim, hidden)
    q_norm: np.ndarray | None  # (head_dim,); None in Gemma 2, which has no q/k norms
    k_norm: np.ndarray | None
    wo: Weight  # (hidden, q_dim)
    post_attn_norm: np.ndarray  # (hidden,)
    ffn_norm: np.ndarray  # (hidden,)
    w_gate: Weight  # (ffn, hidden)
    w_up: Weight  # (ffn, hidden)
    w_down: Weight  # (hidden, ffn)
    post_ffn_norm: np.ndarray  # (hidden,)
    sliding: bool
    inv_freq: np.ndarray  # (head_dim // 2,) this layer's RoPE frequencies


@register("gemma3", "gemma2")
class Gemma3Model(Decoder):
    """A Gemma 3 decoder over weights that stay in their file format; Gemma 2 is the same network without
    the q/k norms, with attention logits soft-capped (attn_logit_softcapping), one RoPE base and a
    sliding window on every other layer (all from its config)."""

    config_class = Gemma3Config
    # the images this model can embed (engine.vision.tokens.ImageTable), set by a vision tower's attach()
    images = None

    def __init__(self, cfg: Gemma3Config, weights):
        """Args: cfg; weights: a weight source with matrix(name, rows, cols), vector(name, n), has(name)."""
        self.cfg = cfg
        d, q, kv, ff, hd = cfg.hidden_size, cfg.q_dim, cfg.kv_dim, cfg.intermediate_size, cfg.head_dim
        self.token_embd = weights.matrix("token_embd.weight", cfg.vocab_size, d)
        self.output_norm = weights.vector("output_norm.weight", d)
        # tied output projection unless the file has its own
        self.output = self.token_embd
        if weights.has("output.weight"):
            self.output = weights.matrix("output.weight", cfg.vocab_size, d)
        local_freq = rope_inv_freq(hd, cfg.rope_local_base_freq)
        global_freq = rope_inv_freq(hd, cfg.rope_theta, cfg.rope_scaling)
        self.layers = []

        def head_norm(name):  # Gemma 3's per-head q/k norms (Gemma 2 has none)
            return None if cfg.architecture == "gemma2" else weights.vector(name, hd)

        for i, kind in enumerate(cfg.layer_types):
            p = f"blk.{i}."
            self.layers.append(
                Gemma3Layer(
                    attn_norm=weights.vector(p + "attn_norm.weight", d),
                    wq=weights.matrix(p + "attn_q.weight", q, d),
                    wk=weights.matrix(p + "attn_k.weight", kv, d),
                    wv=weights.matrix(p + "attn_v.weight", kv, d),
                    q_norm=head_norm(p + "attn_q_norm.weight"),
                    k_norm=head_norm(p + "attn_k_norm.weight"),
                    wo=weights.matrix(p + "attn_output.weight", d, q),
                    post_attn_norm=weights.vector(p + "post_attention_norm.weight", d),
                    ffn_norm=weights.vector(p + "ffn_norm.weight", d),
                    w_gate=weights.matrix(p + "ffn_gate.weight", ff, d),
                    w_up=weights.matrix(p + "ffn_up.weight", ff, d),
                    w_down=weights.matrix(p + "ffn_down.weight", d, ff),
                    post_ffn_norm=weights.vector(p + "post_ffw_norm.weight", d),
                    sliding=kind == SLIDING,
                    inv_freq=local_freq if kind == SLIDING else global_freq,
                )
            )
        # HF multiplies by torch.tensor(hidden ** 0.5) cast to the weights' dtype: float32 here.
        self.embed_scale = np.float32(cfg.hidden_size**0.5)
        # (a YaRN scaling of the global layers' RoPE would scale their logits by its factor squared;
        # Gemma 3 ships linear scaling, and its local layers none)
        if rope_attention_factor(cfg.rope_scaling) != 1.0:
            raise ValueError("YaRN RoPE scaling is not supported for Gemma 3 models")
        self.scale = np.float32(cfg.query_pre_attn_scalar**-0.5)
        self._decode = Scratch(cfg, 1)
        self._logits = np.empty((1, cfg.vocab_size), np.float32)

    def _attend(self, out3, q3, k_cache, v_cache, pos0: int, window: int | None, key_ends=None) -> None:
        """Causal attention of q3 (n, heads, hd) at positions pos0.. over one layer's cache.

        With a window, the query at position p sees keys [p - window + 1, p] (HF's sliding mask:
        kv > q - window). key_ends: the image rows' wider reach (ops.attention).
        """
        ops.attention(out3, q3, k_cache, v_cache, pos0, self.scale, window, self.cfg.attn_logit_softcapping,
                      key_ends=key_ends)

    def _forward(self, tokens: np.ndarray, cache: KVCache, all_logits: bool, first: int = 0, hidden=None):
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        n = len(tokens)
        s = self._decode if n == 1 else Scratch(cfg, n)
        pos0 = cache.offset
        s.positions[:] = np.arange(pos0, pos0 + n)
        key_ends = None if self.images is None else self.images.key_ends(tokens, pos0)

        def attend(i, attn3, q3, k3, v3, window):
            k_cache, v_cache = cache.update_and_fetch(i - first, k3, v3)
            self._attend(attn3, q3, k_cache, v_cache, pos0, window, key_ends)

        self._layers(s, tokens, attend, first, hidden)
        cache.advance(tokens)
        if all_logits:
            ops.rmsnorm(s.h, s.x, self.output_norm, eps)
            logits = np.empty((n, cfg.vocab_size), np.float32)
            ops.linear(logits, self.output, s.h)
        else:
            last = s.h[n - 1 : n]
            ops.rmsnorm(last, s.x[n - 1 : n], self.output_norm, eps)
            logits = self._logits
            ops.linear(logits, self.output, last)
        return self._softcap(logits)

    def _forward_batch(self, tokens: np.ndarray, caches: list[KVCache], first: int = 0, hidden=None):
        n = len(tokens)
        s, logits = self._batch_buffers(n)
        for b, cache in enumerate(caches):
            s.positions[b] = cache.offset

        def attend(i, attn3, q3, k3, v3, window):
            # each sequence attends over its own cache, at its own position
            for b, cache in enumerate(caches):
                k_cache, v_cache = cache.update_and_fetch(i - first, k3[b : b + 1], v3[b : b + 1])
                self._attend(attn3[b : b + 1], q3[b : b + 1], k_cache, v_cache, int(s.positions[b]), window)

        self._layers(s, tokens, attend, first, hidden)
        for b, cache in enumerate(caches):
            cache.advance(tokens[b : b + 1])
        ops.rmsnorm(s.h, s.x, self.output_norm, self.cfg.rms_norm_eps)
        ops.linear(logits, self.output, s.h)
        return self._softcap(logits)

    def _softcap(self, logits: np.ndarray) -> np.ndarray:
        return softcap(logits, self.cfg.final_logit_softcapping)

    def _layers(self, s: Scratch, tokens: np.ndarray, attend, first: int = 0, hidden=None) -> None:
        """Embed tokens (n,) into s.x (or start from `hidden`, the residual stream entering layer
        `first`) and run the layers from `first` on; s.positions holds each row's position.

        attend(layer index, attn3 out, q3, k3, v3, window) stores k, v in the cache(s) and writes attn3.
        """
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        n = len(tokens)
        if hidden is None and self.images is not None and tokens.max() >= self.images.base:
            ops.get_rows(s.x, self.token_embd, np.where(tokens >= self.images.base, 0, tokens))
            s.x *= self.embed_scale
            self.images.embed(s.x, tokens)  # image rows as the projector gave them (not scaled)
        elif hidden is None:
            ops.get_rows(s.x, self.token_embd, tokens)
            s.x *= self.embed_scale
        else:
            s.x[:] = hidden
        heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q3 = s.q.reshape(n, heads, hd)
        k3 = s.k.reshape(n, kv_heads, hd)
        v3 = s.v.reshape(n, kv_heads, hd)
        q_rows = s.q.reshape(n * heads, hd)  # per-head rows for the q/k norms
        k_rows = s.k.reshape(n * kv_heads, hd)
        attn3 = s.attn.reshape(n, heads, hd)
        capture = self.capture
        for i, layer in enumerate(self.layers[first:], first):
            ops.rmsnorm(s.h, s.x, layer.attn_norm, eps)
            if capture is not None:
                capture(i, "attn_q", s.h)
            ops.linear(s.q, layer.wq, s.h)
            ops.linear(s.k, layer.wk, s.h)
            ops.linear(s.v, layer.wv, s.h)
            if layer.q_norm is not None:
                ops.rmsnorm(q_rows, q_rows, layer.q_norm, eps)
                ops.rmsnorm(k_rows, k_rows, layer.k_norm, eps)
            ops.rope(q3, s.positions, layer.inv_freq, hd, True)
            ops.rope(k3, s.positions, layer.inv_freq, hd, True)
            attend(i, attn3, q3, k3, v3, cfg.sliding_window if layer.sliding else None)
            if capture is not None:
                capture(i, "attn_output", s.attn)
            ops.linear(s.o, layer.wo, s.attn)
            ops.rmsnorm(s.h, s.o, layer.post_attn_norm, eps)
            s.x += s.h
            ops.rmsnorm(s.h, s.x, layer.ffn_norm, eps)
            if capture is not None:
                capture(i, "ffn_up", s.h)
            ops.linear(s.gate, layer.w_gate, s.h)
            ops.linear(s.up, layer.w_up, s.h)
            ops.gelu_tanh_mul(s.gate, s.gate, s.up)
            if capture is not None:
                capture(i, "ffn_down", s.gate)
            ops.linear(s.o, layer.w_down, s.gate)
            ops.rmsnorm(s.h, s.o, layer.post_ffn_norm, eps)
            s.x += s.h

