"""A RAM-bounded store of KV states keyed by token sequences, so switching chats never re-prefills.

The store is a radix tree over token ids. Each node owns the keys and values of the positions its
edge covers, so conversations that share a prefix (a system prompt, an edited branch) share that
prefix's memory. Looking a prompt up walks the tree as far as the prompt matches; restoring copies
those positions into a live KVCache. Memory is bounded in bytes (only positions actually stored
count); when over budget the least recently used leaf goes first (a parent is touched whenever a
child is, so it is never older than its children).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from engine.kv_cache import KVCache


class _Node:
    """One edge of the tree: tokens (n,) and their cache state, the arrays KVCache.read returns (k, v:
    (n_layers, n_kv_heads, n, head_dim), and more for some caches), positions on the third axis."""

    __slots__ = ("tokens", "parts", "children", "parent", "last_used")

    def __init__(self, tokens: np.ndarray, parts: tuple[np.ndarray, ...], parent: _Node | None):
        self.tokens = tokens
        self.parts = parts
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_used = 0

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.parts)

    def positions(self, lo: int, hi: int | None = None) -> tuple[np.ndarray, ...]:
        """The parts of positions lo..hi of this edge (views)."""
        return tuple(a[:, :, lo:hi] for a in self.parts)


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int64 arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixCache:
    """LRU store of KV states for token sequences, bounded by `max_bytes`.

    Args:
        max_bytes: memory budget for stored keys and values (copies of the used positions, in the
            cache's precision).
    """

    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.max_bytes = int(max_bytes)
        self._root = _Node(np.empty(0, np.int64), (), None)
        self._clock = 0
        self._nbytes = 0
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        """Bytes of keys and values held."""
        return self._nbytes

    @property
    def n_tokens(self) -> int:
        """Token positions held (shared prefixes counted once)."""
        return sum(len(n.tokens) for n in self._nodes())

    def _nodes(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _walk(self, ids: np.ndarray) -> tuple[list[tuple[_Node, int]], int]:
        """Follow ids from the root. Returns ([(node, positions of its edge matched)], total matched)."""
        path: list[tuple[_Node, int]] = []
        node, depth = self._root, 0
        while depth < len(ids):
            child = node.children.get(int(ids[depth]))
            if child is None:
                break
            m = _common(child.tokens, ids[depth:])
            path.append((child, m))
            depth += m
            if m < len(child.tokens):
                break
            node = child
        return path, depth

    def _touch(self, path: list[tuple[_Node, int]]) -> None:
        self._clock += 1
        for node, _ in path:
            node.last_used = self._clock

    def match(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of `tokens` whose KV state is stored."""
        return self._walk(np.asarray(tokens, dtype=np.int64))[1]

    def stored_sequence(self, tokens: Sequence[int]) -> list[int]:
        """The stored sequence that shares the longest prefix with `tokens` ([] if none shares any).

        Past the point where `tokens` parts from the store, it follows the rest of that edge and
        then, at each fork, the most recently used branch: the conversation last run there.
        """
        path, _ = self._walk(np.asarray(tokens, dtype=np.int64))
        if not path:
            return []
        out = [node.tokens for node, _ in path]
        node = path[-1][0]
        while node.children:
            node = max(node.children.values(), key=lambda child: child.last_used)
            out.append(node.tokens)
        return np.concatenate(out).tolist()

    def restore(self, tokens: Sequence[int], cache: KVCache, start: int | None = None) -> int:
        """Make `cache` hold the longest stored prefix of `tokens`, copying only what it lacks.

        Args:
            tokens: the prompt about to be run.
            cache: the live cache; positions up to `start` are kept as they are.
            start: how many leading positions of the cache already equal tokens (default: computed).

        Returns:
            number of positions the cache now holds that match `tokens` (max of start and the match).
        """
        ids = np.asarray(tokens, dtype=np.int64)
        if start is None:
            start = cache.common_prefix(ids)
        if not cache.partial_states:  # a recurrent model's state is kept for the cache's end only
            self.misses += 1
            return start
        path, matched = self._walk(ids)
        matched = min(matched, cache.n_ctx)
        if matched <= start:
            self.misses += 1
            return start
        self.hits += 1
        self._touch(path)
        cache.trim(cache.offset - start)
        pos = 0
        for node, m in path:
            lo, hi = max(start, pos), min(pos + m, matched)
            if lo < hi:
                # node positions pos..pos+m map onto cache positions of the same index
                cache.write(lo, *node.positions(lo - pos, hi - pos))
            pos += m
        cache.advance(ids[start:matched])
        return matched

    def insert(self, cache: KVCache) -> int:
        """Store the cache's current state (its tokens and their k, v), copying only new positions.

        A state larger than the whole budget is stored up to the budget. Returns bytes added.
        """
        ids = np.asarray(cache.tokens, dtype=np.int64)
        if len(ids) == 0 or self.max_bytes == 0 or not cache.partial_states:
            return 0
        ids = ids[: self.max_bytes // cache.bytes_per_token]
        path, matched = self._walk(ids)
        parent = self._root
        if path:
            node, m = path[-1]
            parent = self._split(node, m) if m < len(node.tokens) else node
            path[-1] = (parent, m)  # the lower part of a split edge is not on this path: not touched
        self._touch(path)
        added = 0
        if matched < len(ids):
            leaf = _Node(ids[matched:].copy(), cache.read(matched, len(ids)), parent)
            leaf.last_used = self._clock
            parent.children[int(ids[matched])] = leaf
            added = leaf.nbytes
            self._nbytes += added
        self._evict()
        return added

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut node's edge after m positions; returns the new upper node (which holds those m)."""
        upper = _Node(node.tokens[:m].copy(), tuple(a.copy() for a in node.positions(0, m)), node.parent)
        upper.last_used = node.last_used
        node.parent.children[int(node.tokens[0])] = upper
        # copies, not views: a view would keep the whole old segment alive after the upper part is evicted
        node.tokens, node.parts = node.tokens[m:].copy(), tuple(a.copy() for a in node.positions(m))
        node.parent = upper
        upper.children[int(node.tokens[0])] = node
        return upper

    def _evict(self) -> None:
        while self._nbytes > self.max_bytes:
            leaves = [n for n in self._nodes() if not n.children]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: n.last_used)
            del victim.parent.children[int(victim.tokens[0])]
            self._nbytes -= victim.nbytes

    def clear(self) -> None:
        """Drop everything."""
        self._root.children.clear()
        self._nbytes = 0
