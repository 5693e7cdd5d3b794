"""Image ids: how a prompt holds an image, and where a prompt pass may end.

An image becomes `span` consecutive ids past the model's vocabulary, base + slot * span + i for its i-th
row, where slot is the image's place in the model's ImageTable (one slot per distinct image content, never
reused). The same image in a later turn gets the same ids, so KV reuse, the prefix store and trimming treat
it as they treat text; another image gets other ids. The forward pass looks the ids' rows up in the table.

Gemma 3 (as transformers and llama.cpp run it) lets an image's tokens attend to each other both ways, so a
prompt pass must hold an image whole: chunk_end moves a pass's end off an image's inside.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class ImageTable:
    """The image rows a model can embed: slot -> (span, hidden) float32 features, the newest `capacity`.

    Args:
        base: the first image id (the embedding table's row count).
        span: rows per image.
        hidden: width of a row (the language model's hidden size).
        capacity: images kept; the oldest is dropped (a prompt that holds it again encodes it again, into a
            new slot).
    """

    def __init__(self, base: int, span: int, hidden: int, capacity: int = 64):
        self.base, self.span, self.hidden, self.capacity = int(base), int(span), int(hidden), int(capacity)
        self._slots: OrderedDict[str, int] = OrderedDict()  # content digest -> slot
        self._rows: dict[int, np.ndarray] = {}
        self._next = 0

    @staticmethod
    def digest(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    def slot_of(self, digest: str) -> int | None:
        """The slot holding the image with this digest, or None."""
        slot = self._slots.get(digest)
        if slot is not None:
            self._slots.move_to_end(digest)
        return slot

    def add(self, digest: str, rows: np.ndarray) -> int:
        """Store an image's rows (span, hidden); returns its slot."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.shape != (self.span, self.hidden):
            raise ValueError(f"image rows {rows.shape}, expected {(self.span, self.hidden)}")
        slot = self._next
        self._next += 1
        self._slots[digest] = slot
        self._rows[slot] = rows
        while len(self._slots) > self.capacity:
            _, old = self._slots.popitem(last=False)
            self._rows.pop(old, None)
        return slot

    def ids(self, slot: int) -> list[int]:
        """The prompt ids of the image in `slot`."""
        first = self.base + slot * self.span
        return list(range(first, first + self.span))

    def embed(self, out: np.ndarray, ids: np.ndarray) -> None:
        """out[r] = the image row of ids[r], for every image id in ids (other rows untouched).

        Raises:
            KeyError: an image id whose image is no longer held.
        """
        for r in np.flatnonzero(ids >= self.base):
            slot, i = divmod(int(ids[r]) - self.base, self.span)
            rows = self._rows.get(slot)
            if rows is None:
                raise KeyError(f"image {slot} is no longer held; encode the prompt again")
            out[r] = rows[i]

    def runs(self, ids: np.ndarray) -> list[tuple[int, int]]:
        """[start, end) of each run of one image's ids in ids (a pass's tokens)."""
        ids = np.asarray(ids)
        where = np.flatnonzero(ids >= self.base)
        if not len(where):
            return []
        slots = (ids[where] - self.base) // self.span
        cuts = np.flatnonzero((np.diff(where) != 1) | (np.diff(slots) != 0)) + 1
        return [(int(a[0]), int(a[-1]) + 1) for a in np.split(where, cuts)]

    def key_ends(self, ids: np.ndarray, pos0: int) -> np.ndarray | None:
        """Per row of a pass at positions pos0.., the end (exclusive) of the keys it sees: its own position
        + 1, or its image's last position + 1 (an image's rows see each other). None: no image rows.

        Raises:
            ValueError: the pass holds only part of an image (chunk_end keeps passes from doing so).
        """
        runs = self.runs(ids)
        if not runs:
            return None
        ends = np.arange(pos0 + 1, pos0 + len(ids) + 1, dtype=np.int64)
        for a, b in runs:
            first, last = (int(ids[a]) - self.base) % self.span, (int(ids[b - 1]) - self.base) % self.span
            if first != 0 or last != self.span - 1:
                raise ValueError("a prompt pass holds part of an image; passes must end at chunk_end")
            ends[a:b] = pos0 + b
        return ends


def chunk_end(model, ids: Sequence[int], start: int, limit: int) -> int:
    """Where a prompt pass that starts at ids[start] and takes at most `limit` tokens should end: start +
    limit (or the prompt's end), moved back to the start of an image it would cut, or, when that image
    starts the pass, forward to its end (an image is never split)."""
    end = min(len(ids), start + limit)
    table = getattr(model, "images", None)
    if table is None or end >= len(ids):
        return end
    arr = np.asarray(ids[start : end + table.span], dtype=np.int64)
    k = end - start  # ids[end] is arr[k]
    if arr[k] < table.base or k == 0 or arr[k - 1] < table.base:
        return end
    slot = (int(arr[k]) - table.base) // table.span
    if (int(arr[k - 1]) - table.base) // table.span != slot:
        return end  # one image ends and the next starts here
    first = start + k - ((int(arr[k]) - table.base) % table.span)  # the cut image's first row
    if first > start:
        return first
    return first + table.span


def safe_prefix(model, ids: Sequence[int], n: int) -> int:
    """The longest prefix of at most n tokens of ids that does not end inside an image."""
    table = getattr(model, "images", None)
    if table is None or n <= 0 or n >= len(ids) or ids[n] < table.base:
        return n
    first = n - ((int(ids[n]) - table.base) % table.span)
    return max(0, min(n, first))
