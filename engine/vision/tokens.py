"""Image ids: how a prompt holds an image, and where a prompt pass may end.

An image's rows get ids past the model's vocabulary, base + slot * STRIDE + i for its i-th row, where slot
is the image's place in the model's ImageTable (one slot per distinct image content, never reused). The same
image in a later turn gets the same ids, so KV reuse, the prefix store and trimming treat it as they treat
text; another image gets other ids. The forward pass looks the ids' rows up in the table. Images have as
many rows as their family gives them (Gemma 3: 256 each; Mistral 3: by the image's size).

Gemma 3 (as transformers and llama.cpp run it) lets an image's tokens attend to each other both ways (a
`bidirectional` table), so a prompt pass must hold such an image whole: chunk_end moves a pass's end off an
image's inside. Mistral 3's image rows attend causally, like text, and passes may end anywhere.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence

import numpy as np

from engine.errors import ImagesBusyError

STRIDE = 1 << 20  # ids per slot: the most rows one image can have
# the image rows one model keeps (float32): 64 Gemma 3 4B images are 168 MiB, one Mistral Small image at
# 1540 px is 62 MiB (3025 rows of 5120)
MAX_BYTES = 512 << 20


class ImageTable:
    """The image rows a model can embed: slot -> (rows, hidden) float32 features, the newest `capacity`.

    Args:
        base: the first image id (the embedding table's row count).
        hidden: width of a row (the language model's hidden size).
        bidirectional: an image's rows see each other both ways (Gemma 3), so passes hold images whole.
        capacity: images kept; past it or past max_bytes of rows the oldest is dropped (a prompt that holds
            it again encodes it again, into a new slot); the newest always stays, and so do held images.

    Holding (a server's concurrent requests): an image is encoded while one request is parsed and its rows
    are read when that request's prompt is prefilled, later, while other requests encode theirs. `hold`
    keeps a prompt's images from being dropped until `release`; adding an image that does not fit beside
    the held ones raises ImagesBusyError instead of dropping rows a waiting prompt still needs.
    """

    def __init__(
        self, base: int, hidden: int, bidirectional: bool = False, capacity: int = 64,
        max_bytes: int = MAX_BYTES,
    ):
        self.base, self.hidden, self.capacity = int(base), int(hidden), int(capacity)
        self.max_bytes = int(max_bytes)
        self.bidirectional = bidirectional
        self._slots: OrderedDict[str, int] = OrderedDict()  # content digest -> slot
        self._rows: dict[int, np.ndarray] = {}
        self._next = 0
        self._held: Counter[int] = Counter()  # slot -> prompts holding it
        self._lock = threading.Lock()  # hold / release come from another thread than add

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
        """Store an image's rows (n, hidden); returns its slot.

        Raises:
            ImagesBusyError: the held images leave no room for these rows (nothing is stored).
        """
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        if rows.ndim != 2 or rows.shape[1] != self.hidden or not 0 < len(rows) <= STRIDE:
            raise ValueError(f"image rows {rows.shape}, expected (1 .. {STRIDE}, {self.hidden})")
        with self._lock:
            slot = self._next
            self._next += 1
            self._slots[digest] = slot
            self._rows[slot] = rows
            while self._over():
                old = next((d for d, s in self._slots.items() if s != slot and s not in self._held), None)
                if old is None:  # only held images (and this one) left
                    break
                self._rows.pop(self._slots.pop(old), None)
            if self._over() and self._held:
                del self._slots[digest], self._rows[slot]
                raise ImagesBusyError(
                    f"{len(self._held)} image(s) of prompts still being read fill the "
                    f"{self.max_bytes >> 20} MiB (or {self.capacity} images) kept for image rows: retry when "
                    "they finish (or, if this prompt's images alone need more, send fewer or smaller ones)"
                )
        return slot

    def _over(self) -> bool:
        return len(self._slots) > 1 and (len(self._slots) > self.capacity or self.nbytes > self.max_bytes)

    def hold(self, ids) -> tuple[int, ...]:
        """Keep the images whose ids are in `ids` (a prompt's) until `release` of the result."""
        with self._lock:
            slots = tuple(s for s in self._slots_of(ids) if s in self._rows)
            self._held.update(slots)
        return slots

    def release(self, slots: Sequence[int]) -> None:
        """Let the images of a `hold` be dropped again (once no other prompt holds them)."""
        with self._lock:
            self._held.subtract(slots)
            for slot in [s for s, n in self._held.items() if n <= 0]:
                del self._held[slot]

    def _slots_of(self, ids) -> set[int]:
        ids = np.asarray(ids)
        return {int(v) for v in (ids[ids >= self.base] - self.base) // STRIDE}

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held."""
        return sum(rows.nbytes for rows in self._rows.values())

    def missing(self, ids) -> int:
        """How many of the images whose ids are in `ids` are no longer held."""
        return sum(slot not in self._rows for slot in self._slots_of(ids))

    def ids(self, slot: int) -> list[int]:
        """The prompt ids of the image in `slot`, one a row."""
        first = self.base + slot * STRIDE
        return list(range(first, first + len(self._rows[slot])))

    def _locate(self, token: int) -> tuple[int, int]:
        return divmod(int(token) - self.base, STRIDE)

    def embed(self, out: np.ndarray, ids: np.ndarray) -> None:
        """out[r] = the image row of ids[r], for every image id in ids (other rows untouched).

        Raises:
            KeyError: an image id whose image is no longer held.
        """
        for r in np.flatnonzero(ids >= self.base):
            slot, i = self._locate(ids[r])
            rows = self._rows.get(slot)
            if rows is None:
                raise KeyError(f"image {slot} is no longer held; encode the prompt again")
            out[r] = rows[i, : out.shape[1]]  # a wider row carries more (Qwen3-VL's deepstack sets)

    def runs(self, ids: np.ndarray) -> list[tuple[int, int]]:
        """[start, end) of each run of one image's consecutive ids in ids (a pass's tokens)."""
        ids = np.asarray(ids)
        where = np.flatnonzero(ids >= self.base)
        if not len(where):
            return []
        slots = (ids[where] - self.base) // STRIDE
        cuts = np.flatnonzero((np.diff(where) != 1) | (np.diff(slots) != 0)) + 1
        return [(int(a[0]), int(a[-1]) + 1) for a in np.split(where, cuts)]

    def key_ends(self, ids: np.ndarray, pos0: int) -> np.ndarray | None:
        """Per row of a pass at positions pos0.., the end (exclusive) of the keys it sees: its own position
        + 1, or its image's last position + 1 (an image's rows see each other). None: no image rows, or a
        causal table.

        Raises:
            ValueError: the pass holds only part of an image (chunk_end keeps passes from doing so).
        """
        runs = self.runs(ids) if self.bidirectional else []
        if not runs:
            return None
        ends = np.arange(pos0 + 1, pos0 + len(ids) + 1, dtype=np.int64)
        for a, b in runs:
            slot, first = self._locate(ids[a])
            if first != 0 or self._locate(ids[b - 1])[1] != self._count(slot) - 1:
                raise ValueError("a prompt pass holds part of an image; passes must end at chunk_end")
            ends[a:b] = pos0 + b
        return ends

    def _count(self, slot: int) -> int:
        rows = self._rows.get(slot)
        if rows is None:
            raise KeyError(f"image {slot} is no longer held; encode the prompt again")
        return len(rows)


def chunk_end(model, ids: Sequence[int], start: int, limit: int) -> int:
    """Where a prompt pass that starts at ids[start] and takes at most `limit` tokens should end: start +
    limit (or the prompt's end), one token earlier where it would leave the prompt's last token to a pass of
    its own (a recurrent cache keeps the state one token before a multi-token pass's end, where a regenerate
    restarts: RecurrentKVCache), moved back to the start of an image it would cut, or, when that image
    starts the pass, forward to its end (a bidirectional table's image is never split)."""
    end = min(len(ids), start + limit)
    if end == len(ids) - 1 and end - start > 1:
        end -= 1
    table = getattr(model, "images", None)
    if table is None or not table.bidirectional or end >= len(ids) or end == start:
        return end
    cut, before = int(ids[end]), int(ids[end - 1])
    if cut < table.base or before < table.base or table._locate(cut)[0] != table._locate(before)[0]:
        return end  # not inside an image
    first = end - (cut - table.base) % STRIDE  # the cut image's first row
    if first > start:
        return first
    slot = (cut - table.base) // STRIDE
    return first + table._count(slot)


def safe_prefix(model, ids: Sequence[int], n: int) -> int:
    """The longest prefix of at most n tokens of ids that does not end inside an image (of a bidirectional
    table; any prefix of a causal one)."""
    table = getattr(model, "images", None)
    if table is None or not table.bidirectional or n <= 0 or n >= len(ids) or ids[n] < table.base:
        return n
    first = n - ((int(ids[n]) - table.base) % STRIDE)
    return max(0, min(n, first))
