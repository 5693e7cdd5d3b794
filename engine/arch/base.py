"""What every decoder architecture shares: its KV cache and the forward entry point."""

from __future__ import annotations

import numpy as np

from engine.backends import cpu as ops
from engine.kv_cache import KVCache


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
        self.positions = np.empty(n, np.int64)


class Decoder:
    """Base of the architecture classes. A subclass sets `cfg` (num_hidden_layers, num_key_value_heads,
    head_dim) and implements `_forward(tokens, cache, all_logits)`."""

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
        with ops.batch_phase(len(tokens)):
            return self._forward(tokens, cache, all_logits)
