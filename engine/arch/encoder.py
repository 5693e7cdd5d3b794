"""What the embedding encoders (BERT, nomic-bert) share: batched passes over several sequences at once, the
refusal to chat, and an empty cache.

A batch is the sequences' tokens laid end to end, (N, hidden) rows: every linear runs once over all N rows
(BLAS over the whole batch, where one short sentence at a time left the small-batch kernels doing a
prefill's work), and attention runs per sequence over its own rows (a block-diagonal mask, no padding).
"""

from __future__ import annotations

import numpy as np

from engine.backends import cpu as ops
from engine.backends.cpu.ops import softmax_fast
from engine.errors import EmbeddingOnlyModelError
from engine.kv_cache import KVCache


def hf_tensor_names(hf_tensors, prefixes: tuple[str, ...], global_names: dict[str, str],
                    layer_names: dict[str, str], layer_re) -> dict[str, str]:
    """GGUF name -> Hugging Face name of an encoder folder's tensors: after `prefixes` are taken off, a
    name in `global_names`, or one `layer_re` splits into (layer index, part) with the part in
    `layer_names`; other tensors (heads the encoder does not use) are left out."""
    out = {}
    for hf in hf_tensors:
        name = hf
        for prefix in prefixes:
            name = name.removeprefix(prefix)
        if name in global_names:
            out[global_names[name]] = hf
        elif (m := layer_re.fullmatch(name)) and m.group(2) in layer_names:
            out[f"blk.{m.group(1)}.{layer_names[m.group(2)]}"] = hf
    return out


def segments(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(starts (B + 1,), positions (N,)): where each sequence's rows begin (and the end), and each row's
    position within its own sequence (0..n-1)."""
    starts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    positions = np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1], lengths)
    return starts, positions


# queries per block of attend_segments: a (heads, block, n) score array stays a few MB for a long input
QUERY_BLOCK = 256


def attend_segments(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, starts: np.ndarray, window: int = 0
) -> np.ndarray:
    """Bidirectional attention of each sequence over its own rows: q, k, v (heads, N, head_dim) ->
    (N, heads * head_dim), scores scaled by head_dim^-0.5; all heads of a block of queries in one batched
    matmul (a short sentence's twelve per-head products cost more in calls than in arithmetic). window > 0:
    each query sees only the keys at most `window` positions away, either side (ModernBERT's local layers)."""
    heads, n, hd = q.shape
    scale = np.float32(hd**-0.5)
    q, v = np.ascontiguousarray(q), np.ascontiguousarray(v)
    # keys laid out transposed once, (heads, head_dim, N): numpy's stacked matmul over a transposed view
    # (k[:, a:b].transpose(0, 2, 1)) was measured 50-500x slower with 2 OpenBLAS threads on a busy
    # 2-core machine than over these contiguous rows (most of a bge-small pass's attention time)
    kt = np.ascontiguousarray(k.transpose(0, 2, 1))
    out = np.empty((n, heads, hd), np.float32)
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        keys, values = kt[:, :, a:b], v[:, a:b]
        for q0 in range(a, b, QUERY_BLOCK):
            q1 = min(q0 + QUERY_BLOCK, b)
            scores = np.matmul(q[:, q0:q1], keys)  # (heads, q1 - q0, b - a)
            if window and b - a > window + 1:
                far = np.abs(np.arange(q0 - a, q1 - a)[:, None] - np.arange(b - a)[None, :]) > window
                scores[:, far] = _MASKED
            softmax_fast(scores.reshape(-1, b - a), scale)
            out[q0:q1] = np.matmul(scores, values).transpose(1, 0, 2)
    return out.reshape(n, heads * hd)


# a masked score: far below any real one, finite (softmax_fast's exp clamps it to a weight of ~1e-38)
_MASKED = np.float32(-1e30)


class Encoder:
    """Base of the encoder families. A subclass sets `cfg` (max_position_embeddings, head_dim), `_small_max`
    (ops.small_batch_limit of its matrices) and implements `_hidden(ids (N,), starts, positions)` returning
    the last layer's rows (N, hidden_size)."""

    encoder_only = True  # no logits, no generation: engine.embed and the server check this
    images = None
    family = "an encoder"  # for the refusal's message

    def hidden_states(self, tokens) -> np.ndarray:
        """The last layer's output (n, hidden_size) float32 for one sequence of token ids (n,), token type
        0 (a single-segment input, as sentence-transformers encodes one).

        Raises:
            ValueError: no tokens, or more than the model's positions.
        """
        return self.hidden_states_batch([tokens])[0]

    def hidden_states_batch(self, sequences) -> list[np.ndarray]:
        """hidden_states of several sequences in one pass: each sequence's rows (n_i, hidden_size), as views
        of one (sum n_i, hidden_size) array.

        Raises:
            ValueError: an empty sequence, or one longer than the model's positions.
        """
        seqs = [np.asarray(s, dtype=np.int64).reshape(-1) for s in sequences]
        limit = self.cfg.max_position_embeddings
        for s in seqs:
            if not 0 < len(s) <= limit:
                raise ValueError(f"{len(s)} tokens for an encoder of {limit} positions")
        if not seqs:
            return []
        lengths = [len(s) for s in seqs]
        starts, positions = segments(lengths)
        ids = np.concatenate(seqs)
        with ops.batch_phase(len(ids), self._small_max):  # the threading policy of a decoder's prefill
            x = self._hidden(ids, starts, positions)
        return [x[a:b] for a, b in zip(starts[:-1], starts[1:])]

    def new_cache(self, n_ctx: int, dtype=np.float32) -> KVCache:
        """An empty cache without layers: an encoder keeps no state between calls (the chat runner holds
        one per model all the same)."""
        return KVCache(0, 1, self.cfg.head_dim, n_ctx, dtype)

    def _refuse(self, *args, **kwargs):
        raise EmbeddingOnlyModelError(
            f"this is an embedding model ({self.family}): it computes embeddings and cannot chat or "
            "generate text; use `hearth embed`, POST /v1/embeddings or /api/embed, or load a chat model"
        )

    forward = forward_from = forward_batch = forward_batch_from = _refuse
