"""What every decoder architecture shares: its KV cache and the forward entry point."""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from engine.backends import cpu as ops
from engine.kv_cache import KVCache
from engine.weights import Weight


class Scratch:
    """Activation buffers for n tokens of a decoder whose cfg has hidden_size, q_dim, kv_dim and
    intermediate_size; allocated once per batch size (decode reuses one)."""

    def __init__(self, cfg, n: int):
        f32 = np.float32
        self.x = np.empty((n, cfg.hidden_size), f32)
        self.h = np.empty((n, cfg.hidden_size), f32)
        self.q = np.empty((n, cfg.q_dim), f32)
        self.k = np.empty((n, cfg.kv_dim), f32)
        self.v = np.empty((n, cfg.kv_dim), f32)
        self.attn = np.empty((n, cfg.q_dim), f32)
        self.o = np.empty((n, cfg.hidden_size), f32)
        self.gate = np.empty((n, cfg.intermediate_size), f32)
        self.up = np.empty((n, cfg.intermediate_size), f32)
        # a mixture of experts' leading dense layers (GLM-4.5): their own FFN length
        dense_ff = getattr(cfg, "dense_intermediate_size", 0) or cfg.intermediate_size
        self.dense_gate = self.gate if dense_ff == cfg.intermediate_size else np.empty((n, dense_ff), f32)
        self.dense_up = self.up if dense_ff == cfg.intermediate_size else np.empty((n, dense_ff), f32)
        self.positions = np.empty(n, np.int64)
        # LFM2's convolution layers: in_proj's B, C and x rows
        self.bcx = np.empty((n, 3 * cfg.hidden_size), f32) if getattr(cfg, "conv_taps", 0) else None


def gguf_key(metadata: dict):
    """key(name, default=None): the GGUF value of `{arch}.{name}` (general.architecture's prefix), `default`
    when absent; KeyError naming the full key when both are missing."""
    arch = metadata["general.architecture"]

    def key(name, default=None):
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            raise KeyError(f"{arch}.{name}")
        return value

    return key


def check_batch(tokens, caches) -> np.ndarray:
    """forward_batch's arguments checked: one token per cache, distinct caches with room for one more.

    Returns the tokens as int64 (B,). Raises ValueError, ContextOverflowError.
    """
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if len(tokens) != len(caches) or not len(caches):
        raise ValueError(f"forward_batch: {len(tokens)} tokens for {len(caches)} caches")
    if len({id(c) for c in caches}) != len(caches):
        raise ValueError("forward_batch: each sequence needs its own KV cache")
    for cache in caches:
        cache.check_room(1)
    return tokens


@contextlib.contextmanager
def rewound_on_failure(caches):
    """Around a batched decode step into `caches`: should it fail part way (out of memory, an interrupt),
    each cache rewinds (KVCache.rewind: a recurrent one back to its latest snapshot at or before its
    offset, whose states the step may have moved on), as a single sequence's pass does (forward_pass)."""
    try:
        yield
    except BaseException:
        for cache in caches:
            cache.rewind()
        raise


class Decoder:
    """Base of the architecture classes. A subclass sets `cfg` (num_hidden_layers, num_key_value_heads,
    head_dim) and implements `_forward(tokens, cache, all_logits)`.

    `capture`, when set to a callable, is called as capture(layer, key, x) with the input x (n, cols)
    of each layer's linears: key "attn_q" (shared by q/k/v), "attn_output", "ffn_up" (shared by
    gate/up) and "ffn_down". AWQ calibration (engine/quant/awq.py) uses it; None costs nothing.
    """

    capture = None

    @functools.cached_property
    def small_batch_max(self) -> int:
        """The most tokens a forward pass runs through the small-batch kernels rather than dequantize +
        BLAS (ops.small_batch_limit of the layers' matrices)."""
        weights = [w for layer in self.layers for w in vars(layer).values() if isinstance(w, Weight)]
        for layer in self.layers:  # a mixture-of-experts, convolution, DeltaNet or Mamba-2 layer's matrices
            for kind in ("moe", "conv", "delta", "mamba"):
                part = getattr(layer, kind, None)
                weights += part.weights() if part is not None else []
        return ops.small_batch_limit(weights)

    def new_cache(self, n_ctx: int, dtype=np.float32) -> KVCache:
        """An empty KV cache for n_ctx positions holding keys and values as dtype (float32 or float16)."""
        cfg = self.cfg
        return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, n_ctx, dtype)

    def forward(self, tokens, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run tokens (n,) through the model at positions cache.offset.., appending to the cache.

        Returns:
            float32 logits (n, vocab) when all_logits, else (1, vocab) for the last token. The
            (1, vocab) array is a reused buffer for decode: copy it to keep it past the next call.
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        cache.check_room(len(tokens))
        with ops.batch_phase(len(tokens), self.small_batch_max):
            return self._forward(tokens, cache, all_logits)

    def forward_from(
        self, first_layer: int, hidden: np.ndarray, tokens, cache: KVCache, all_logits: bool = False
    ) -> np.ndarray:
        """As forward, for the layers from `first_layer` on, starting from their input `hidden`.

        Partial GPU offload runs the first layers elsewhere and hands the residual stream over here.

        Args:
            first_layer: index of the first layer to run (0 < first_layer <= num_hidden_layers).
            hidden: (n, hidden_size) float32, the residual stream entering that layer.
            tokens: the n tokens (recorded in the cache).
            cache: a cache of num_hidden_layers - first_layer layers (its layer 0 is first_layer).
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        cache.check_room(len(tokens))
        with ops.batch_phase(len(tokens), self.small_batch_max):
            return self._forward(tokens, cache, all_logits, first=first_layer, hidden=hidden)

    def forward_batch(self, tokens, caches: list[KVCache]) -> np.ndarray:
        """One decode step for B sequences: token b goes to caches[b] at position caches[b].offset.

        The linears take all B activations at once (each weight row read once per step for every
        sequence); RoPE uses each sequence's own position and attention runs per sequence over its
        own cache. Every cache is advanced by its token.

        Args:
            tokens: (B,) one token id per sequence.
            caches: B distinct KV caches.

        Returns:
            float32 logits (B, vocab): a buffer reused by the next call with the same B (copy rows
            to keep them).
        """
        tokens = check_batch(tokens, caches)
        with ops.batch_phase(len(tokens), self.small_batch_max), rewound_on_failure(caches):
            return self._forward_batch(tokens, list(caches))

    def forward_batch_from(self, first_layer: int, hidden: np.ndarray, tokens, caches: list) -> np.ndarray:
        """forward_batch for the layers from `first_layer` on, from their input hidden (B, hidden_size);
        each cache holds those layers only (see forward_from)."""
        tokens = check_batch(tokens, caches)
        with ops.batch_phase(len(tokens), self.small_batch_max), rewound_on_failure(caches):
            return self._forward_batch(tokens, list(caches), first=first_layer, hidden=hidden)

    def _new_scratch(self, n: int):
        """Activation buffers for n tokens (a family with other buffers overrides it)."""
        return Scratch(self.cfg, n)

    def _batch_buffers(self, n: int) -> tuple[Scratch, np.ndarray]:
        """Scratch and (n, vocab) logits for batched decode of n sequences, kept per n."""
        buffers = self.__dict__.setdefault("_batch_scratch", {})
        if n not in buffers:
            if len(buffers) > 16:
                buffers.clear()
            buffers[n] = (self._new_scratch(n), np.empty((n, self.cfg.vocab_size), np.float32))
        return buffers[n]
