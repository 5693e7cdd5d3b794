"""Gemma 4 text decoder (gemma-4-E2B / E4B, 26B-A4B, 31B), following Hugging Face's modeling_gemma4.

What differs from Gemma 3 (engine/arch/gemma3.py):
- two layer shapes: windowed ("sliding") layers with head_dim-wide heads and RoPE over the whole head, and
  global layers with global_head_dim-wide heads (and their own KV head count) whose "proportional" RoPE
  turns only the first partial_rotary_factor of the frequencies (the rest stay at angle 0);
- RMSNorms multiply by w (not 1 + w); values are RMS-normed per head without a weight; the attention
  scale is 1 (q and k are normed);
- global layers may take their values from the key projection (attention_k_eq_v: no v_proj);
- the last num_kv_shared_layers layers compute no keys or values: each attends over those of the last
  earlier layer of its kind. In a prompt pass that asks for the last token's logits only, those layers run
  for the last token alone (nothing later reads their other rows);
- E2B / E4B: per-layer embeddings. A second table gives each token a small vector per layer, mixed with a
  projection of the embedding; each layer adds proj(gelu(gate x) * that vector), normed, to its output;
  and their shared-KV layers' MLPs are twice as wide (use_double_wide_mlp);
- 26B-A4B: beside each layer's dense GeGLU MLP, routed experts on the same input norm's residual: a
  softmax router over a weightless norm of the residual times a learnt scale, the top k renormalized and
  multiplied by a per-expert scale; the two branches' outputs are normed each and summed;
- each layer's output (the residual stream) is multiplied by a learnt scalar (layer_scalar).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.arch import register
from engine.arch.base import Decoder, gguf_key
from engine.arch.gemma3 import FULL, SLIDING, softcap
from engine.arch.moe import MoE, load_moe, moe_forward
from engine.backends import cpu as ops
from engine.kv_cache import GroupedKVCache
from engine.rope import rope_inv_freq
from engine.weights import Weight


@dataclass
class Gemma4Config:
    """Hyper-parameters, named as in Hugging Face's Gemma4TextConfig (global_head_dim and
    num_global_key_value_heads as its config.json keeps them before per_layer_config)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # windowed layers
    vocab_size: int
    head_dim: int = 256  # windowed layers
    global_head_dim: int = 512
    num_global_key_value_heads: int = 0  # 0: num_key_value_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_base_freq: float = 10_000.0  # windowed layers
    global_rotary_factor: float = 0.25  # proportional RoPE: the share of global-head frequencies that turn
    global_rope_factor: float = 1.0  # proportional RoPE's `factor` (frequencies divided by it)
    local_rotary_dim: int = 0  # windowed layers' rotated dims (0: head_dim)
    sliding_window: int = 512
    layer_types: list[str] | None = None  # None: four windowed layers, then one global
    max_position_embeddings: int = 131_072
    final_logit_softcapping: float | None = None
    num_kv_shared_layers: int = 0
    hidden_size_per_layer_input: int = 0  # per-layer embeddings' width (0: none)
    vocab_size_per_layer_input: int = 0  # 0: vocab_size
    use_double_wide_mlp: bool = False  # the shared-KV layers' MLPs are 2 * intermediate_size wide
    intermediate_sizes: list[int] | None = None  # per layer; None: from use_double_wide_mlp
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    architecture: str = "gemma4"
    # what engine.arch.moe reads
    norm_topk_prob: bool = True
    expert_gating: str = "softmax"
    expert_weights_scale: float = 1.0
    expert_act: str = "gelu_tanh"
    # derived in __post_init__
    kv_sources: list[int] = field(init=False)  # the layer whose keys and values each layer attends over

    def __post_init__(self):
        n = self.num_hidden_layers
        if self.layer_types is None:
            self.layer_types = [FULL if (i + 1) % 5 == 0 else SLIDING for i in range(n)]
        if len(self.layer_types) != n or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must list {SLIDING!r}/{FULL!r} for each of the layers")
        if self.sliding_window < 1:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if not self.num_global_key_value_heads:
            self.num_global_key_value_heads = self.num_key_value_heads
        if not self.local_rotary_dim:
            self.local_rotary_dim = self.head_dim
        if not self.vocab_size_per_layer_input:
            self.vocab_size_per_layer_input = self.vocab_size
        for heads in (self.num_key_value_heads, self.num_global_key_value_heads):
            if self.num_attention_heads % heads:
                raise ValueError("num_attention_heads must be a multiple of the key/value head counts")
        first_shared = n - self.num_kv_shared_layers
        if not 0 < first_shared <= n:
            raise ValueError(f"num_kv_shared_layers {self.num_kv_shared_layers} of {n} layers")
        self.kv_sources = list(range(first_shared))
        for i in range(first_shared, n):
            same = [j for j in range(first_shared) if self.layer_types[j] == self.layer_types[i]]
            if not same:
                raise ValueError(f"layer {i} shares keys and values, but no earlier layer is of its kind")
            self.kv_sources.append(same[-1])
        if self.intermediate_sizes is None:
            wide = 2 if self.use_double_wide_mlp else 1
            self.intermediate_sizes = [
                self.intermediate_size * (wide if i >= first_shared else 1) for i in range(n)
            ]
        if len(self.intermediate_sizes) != n:
            raise ValueError(f"{len(self.intermediate_sizes)} FFN lengths for {n} layers")

    @property
    def first_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def is_global(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL

    def layer_head_dim(self, layer: int) -> int:
        return self.global_head_dim if self.is_global(layer) else self.head_dim

    def layer_kv_heads(self, layer: int) -> int:
        return self.num_global_key_value_heads if self.is_global(layer) else self.num_key_value_heads

    def window(self, layer: int) -> int | None:
        return None if self.is_global(layer) else self.sliding_window

    @property
    def kv_widths(self) -> list[int]:
        """n_kv_heads * head_dim of each layer that keeps keys and values (the shared ones keep none)."""
        return [self.layer_kv_heads(i) * self.layer_head_dim(i) for i in range(self.first_shared_layer)]

    @classmethod
    def from_gguf(cls, metadata: dict, vocab_size: int) -> Gemma4Config:
        """Config from llama.cpp's `gemma4.*` keys.

        Raises:
            KeyError: a required key is missing. ValueError: values are inconsistent.
        """
        arch = metadata["general.architecture"]
        key = gguf_key(metadata)

        n_layers = int(key("block_count"))
        flags = key("attention.sliding_window_pattern")
        if np.ndim(flags) == 0 or len(flags) != n_layers:
            raise ValueError("attention.sliding_window_pattern must hold one flag per layer")
        layer_types = [SLIDING if bool(f) else FULL for f in flags]

        def per_layer(name: str, kind: str | None = None) -> list[int]:
            value = key(name)
            values = [int(v) for v in value] if np.ndim(value) else [int(value)] * n_layers
            if len(values) != n_layers:
                raise ValueError(f"{arch}.{name} has {len(values)} entries for {n_layers} layers")
            return [v for v, t in zip(values, layer_types) if kind in (None, t)]

        def one(values: list[int], name: str) -> int:
            if len(set(values)) > 1:
                raise ValueError(f"{arch}.{name} differs between layers of one kind: {values}")
            return values[0] if values else 0

        heads = per_layer("attention.head_count")
        head_dim = int(key("attention.key_length_swa"))
        global_head_dim = int(key("attention.key_length"))
        if int(key("attention.value_length_swa", head_dim)) != head_dim or int(
            key("attention.value_length", global_head_dim)
        ) != global_head_dim:
            raise ValueError("key and value head sizes differ")
        ff = per_layer("feed_forward_length")
        kv = key("attention.head_count_kv", heads[0])
        if np.ndim(kv) == 0:
            kv = [int(kv)] * n_layers
        local_kv = one([int(h) for h, t in zip(kv, layer_types) if t == SLIDING], "attention.head_count_kv")
        global_kv = one([int(h) for h, t in zip(kv, layer_types) if t == FULL], "attention.head_count_kv")
        softcapping = metadata.get(f"{arch}.final_logit_softcapping")
        experts = int(metadata.get(f"{arch}.expert_count", 0) or 0)
        return cls(
            hidden_size=int(key("embedding_length")),
            intermediate_size=ff[0],
            intermediate_sizes=ff,
            num_hidden_layers=n_layers,
            num_attention_heads=one(heads, "attention.head_count"),
            num_key_value_heads=local_kv or global_kv,
            num_global_key_value_heads=global_kv or local_kv,
            vocab_size=vocab_size,
            head_dim=head_dim,
            global_head_dim=global_head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 1_000_000.0)),
            rope_local_base_freq=float(key("rope.freq_base_swa", 10_000.0)),
            # the global layers' proportional RoPE comes from the file's rope_freqs tensor (Gemma4Model)
            global_rotary_factor=1.0,
            local_rotary_dim=int(key("rope.dimension_count_swa", head_dim)),
            sliding_window=int(key("attention.sliding_window")),
            layer_types=layer_types,
            max_position_embeddings=int(key("context_length", 131_072)),
            final_logit_softcapping=float(softcapping) if softcapping and float(softcapping) > 0 else None,
            num_kv_shared_layers=int(key("attention.shared_kv_layers", 0)),
            hidden_size_per_layer_input=int(key("embedding_length_per_layer_input", 0)),
            num_experts=experts,
            num_experts_per_tok=int(key("expert_used_count")) if experts else 0,
            moe_intermediate_size=int(key("expert_feed_forward_length")) if experts else 0,
            architecture=arch,
        )


@dataclass
class Gemma4Layer:
    attn_norm: np.ndarray  # (hidden,)
    wq: Weight  # (heads * hd, hidden)
    q_norm: np.ndarray  # (hd,)
    wk: Weight | None  # (kv_heads * hd, hidden); None in a shared-KV layer
    wv: Weight | None  # None: the values are the keys' projection (attention_k_eq_v), or a shared-KV layer
    k_norm: np.ndarray | None
    wo: Weight  # (hidden, heads * hd)
    post_attn_norm: np.ndarray
    ffn_norm: np.ndarray
    w_gate: Weight  # (ff, hidden)
    w_up: Weight
    w_down: Weight  # (hidden, ff)
    post_ffn_norm: np.ndarray
    scalar: np.float32  # the layer output's multiplier
    inv_freq: np.ndarray  # RoPE frequencies (n_rot / 2,)
    n_rot: int
    head_dim: int
    kv_heads: int
    window: int | None
    kv_slot: int  # the cache layer it writes (its own) or reads (a shared-KV layer's source)
    # the routed experts beside the MLP (26B-A4B) and their norms, router scale (hidden,) folded with
    # hidden ** -0.5; None: none
    moe: MoE | None = None
    router_scale: np.ndarray | None = None
    pre_moe_norm: np.ndarray | None = None
    post_mlp_norm: np.ndarray | None = None
    post_moe_norm: np.ndarray | None = None
    # per-layer embeddings: gate (p, hidden), projection (hidden, p), norm (hidden,); None: none
    pl_gate: Weight | None = None
    pl_proj: Weight | None = None
    pl_norm: np.ndarray | None = None
    # Gemma 3n's activation sparsity: the gate rows' cut-off in standard deviations above their mean
    # (gaussian_top_k); None: dense
    sparsity_std: np.float32 | None = None


def gaussian_top_k(gate: np.ndarray, std_multiplier: np.float32) -> None:
    """gate (n, ff) in place: relu(gate - (mean + std_multiplier * std)) per row (population std), which keeps
    about the top share of a normally distributed row that the multiplier's quantile leaves (HF's
    Gemma3nTextMLP._gaussian_topk)."""
    mean = gate.mean(axis=-1, keepdims=True, dtype=np.float32)
    std = gate.std(axis=-1, keepdims=True, dtype=np.float32)
    gate -= mean + std * std_multiplier
    np.maximum(gate, np.float32(0.0), out=gate)


class _Scratch:
    """Activation buffers for n tokens: q/k/v/attention per head shape, gate/up per FFN length."""

    def __init__(self, cfg: Gemma4Config, n: int):
        f32 = np.float32
        d, heads = cfg.hidden_size, cfg.num_attention_heads
        self.n = n
        self.x = np.empty((n, d), f32)
        self.h = np.empty((n, d), f32)
        self.o = np.empty((n, d), f32)
        self.y = np.empty((n, d), f32)
        self.router = np.empty((n, d), f32)  # the experts' router input
        self.positions = np.empty(n, np.int64)
        shapes = {(cfg.layer_kv_heads(i), cfg.layer_head_dim(i)) for i in range(cfg.num_hidden_layers)}
        self.q = {hd: np.empty((n, heads * hd), f32) for _, hd in shapes}
        self.attn = {hd: np.empty((n, heads * hd), f32) for _, hd in shapes}
        self.k = {s: np.empty((n, s[0] * s[1]), f32) for s in shapes}
        self.v = {s: np.empty((n, s[0] * s[1]), f32) for s in shapes}
        self.gate = {ff: np.empty((n, ff), f32) for ff in set(cfg.intermediate_sizes)}
        self.up = {ff: np.empty((n, ff), f32) for ff in set(cfg.intermediate_sizes)}
        p = cfg.hidden_size_per_layer_input
        self.per_layer = np.empty((n, cfg.num_hidden_layers * p), f32) if p else None
        self.pl_tokens = np.empty((n, cfg.num_hidden_layers * p), f32) if p else None
        self.pl_gate = np.empty((n, p), f32) if p else None
        self.pl_input = np.empty((n, p), f32) if p else None


@register("gemma4")
class Gemma4Model(Decoder):
    """A Gemma 4 decoder over weights that stay in their file format (see the module docstring)."""

    config_class = Gemma4Config
    # the images this model can embed (engine.vision.tokens.ImageTable), set by a vision tower's attach(), and
    # the token whose per-layer embedding image positions take (the pad token, as transformers gives them)
    images = None
    image_pad_id = 0

    def __init__(self, cfg: Gemma4Config, weights):
        """Args: cfg; weights: a weight source with matrix(name, rows, cols), vector(name, n), has(name)."""
        self.cfg = cfg
        d = cfg.hidden_size
        self.token_embd = weights.matrix("token_embd.weight", cfg.vocab_size, d)
        self.output_norm = weights.vector("output_norm.weight", d)
        self.output = self.token_embd
        if weights.has("output.weight"):
            self.output = weights.matrix("output.weight", cfg.vocab_size, d)
        p, n_layers = cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
        if p:
            rows = cfg.vocab_size_per_layer_input
            self.pl_embd = weights.matrix("per_layer_token_embd.weight", rows, n_layers * p)
            self.pl_model_proj = weights.matrix("per_layer_model_proj.weight", n_layers * p, d)
            self.pl_proj_norm = weights.vector("per_layer_proj_norm.weight", p)
        local_freq = rope_inv_freq(cfg.local_rotary_dim, cfg.rope_local_base_freq)
        global_freq = self._global_inv_freq(weights)
        self.ones = {hd: np.ones(hd, np.float32) for hd in (cfg.head_dim, cfg.global_head_dim)}
        self.layers = [self._layer(weights, i, local_freq, global_freq) for i in range(n_layers)]
        self.embed_scale = np.float32(d**0.5)
        self._decode = self._new_scratch(1)
        self._logits = np.empty((1, cfg.vocab_size), np.float32)

    def _global_inv_freq(self, weights) -> np.ndarray:
        """The global layers' proportional RoPE over their whole head: frequencies base ** (-2i / hd) for the
        first global_rotary_factor of them, 0 (no turn) for the rest. llama.cpp's GGUFs store it as
        rope_freqs (1 for the turning frequencies, 1e30 for the others)."""
        cfg = self.cfg
        hd = cfg.global_head_dim
        if weights.has("rope_freqs.weight"):
            factors = weights.vector("rope_freqs.weight", hd // 2)
            return rope_inv_freq(hd, cfg.rope_theta, freq_factors=factors)
        inv = rope_inv_freq(hd, cfg.rope_theta).astype(np.float64)
        inv[int(cfg.global_rotary_factor * hd // 2) :] = 0.0
        return (inv / cfg.global_rope_factor).astype(np.float32)

    def _layer(self, weights, i: int, local_freq: np.ndarray, global_freq: np.ndarray) -> Gemma4Layer:
        cfg = self.cfg
        p = f"blk.{i}."
        d, heads = cfg.hidden_size, cfg.num_attention_heads
        hd, kv = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        ff = cfg.intermediate_sizes[i]
        own_kv = i < cfg.first_shared_layer
        scalar = weights.vector(p + "layer_output_scale.weight", 1)[0] if weights.has(
            p + "layer_output_scale.weight"
        ) else 1.0

        def matrix(name, rows, cols):
            return weights.matrix(p + name, rows, cols)

        def norm(name, n=d):
            return weights.vector(p + name, n)

        layer = Gemma4Layer(
            attn_norm=norm("attn_norm.weight"),
            wq=matrix("attn_q.weight", heads * hd, d),
            q_norm=norm("attn_q_norm.weight", hd),
            wk=matrix("attn_k.weight", kv * hd, d) if own_kv else None,
            wv=matrix("attn_v.weight", kv * hd, d) if own_kv and weights.has(p + "attn_v.weight") else None,
            k_norm=norm("attn_k_norm.weight", hd) if own_kv else None,
            wo=matrix("attn_output.weight", d, heads * hd),
            post_attn_norm=norm("post_attention_norm.weight"),
            ffn_norm=norm("ffn_norm.weight"),
            w_gate=matrix("ffn_gate.weight", ff, d),
            w_up=matrix("ffn_up.weight", ff, d),
            w_down=matrix("ffn_down.weight", d, ff),
            post_ffn_norm=norm("post_ffw_norm.weight"),
            scalar=np.float32(scalar),
            inv_freq=global_freq if cfg.is_global(i) else local_freq,
            n_rot=hd if cfg.is_global(i) else cfg.local_rotary_dim,
            head_dim=hd,
            kv_heads=kv,
            window=cfg.window(i),
            kv_slot=cfg.kv_sources[i],
        )
        if cfg.num_experts:
            layer.moe = self._experts(weights, p)
            layer.router_scale = norm("ffn_gate_inp.scale") * np.float32(d**-0.5)
            layer.pre_moe_norm = norm("pre_ffw_norm_2.weight")
            layer.post_mlp_norm = norm("post_ffw_norm_1.weight")
            layer.post_moe_norm = norm("post_ffw_norm_2.weight")
        if cfg.hidden_size_per_layer_input:
            pl = cfg.hidden_size_per_layer_input
            layer.pl_gate = matrix("inp_gate.weight", pl, d)
            layer.pl_proj = matrix("proj.weight", d, pl)
            layer.pl_norm = norm("post_norm.weight")
        return layer

    def _experts(self, weights, p: str) -> MoE:
        """A layer's experts: their gate and up rows from one merged tensor (HF's gate_up_proj, llama.cpp's
        ffn_gate_up_exps) or two, the router, and the per-expert scale (llama.cpp: ffn_down_exps.scale)."""
        cfg = self.cfg
        n = cfg.num_experts
        moe = load_moe(weights, p, n, cfg.moe_intermediate_size, cfg.hidden_size)
        if weights.has(p + "ffn_down_exps.scale"):
            moe.expert_scale = weights.vector(p + "ffn_down_exps.scale", n)
        return moe

    def _new_scratch(self, n: int) -> _Scratch:
        return _Scratch(self.cfg, n)

    # ---- cache

    def new_cache(self, n_ctx: int, dtype=np.float32) -> GroupedKVCache:
        """Keys and values of the layers that compute them, grouped by head shape."""
        cfg = self.cfg
        shapes: list[tuple[int, int]] = []
        slots = []
        counts: dict[tuple[int, int], int] = {}
        for i in range(cfg.first_shared_layer):
            shape = (cfg.layer_kv_heads(i), cfg.layer_head_dim(i))
            if shape not in counts:
                shapes.append(shape)
                counts[shape] = 0
            slots.append((shapes.index(shape), counts[shape]))
            counts[shape] += 1
        groups = [(counts[s], *s) for s in shapes]
        return GroupedKVCache(groups, slots, n_ctx, dtype)

    # ---- forward

    def _forward(self, tokens: np.ndarray, cache: GroupedKVCache, all_logits: bool, first=0, hidden=None):
        if first or hidden is not None:
            raise ValueError("Gemma 4 runs whole: its layers cannot start from another device's hidden state")
        cfg = self.cfg
        n = len(tokens)
        s = self._decode if n == 1 else self._new_scratch(n)
        s.positions[:] = np.arange(cache.offset, cache.offset + n)
        # an image's rows see each other both ways on the windowed layers only (bidirectional tables)
        key_ends = None if self.images is None else self.images.key_ends(tokens, cache.offset)

        def attend(layer: Gemma4Layer, i: int, s: _Scratch, attn3, q3, k3, v3):
            if k3 is None:
                k_cache, v_cache = cache.fetch(layer.kv_slot)
            else:
                k_cache, v_cache = cache.update_and_fetch(layer.kv_slot, k3, v3)
            ends = None if key_ends is None or layer.window is None else key_ends[n - s.n :]
            ops.attention(attn3, q3, k_cache, v_cache, int(s.positions[0]), 1.0, layer.window, key_ends=ends)

        # a prompt pass that wants the last logits only: the shared-KV layers need its last row alone
        s = self._layers(s, tokens, attend, last_only=not all_logits)
        cache.advance(tokens)
        rows = s.x if all_logits else s.x[s.n - 1 :]
        h = s.h if all_logits else s.h[s.n - 1 :]
        ops.rmsnorm(h, rows, self.output_norm, cfg.rms_norm_eps)
        logits = np.empty((n, cfg.vocab_size), np.float32) if all_logits else self._logits
        ops.linear(logits, self.output, h)
        return softcap(logits, cfg.final_logit_softcapping)

    def _forward_batch(self, tokens: np.ndarray, caches: list[GroupedKVCache], first: int = 0, hidden=None):
        if first or hidden is not None:
            raise ValueError("Gemma 4 runs whole: its layers cannot start from another device's hidden state")
        s, logits = self._batch_buffers(len(tokens))
        for b, cache in enumerate(caches):
            s.positions[b] = cache.offset

        def attend(layer: Gemma4Layer, i: int, s: _Scratch, attn3, q3, k3, v3):
            for b, cache in enumerate(caches):  # each sequence over its own cache, at its own position
                if k3 is None:
                    k_cache, v_cache = cache.fetch(layer.kv_slot)
                else:
                    k_cache, v_cache = cache.update_and_fetch(layer.kv_slot, k3[b : b + 1], v3[b : b + 1])
                ops.attention(attn3[b : b + 1], q3[b : b + 1], k_cache, v_cache, int(s.positions[b]), 1.0,
                              layer.window)

        self._layers(s, tokens, attend, last_only=False)
        for b, cache in enumerate(caches):
            cache.advance(tokens[b : b + 1])
        ops.rmsnorm(s.h, s.x, self.output_norm, self.cfg.rms_norm_eps)
        ops.linear(logits, self.output, s.h)
        return softcap(logits, self.cfg.final_logit_softcapping)

    def _per_layer_inputs(self, s: _Scratch, tokens: np.ndarray) -> None:
        """s.per_layer (n, layers * p): the token's per-layer embedding (times sqrt(p)) plus the RMS-normed
        projection of its scaled embedding s.x (times hidden ** -0.5), the sum times 2 ** -0.5."""
        cfg = self.cfg
        p = cfg.hidden_size_per_layer_input
        ops.get_rows(s.pl_tokens, self.pl_embd, tokens)
        s.pl_tokens *= np.float32(p**0.5)
        ops.linear(s.per_layer, self.pl_model_proj, s.x)
        s.per_layer *= np.float32(cfg.hidden_size**-0.5)
        rows = s.per_layer.reshape(-1, p)
        ops.rmsnorm(rows, rows, self.pl_proj_norm, cfg.rms_norm_eps)
        s.per_layer += s.pl_tokens
        s.per_layer *= np.float32(2**-0.5)

    def _layers(self, s: _Scratch, ids: np.ndarray, attend, last_only: bool) -> _Scratch:
        """Embed ids (tokens and image ids) into s.x and run every layer; s.positions holds each row's
        position.

        attend(layer, index, scratch, attn3 out, q3, k3, v3) stores k3, v3 in the cache(s) (None in a
        shared-KV layer: it reads its source's) and writes attn3. With last_only, the shared-KV layers run
        on the last row alone, in the one-row scratch, which is returned (else s).
        """
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        images = self.images is not None and ids.max() >= self.images.base
        # image positions: the pad token's per-layer embedding, and their rows as the projector gave them
        # (not scaled) in place of an embedding
        tokens = np.where(ids >= self.images.base, self.image_pad_id, ids) if images else ids
        ops.get_rows(s.x, self.token_embd, tokens)
        s.x *= self.embed_scale
        if images:
            self.images.embed(s.x, ids)
        if cfg.hidden_size_per_layer_input:
            self._per_layer_inputs(s, tokens)
        for i, layer in enumerate(self.layers):
            if i == cfg.first_shared_layer and last_only and s.n > 1:
                s = self._last_row(s)
            ops.rmsnorm(s.h, s.x, layer.attn_norm, eps)
            self._attention(s, layer, i, attend)
            ops.rmsnorm(s.h, s.o, layer.post_attn_norm, eps)
            s.x += s.h
            self._ffn(s, layer)
            if layer.pl_gate is not None:
                self._per_layer_branch(s, layer, i, s.x)
                s.x += s.h
            s.x *= layer.scalar
        return s

    def _last_row(self, s: _Scratch) -> _Scratch:
        """The one-row scratch holding s's last row (its residual stream, position, per-layer inputs)."""
        last = self._decode
        last.x[0] = s.x[-1]
        last.positions[0] = s.positions[-1]
        if s.per_layer is not None:
            last.per_layer[0] = s.per_layer[-1]
        return last

    def _attention(self, s: _Scratch, layer: Gemma4Layer, i: int, attend) -> None:
        """s.o = the attention block's output (before its norm) for the normed input s.h: q/k norms, values
        RMS-normed without a weight, RoPE, attend (see _layers), the output projection."""
        eps = self.cfg.rms_norm_eps
        heads = self.cfg.num_attention_heads
        n, hd = s.n, layer.head_dim
        q = s.q[hd]
        ops.linear(q, layer.wq, s.h)
        q_rows = q.reshape(n * heads, hd)
        ops.rmsnorm(q_rows, q_rows, layer.q_norm, eps)
        q3 = q.reshape(n, heads, hd)
        ops.rope(q3, s.positions, layer.inv_freq, layer.n_rot, True)
        k3 = v3 = None
        if layer.wk is not None:
            k, v = s.k[layer.kv_heads, hd], s.v[layer.kv_heads, hd]
            ops.linear(k, layer.wk, s.h)
            if layer.wv is None:  # the values are the keys' projection, before the keys' norm and RoPE
                v[:] = k
            else:
                ops.linear(v, layer.wv, s.h)
            k_rows, v_rows = k.reshape(-1, hd), v.reshape(-1, hd)
            ops.rmsnorm(k_rows, k_rows, layer.k_norm, eps)
            ops.rmsnorm(v_rows, v_rows, self.ones[hd], eps)
            k3, v3 = k.reshape(n, layer.kv_heads, hd), v.reshape(n, layer.kv_heads, hd)
            ops.rope(k3, s.positions, layer.inv_freq, layer.n_rot, True)
        attn = s.attn[hd]
        attend(layer, i, s, attn.reshape(n, heads, hd), q3, k3, v3)
        ops.linear(s.o, layer.wo, attn)

    def _ffn(self, s: _Scratch, layer: Gemma4Layer) -> None:
        """s.x += the normed output of the GeGLU MLP (plus, beside it, the routed experts')."""
        eps = self.cfg.rms_norm_eps
        ff = layer.w_gate.rows
        gate, up = s.gate[ff], s.up[ff]
        ops.rmsnorm(s.h, s.x, layer.ffn_norm, eps)
        ops.linear(gate, layer.w_gate, s.h)
        if layer.sparsity_std is not None:
            gaussian_top_k(gate, layer.sparsity_std)
        ops.linear(up, layer.w_up, s.h)
        ops.gelu_tanh_mul(gate, gate, up)
        ops.linear(s.o, layer.w_down, gate)
        if layer.moe is not None:
            ops.rmsnorm(s.o, s.o, layer.post_mlp_norm, eps)
            ops.rmsnorm(s.router, s.x, layer.router_scale, eps)
            ops.rmsnorm(s.h, s.x, layer.pre_moe_norm, eps)
            moe_forward(s.y, s.h, layer.moe, self.cfg, s.router)
            ops.rmsnorm(s.y, s.y, layer.post_moe_norm, eps)
            s.o += s.y
        ops.rmsnorm(s.h, s.o, layer.post_ffn_norm, eps)
        s.x += s.h

    def _per_layer_branch(self, s: _Scratch, layer: Gemma4Layer, i: int, x: np.ndarray) -> None:
        """s.h = norm(proj(gelu(gate x) * this layer's per-layer input)) for x (n, hidden)."""
        p = self.cfg.hidden_size_per_layer_input
        s.pl_input[:] = s.per_layer[:, i * p : (i + 1) * p]
        ops.linear(s.pl_gate, layer.pl_gate, x)
        ops.gelu_tanh_mul(s.pl_gate, s.pl_gate, s.pl_input)
        ops.linear(s.o, layer.pl_proj, s.pl_gate)
        ops.rmsnorm(s.h, s.o, layer.pl_norm, self.cfg.rms_norm_eps)
