"""What every decoder architecture shares: its KV cache and the forward entry point."""

from __future__ import annotations

import numpy as np

from engine.backends import cpu as ops
from engine.kv_cache import KVCache


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
