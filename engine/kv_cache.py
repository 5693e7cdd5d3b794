"""The KV cache: allocated once per context size, knows the tokens it holds."""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

from engine.errors import ContextOverflowError


def lazy_zeros(shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """A zero-filled array whose memory is committed page by page as it is written.

    np.zeros gives that too, except where the kernel backs large mappings with transparent huge
    pages: then the first write to each head's slice commits 2 MiB, and a 4k-token cache is fully
    resident after one token. An anonymous map with huge pages declined keeps memory proportional
    to the positions used.
    """
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if nbytes == 0 or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.zeros(shape, dtype)
    buf = mmap.mmap(-1, nbytes)
    buf.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


# The element types a cache can hold (attention reads both).
KV_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


class KVCache:
    """Keys and values of every layer for up to n_ctx positions, plus the token history.

    The arrays are committed only as positions are written (see lazy_zeros): an 8k-token cache
    costs memory for the tokens actually used.

    Interface (as mlx-lm's): `update_and_fetch` during a forward pass, `advance` once the pass
    is done, `offset`, `trim(n)`, `state`.
    """

    # every position's state can be read and written back (engine.prefix_cache stores prefixes of it)
    partial_states = True
    # None, or what a model derives from the token history and keeps with it (engine.vision.qwen35.MRopeTrack:
    # the M-RoPE offset of the text after images): told of every advance and trim, so that a pass never
    # rescans the history. Its methods: advance(tokens, start) (tokens[start:] joined) and trim(n) (the
    # first n positions stay).
    track = None

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, dtype=np.float32):
        dtype = np.dtype(dtype)
        if dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype must be float32 or float16, got {dtype}")
        self.n_ctx = n_ctx
        self.dtype = dtype
        # (n_layers, n_kv_heads, n_ctx, head_dim): per layer and head the positions are contiguous,
        # which is what attention reads. float16 halves the memory; attention widens it to float32.
        self.k = lazy_zeros((n_layers, n_kv_heads, n_ctx, head_dim), dtype)
        self.v = lazy_zeros((n_layers, n_kv_heads, n_ctx, head_dim), dtype)
        self._tokens: list[int] = []

    @property
    def offset(self) -> int:
        """Number of positions filled."""
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes + self.v.nbytes)

    def check_room(self, n: int) -> None:
        if self.offset + n > self.n_ctx:
            raise ContextOverflowError(self.offset + n, self.n_ctx)

    def update_and_fetch(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store k, v (n_tok, n_kv_heads, head_dim) at positions offset.. of `layer`.

        k, v are float32; they are stored converted to the cache's dtype (rounded to nearest for
        float16). Returns that layer's full (n_kv_heads, n_ctx, head_dim) key and value arrays, in
        the cache's dtype.
        """
        n = k.shape[0]
        pos = self.offset
        self.k[layer, :, pos : pos + n, :] = k.transpose(1, 0, 2)
        self.v[layer, :, pos : pos + n, :] = v.transpose(1, 0, 2)
        return self.k[layer], self.v[layer]

    def advance(self, tokens) -> None:
        """Record that `tokens` now occupy the next positions (call after every layer was updated)."""
        start = len(self._tokens)
        self._tokens.extend(int(t) for t in tokens)
        if self.track is not None:
            self.track.advance(self._tokens, start)

    def trim(self, n: int) -> int:
        """Forget the last n positions (speculation rollback, regenerate). Returns how many were dropped."""
        n = max(0, min(n, self.offset))
        if n:
            self._truncate(self.offset - n)
        return n

    @contextlib.contextmanager
    def forward_pass(self, tokens):
        """Around a model's pass over `tokens` into this cache (at offset..): the cache advances past them
        when it ends; should it fail part way, `rewind` makes the cache whole and nothing is advanced."""
        try:
            self._begin_pass(len(tokens))
            yield
        except BaseException:
            self.rewind()
            raise
        self.advance(tokens)
        self._finish_pass(len(tokens))

    def _begin_pass(self, n: int) -> None:
        """Before a pass of n tokens (forward_pass)."""

    def _finish_pass(self, n: int) -> None:
        """After a pass of n tokens and its advance (forward_pass)."""

    def rewind(self) -> int:
        """After a pass that failed part way: the cache whole again at or before its offset. Keys and values
        past the offset are written again by the next pass, so nothing is dropped here; returns 0."""
        return 0

    def _truncate(self, n: int) -> None:
        """Keep the first n tokens of the history (and the track's state for them)."""
        del self._tokens[n:]
        if self.track is not None:
            self.track.trim(n)

    def common_prefix(self, tokens) -> int:
        """Length of the longest common prefix between the cached tokens and `tokens`."""
        n = 0
        for a, b in zip(self._tokens, tokens):
            if a != int(b):
                break
            n += 1
        return n

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position's keys and values take over all layers."""
        n_layers, n_kv_heads, _, head_dim = self.k.shape
        return 2 * n_layers * n_kv_heads * head_dim * self.dtype.itemsize

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """Copies of everything the cache holds for positions lo..hi, each array with the positions on its
        third axis: keys and values (n_layers, n_kv_heads, hi - lo, head_dim)."""
        return np.array(self.k[:, :, lo:hi, :]), np.array(self.v[:, :, lo:hi, :])

    def write(self, lo: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store the arrays `read` returns (k, v: (n_layers, n_kv_heads, n, head_dim)) at positions lo.."""
        n = k.shape[2]
        self.k[:, :, lo : lo + n, :] = k
        self.v[:, :, lo : lo + n, :] = v

    @property
    def state(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        return self.k, self.v, self.tokens


class ShortConvKVCache(KVCache):
    """A KV cache for a model with short-convolution layers beside its attention ones (LFM2).

    The attention layers' keys and values are the base class's (layer index: the attention layers counted
    in order). Each convolution layer keeps the input of its convolution at every position, (n_conv, 1,
    n_ctx, width) in the cache's dtype: the output at p reads positions p - kernel + 1..p, so trimming
    (speculation, regenerate) and restoring a stored prefix stay exact with no state to roll back.
    """

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, dtype, n_conv: int, width: int
    ):
        super().__init__(n_layers, n_kv_heads, head_dim, n_ctx, dtype)
        self.conv = lazy_zeros((n_conv, 1, n_ctx, width), self.dtype)

    @property
    def nbytes(self) -> int:
        return super().nbytes + int(self.conv.nbytes)

    @property
    def bytes_per_token(self) -> int:
        n_conv, _, _, width = self.conv.shape
        return super().bytes_per_token + n_conv * width * self.dtype.itemsize

    def conv_history(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Store x (n_tok, width), convolution layer `layer`'s inputs, at positions offset.. and return
        that layer's (n_ctx, width) history, in the cache's dtype."""
        pos = self.offset
        self.conv[layer, 0, pos : pos + len(x)] = x
        return self.conv[layer, 0]

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """Keys, values and the convolution inputs (n_conv, 1, hi - lo, width) of positions lo..hi."""
        return (*super().read(lo, hi), np.array(self.conv[:, :, lo:hi, :]))

    def write(self, lo: int, k: np.ndarray, v: np.ndarray, conv: np.ndarray) -> None:
        super().write(lo, k, v)
        self.conv[:, :, lo : lo + conv.shape[2], :] = conv


class RecurrentKVCache(KVCache):
    """A KV cache for a model with recurrent layers beside its attention ones (Qwen3.5's gated DeltaNet).

    The attention layers' keys and values are the base class's (layer index: the attention layers counted
    in order). Each recurrent layer's state, `recurrent` (n_rec, *state_shape), and its convolution's last
    inputs, `conv_state` (n_rec, *conv_shape), float32, hold for the cache's end only: a trim cannot step
    back token by token, it returns to a snapshot.

    A multi-token pass (a prompt, a chunk of one) keeps two: the state at its start (`start_pass`), and the
    state one token before its end (`mix` runs the recurrent layers' last row apart; `end_pass` stores it).
    That one is where a regenerate of the same prompt restarts (prefill recomputes the prompt's last token
    for its logits) and where the next turn's prompt, respelling the reply, parts from the cache, one token
    early. A pass that continues the previous one (the next chunk of a prompt) keeps no start: the previous
    pass's end - 1 is one token back, and becomes a snapshot inside a prompt. At MAX_SNAPSHOTS a new one
    takes the arrays of the oldest inside a prompt, else of the oldest: a prompt of many chunks does not
    push out the turn boundaries before it.

    trim(n) returns to the latest snapshot at or before offset - n (the start when there is none) and drops
    what follows, so it may drop more than n: callers continue from `offset`. Stored prefixes
    (engine.prefix_cache) are not kept for it (`partial_states` False).
    """

    partial_states = False
    MAX_SNAPSHOTS = 6
    xp = np  # the states' array module (the CUDA backend's cache: CuPy)

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, n_ctx: int, dtype, n_rec: int,
        state_shape: tuple[int, ...], conv_shape: tuple[int, ...],
    ):
        super().__init__(n_layers, n_kv_heads, head_dim, n_ctx, dtype)
        self._init_states(n_rec, state_shape, conv_shape)

    def _init_states(self, n_rec: int, state_shape: tuple[int, ...], conv_shape: tuple[int, ...]) -> None:
        self.recurrent = self.xp.zeros((n_rec, *state_shape), np.float32)
        self.conv_state = self.xp.zeros((n_rec, *conv_shape), np.float32)
        self._snapshots: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._inside: set[int] = set()  # snapshots inside a prompt (a pass continued from them): first to go
        self._spare: list[tuple[np.ndarray, np.ndarray]] = []  # dropped snapshots' arrays, for the next
        # the running pass's end - 1: (position, state and conv arrays being filled layer by layer), or None
        self._keep: tuple[int, np.ndarray, np.ndarray] | None = None
        self._pass_end = -1  # where the last multi-token pass ended (-1 after a trim)

    @property
    def state_nbytes(self) -> int:
        """Bytes of the recurrent state with every snapshot slot filled (fixed, whatever the context)."""
        return (1 + self.MAX_SNAPSHOTS) * int(self.recurrent.nbytes + self.conv_state.nbytes)

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.state_nbytes

    def _slot(self) -> tuple[np.ndarray, np.ndarray]:
        """Arrays for a new snapshot: at capacity the ones of the snapshot to go, else a dropped one's, else
        fresh. Never more than MAX_SNAPSHOTS copies (the pass's end - 1 being filled counts): a fresh copy
        before dropping one made MAX_SNAPSHOTS + 1, one state over state_nbytes and the memory guard's
        estimate, 72 MiB for Qwen3-Next-80B; and no fresh allocation, whose pages fault in one by one, per
        prompt chunk."""
        if len(self._snapshots) + (self._keep is not None) >= self.MAX_SNAPSHOTS:
            pos = min(self._inside) if self._inside else min(self._snapshots)
            self._inside.discard(pos)
            return self._snapshots.pop(pos)
        if self._spare:
            return self._spare.pop()
        return self.xp.empty_like(self.recurrent), self.xp.empty_like(self.conv_state)

    def snapshot(self) -> None:
        """Keep the state at the current end."""
        pos = self.offset
        if pos == 0 or pos in self._snapshots:
            return
        state, conv = self._slot()
        self.xp.copyto(state, self.recurrent)
        self.xp.copyto(conv, self.conv_state)
        self._snapshots[pos] = (state, conv)

    def start_pass(self, n: int) -> None:
        """Before a pass of n > 1 tokens: keep the state at its start (or, where it continues the previous
        pass, mark that pass's end - 1 as inside a prompt) and ready the arrays of its end - 1 (`mix`)."""
        pos = self.offset
        if self._keep is not None:  # a pass that failed before its end
            self._spare.append(self._keep[1:])
            self._keep = None
        if pos == self._pass_end and pos - 1 in self._snapshots:
            self._inside.add(pos - 1)
        else:
            self.snapshot()
        self._keep = (pos + n - 1, *self._slot())

    def mix(self, slot: int, run, rows) -> np.ndarray:
        """Recurrent layer `slot` over a pass's rows: run(rows, conv_state, state) -> (n, width) outputs,
        with rows a sequence of arrays of one row per token, from and into the layer's states. In a pass that
        keeps its end - 1 (start_pass) the rows but the last run first and the state they leave is copied."""
        conv, state = self.conv_state[slot], self.recurrent[slot]
        if self._keep is None or self._keep[0] != self.offset + len(rows[0]) - 1:
            return run(rows, conv, state)
        head = run([r[:-1] for r in rows], conv, state)
        _, states, convs = self._keep
        self.xp.copyto(states[slot], state)
        self.xp.copyto(convs[slot], conv)
        return self.xp.concatenate([head, run([r[-1:] for r in rows], conv, state)])

    def end_pass(self) -> None:
        """After a pass start_pass began (and its advance): store the state of its end - 1."""
        pos, state, conv = self._keep
        self._keep = None
        self._snapshots[pos] = (state, conv)
        self._pass_end = self.offset

    def _begin_pass(self, n: int) -> None:
        if n > 1:
            self.start_pass(n)

    def _finish_pass(self, n: int) -> None:
        if n > 1:
            self.end_pass()

    def trim(self, n: int) -> int:
        """Forget at least the last n positions: back to the latest snapshot at or before offset - n.
        Returns how many were dropped."""
        n = max(0, min(n, self.offset))
        return self._back_to(self.offset - n) if n else 0

    def rewind(self) -> int:
        """After a pass that failed part way (its recurrent layers may have moved the states on, not the
        offset): back to the latest snapshot at or before the offset, as trim goes back. Returns how many
        positions were dropped."""
        if self._keep is not None:
            self._spare.append(self._keep[1:])
            self._keep = None
        return self._back_to(self.offset)

    def _back_to(self, limit: int) -> int:
        """The states of the latest snapshot at or before position limit (zeros: none), what follows it
        dropped; returns how many positions were."""
        end = self.offset
        pos = max((p for p in self._snapshots if p <= limit), default=0)
        if pos:
            state, conv = self._snapshots[pos]
            self.recurrent[:] = state
            self.conv_state[:] = conv
        else:
            self.recurrent[:] = 0.0
            self.conv_state[:] = 0.0
        for p in [p for p in self._snapshots if p > pos]:
            self._spare.append(self._snapshots.pop(p))
            self._inside.discard(p)
        self._pass_end = -1
        self._truncate(pos)
        return end - pos


class GroupedKVCache(KVCache):
    """A KV cache whose layers come in more than one shape (Gemma 4: the windowed layers' heads are half as
    wide as the global layers', with more of them).

    Layers of one (n_kv_heads, head_dim) share a group, an (n_group_layers, n_kv_heads, n_ctx, head_dim) pair
    of arrays; `slots[i]` = (group, index in it) of cache layer i. Trim, prefixes and stored prefixes work as
    for the base class (every position is kept).
    """

    def __init__(self, groups: list[tuple[int, int, int]], slots: list[tuple[int, int]], n_ctx: int, dtype):
        """groups: (n_layers, n_kv_heads, head_dim) of each group; slots: (group, index) per cache layer."""
        dtype = np.dtype(dtype)
        if dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype must be float32 or float16, got {dtype}")
        if sorted(slots) != sorted({(g, j) for g, (n, _, _) in enumerate(groups) for j in range(n)}):
            raise ValueError("GroupedKVCache: every group slot must belong to exactly one layer")
        self.n_ctx = n_ctx
        self.dtype = dtype
        self.slots = list(slots)
        self.groups = [
            (lazy_zeros((n, heads, n_ctx, hd), dtype), lazy_zeros((n, heads, n_ctx, hd), dtype))
            for n, heads, hd in groups
        ]
        self._tokens = []

    @property
    def nbytes(self) -> int:
        return sum(int(k.nbytes + v.nbytes) for k, v in self.groups)

    @property
    def bytes_per_token(self) -> int:
        floats = sum(2 * n * heads * hd for n, heads, _, hd in (k.shape for k, _ in self.groups))
        return floats * self.dtype.itemsize

    def update_and_fetch(self, layer: int, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        g, j = self.slots[layer]
        keys, values = self.groups[g]
        pos, n = self.offset, k.shape[0]
        keys[j, :, pos : pos + n, :] = k.transpose(1, 0, 2)
        values[j, :, pos : pos + n, :] = v.transpose(1, 0, 2)
        return keys[j], values[j]

    def fetch(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Cache layer `layer`'s (n_kv_heads, n_ctx, head_dim) keys and values, as stored so far."""
        g, j = self.slots[layer]
        keys, values = self.groups[g]
        return keys[j], values[j]

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """Keys and values of positions lo..hi, group by group (k0, v0, k1, v1, ...)."""
        return tuple(np.array(a[:, :, lo:hi, :]) for pair in self.groups for a in pair)

    def write(self, lo: int, *arrays: np.ndarray) -> None:
        for a, stored in zip(arrays, (a for pair in self.groups for a in pair), strict=True):
            stored[:, :, lo : lo + a.shape[2], :] = a

    @property
    def state(self):
        return self.groups, self.tokens


class LatentKVCache(KVCache):
    """The cache of multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): per layer and position one
    row of the compressed key-value latent (kv_lora_rank) and the rotated key part every head shares
    (qk_rope_head_dim), as llama.cpp's MLA keeps it.

    Each head's keys and values are that row times its slice of kv_b_proj, so the architecture folds the
    projection into the queries and the output (engine/arch/deepseek2.py) and attends over the rows as one
    key-value head whose values are the keys themselves: `k` is (n_layers, 1, n_ctx, width) and `v` is the
    same array, stored once. Trim, prefixes and stored prefixes work as for the base class.
    """

    def __init__(self, n_layers: int, width: int, n_ctx: int, dtype=np.float32):
        dtype = np.dtype(dtype)
        if dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype must be float32 or float16, got {dtype}")
        self.n_ctx = n_ctx
        self.dtype = dtype
        self.k = lazy_zeros((n_layers, 1, n_ctx, width), dtype)
        self.v = self.k
        self._tokens = []

    @property
    def nbytes(self) -> int:
        return int(self.k.nbytes)

    @property
    def bytes_per_token(self) -> int:
        n_layers, _, _, width = self.k.shape
        return n_layers * width * self.dtype.itemsize

    def update_and_fetch(self, layer: int, k: np.ndarray, v: np.ndarray | None = None):
        """Store the rows k (n_tok, 1, width) at positions offset.. of `layer` (v, the same rows, is not
        stored again). Returns that layer's (1, n_ctx, width) rows twice: keys and values."""
        pos = self.offset
        self.k[layer, 0, pos : pos + k.shape[0], :] = k[:, 0, :]
        return self.k[layer], self.k[layer]

    def read(self, lo: int, hi: int) -> tuple[np.ndarray, ...]:
        """A copy of the rows of positions lo..hi, (n_layers, 1, hi - lo, width)."""
        return (np.array(self.k[:, :, lo:hi, :]),)

    def write(self, lo: int, k: np.ndarray) -> None:
        """Store the rows `read` returns at positions lo.."""
        self.k[:, :, lo : lo + k.shape[2], :] = k
