"""Qwen3.5's and Qwen3-VL's vision (Qwen3_5ForConditionalGeneration, Qwen3VLForConditionalGeneration): a ViT
over variable-size images, patches merged 2x2, and M-RoPE positions for the rows it gives the language model.

As transformers runs it, with its Qwen2-VL image processor and Qwen3-VL processor:
- the image (RGB, EXIF orientation applied) is resized (bicubic) so both sides are multiples of patch x merge
  and its area lies within [min_pixels, max_pixels], aspect kept as closely as that allows (smart_resize),
  scaled to [0, 1] and normalized by the preprocessor's mean and std;
- patches are taken in merge order (each merge x merge square's patches one after another, squares row by
  row); the patch embedding is a 3D convolution over temporal_patch_size copies of the image, so its kernel
  summed over time applies to the one image;
- a learned square grid of position embeddings is resampled (bilinear, corners aligned) to the image's patch
  grid and added; every block is LayerNorm -> attention with 2D rotary positions (per head, the first half of
  the rotate-half pairs turn by the patch's row, the second by its column, on a quarter of the head's
  frequencies each) -> residual, LayerNorm -> linear, tanh GELU, linear -> residual;
- the merger LayerNorms each patch, concatenates each square's patches (patch-major) and runs linear ->
  exact GELU -> linear into the language model's width;
- the prompt holds, where the template wrote <|image_pad|> (between <|vision_start|> and <|vision_end|>), one
  pad per merged row, which the image's rows replace. They attend causally, like text.

Qwen3-VL's tower is the same with deepstack: after each block listed in deepstack_visual_indexes, a merger of
its own (LayerNorm over each square's concatenated patches, then linear -> exact GELU -> linear) gives the
image a second set of rows; the language model adds the k-th set (in block order) to the image's rows of its
residual stream after its layer k. The table keeps them as one wide row per image row: [merged | set 0 | ...].

Positions (M-RoPE): text at sequence index i sits at i + delta, where delta sums, over the images before it,
max(rows, columns) - rows * columns of their merged grids; an image starting at index s, at position P = s +
delta, gives its row r the positions (t, h, w) = (P, P + r // columns, P + r % columns). The language model's
rotary pairs turn by t, h or w, interleaved by its mrope_section (pair j: h when j % 3 == 1 and j < 3 h-pairs,
w when j % 3 == 2 and j < 3 w-pairs, else t; Qwen2.5-VL's sections lie in a row instead: mrope_masks). With
text only the three agree with the index. Qwen2.5-VL's windowed tower (engine.vision.qwen25) builds on this.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.backends import cpu as ops
from engine.backends.cpu.ops import gelu_erf_fast
from engine.errors import ImageInputError, ModelFormatError
from engine.vision.tokens import STRIDE, ImageTable
from engine.vision.tower import (
    CLIP_MEAN,
    CLIP_STD,
    VisionTower,
    attend_all,
    gelu_tanh,
    layernorm,
    linear,
    rotate_half,
    single_token,
)

IMAGE_PAD = "<|image_pad|>"


@dataclass(frozen=True)
class Qwen35VisionShape:
    hidden: int
    ff: int
    layers: int
    heads: int
    patch: int
    text_hidden: int
    positions: int  # learned position embeddings: a square grid of this many
    mrope_section: tuple[int, int, int]  # the language model's rotary pairs turned by t, h, w
    merge: int = 2
    temporal: int = 2
    rope_theta: float = 10000.0
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    eps: float = 1e-6
    deepstack: tuple[int, ...] = ()  # Qwen3-VL: the blocks whose output its deepstack mergers take, in order
    # the language model's M-RoPE layout: sections interleaved (Qwen3.5, Qwen3-VL) or in a row (Qwen2.5-VL)
    mrope_interleaved: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def cell(self) -> int:
        """Pixels along a side of one merged row's square (patch x merge)."""
        return self.patch * self.merge


@dataclass
class _Block:
    ln1: tuple[np.ndarray, np.ndarray]
    qkv: object
    qkv_b: np.ndarray
    proj: object
    proj_b: np.ndarray
    ln2: tuple[np.ndarray, np.ndarray]
    fc1: object
    fc1_b: np.ndarray
    fc2: object
    fc2_b: np.ndarray


class Qwen35ImageTable(ImageTable):
    """An ImageTable that knows each image's merged grid, and so the M-RoPE positions of a sequence; with
    Qwen3-VL's deepstack, its rows carry `deepstack` more sets of features after the merged one."""

    def __init__(self, base: int, hidden: int, deepstack: int = 0):
        super().__init__(base, hidden * (1 + deepstack), bidirectional=False)
        self.width, self.deepstack = hidden, deepstack
        self.grids: dict[int, tuple[int, int]] = {}  # slot -> (rows, columns); tiny, kept past eviction

    def add_deepstack(self, out: np.ndarray, ids: np.ndarray, level: int) -> None:
        """out[r] += deepstack set `level` of ids[r]'s image row, for every image id in ids (a pass's).

        Raises:
            KeyError: an image id whose image is no longer held.
        """
        lo = (level + 1) * self.width
        for r in np.flatnonzero(ids >= self.base):
            slot, i = self._locate(ids[r])
            rows = self._rows.get(slot)
            if rows is None:
                raise KeyError(f"image {slot} is no longer held; encode the prompt again")
            out[r] += rows[i, lo : lo + self.width]

    def any_held(self) -> bool:
        """Whether an image was ever added (before that, every position is its index)."""
        return self._next > 0

    def positions(self, held: Sequence[int], ids: np.ndarray) -> np.ndarray:
        """(3, n) int64 (t, h, w) positions of a pass's ids that follow the `held` ids (the cache's tokens),
        from a scan of the whole sequence (cache_positions gives the same from a cache's MRopeTrack).

        Raises:
            KeyError: an image id of an image this table never held.
        """
        seq = np.concatenate([np.asarray(held, np.int64), np.asarray(ids, np.int64)])
        return self._positions(seq, 0, 0)[:, len(held) :]

    def cache_positions(self, cache, ids: np.ndarray) -> np.ndarray:
        """positions(cache.tokens, ids) at a cost that does not grow with the cache's history: from the
        MRopeTrack the cache keeps (KVCache.track), made by one scan of its tokens the first time.

        Raises:
            KeyError: an image id of an image this table never held.
        """
        track = cache.track
        if not isinstance(track, MRopeTrack) or track.table is not self:
            track = MRopeTrack(self)
            track.advance(cache.tokens, 0)
            cache.track = track
        start = cache.offset
        return self._positions(np.asarray(ids, np.int64), start, track.offset(start))

    def _positions(self, seq: np.ndarray, start: int, delta: int) -> np.ndarray:
        """(3, len(seq)) positions of the ids seq at indices start.. of a sequence whose images before
        `start` moved the text by delta (an image cut at `start` continues: its rows' ids say which)."""
        index = np.arange(start, start + len(seq), dtype=np.int64)
        out = np.broadcast_to(index, (3, len(seq))).copy()
        where = np.flatnonzero(seq >= self.base)
        if not len(where):  # text only (a decode step): the offset of the images before it
            out += delta
            return out
        ends, contrib = self._image_ends(seq)
        shifts = np.zeros(len(seq), np.int64)
        shifts[ends] = contrib
        shift = delta + np.cumsum(shifts) - shifts  # over the images that ended before each index
        out += shift
        slot, row = np.divmod(seq[where] - self.base, STRIDE)
        cols = np.array([self.grids[int(s)][1] for s in slot], np.int64)
        first = index[where] - row + shift[where]  # P of each image row's image
        out[0, where] = first
        out[1, where] = first + row // cols
        out[2, where] = first + row % cols
        return out

    def _image_ends(self, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where in seq images end (their last rows' places) and what each moves the text after it by:
        max(rows, columns) - rows * columns of its merged grid.

        Raises:
            KeyError: an image id of an image this table never held.
        """
        where = np.flatnonzero(seq >= self.base)
        slot, row = np.divmod(seq[where] - self.base, STRIDE)
        for s in np.unique(slot):
            if int(s) not in self.grids:
                raise KeyError(f"image {int(s)} is no longer held; encode the prompt again")
        grids = np.array([self.grids[int(s)] for s in slot], np.int64).reshape(-1, 2)
        gh, gw = grids[:, 0], grids[:, 1]
        last = row == gh * gw - 1
        return where[last], (np.maximum(gh, gw) - gh * gw)[last]


class MRopeTrack:
    """The M-RoPE offset of a cache's text (KVCache.track), kept as its tokens come and go: text at index i
    sits at i + the sum, over the images that ended before i, of max(rows, columns) - rows * columns.

    ends[k] is the index just past the k-th image's last row, totals[k] the offset after it; an advance adds
    the new tokens' images, a trim drops those that no longer end inside the history. A pass's positions
    then cost O(pass) (Qwen35ImageTable.cache_positions), where a scan of the history made every decode step
    O(context)."""

    def __init__(self, table: Qwen35ImageTable):
        self.table = table
        self.ends: list[int] = []
        self.totals: list[int] = []

    def offset(self, index: int) -> int:
        """The offset of the text at `index`: the images that ended before it moved it by this much."""
        k = bisect.bisect_right(self.ends, index)
        return self.totals[k - 1] if k else 0

    def advance(self, tokens: Sequence[int], start: int) -> None:
        """tokens[start:] joined the history (tokens: the whole history, a list or array)."""
        ends, contrib = self.table._image_ends(np.asarray(tokens[start:], np.int64))
        total = self.totals[-1] if self.totals else 0
        for end, c in zip(ends.tolist(), contrib.tolist(), strict=True):
            total += c
            self.ends.append(start + end + 1)
            self.totals.append(total)

    def trim(self, n: int) -> None:
        """Only the first n tokens stay."""
        while self.ends and self.ends[-1] > n:
            self.ends.pop()
            self.totals.pop()


class Qwen35Vision(VisionTower):
    """Qwen3.5's (and Qwen3-VL's) vision tower over a weight source with llama.cpp's mmproj names
    (engine.vision.load maps transformers' `visual.*` onto them): v.patch_embd (the 3D convolution, or its
    temporal slices as v.patch_embd.weight and .weight.1), v.position_embd, v.blk.N.{ln1, attn_qkv, attn_out,
    ln2, ffn_up, ffn_down}, the merger's norm and linears as v.post_ln, mm.0, mm.2, and Qwen3-VL's deepstack
    mergers as v.deepstack.B.{norm, fc1, fc2} (B: the vision block whose output the merger takes, as
    llama.cpp's converter names them)."""

    bidirectional = False
    patch_b: np.ndarray | None = None  # the patch convolution's bias (Qwen2.5-VL's has none)

    def __init__(self, shape: Qwen35VisionShape, weights, source: Path):
        self._setup(shape, weights, source)
        d, ff = shape.hidden, shape.ff
        side = math.isqrt(shape.positions)
        if side * side != shape.positions:
            raise ModelFormatError(source, f"num_position_embeddings {shape.positions} is not a square")
        self.patch_b = weights.vector("v.patch_embd.bias", d)
        self.pos_embed = weights.floats("v.position_embd.weight", (shape.positions, d))
        self.side = side

        def norm(name: str) -> tuple[np.ndarray, np.ndarray]:
            return weights.vector(name + ".weight", d), weights.vector(name + ".bias", d)

        self.blocks = []
        for i in range(shape.layers):
            b = f"v.blk.{i}."
            self.blocks.append(
                _Block(
                    ln1=norm(b + "ln1"),
                    qkv=weights.matrix(b + "attn_qkv.weight", 3 * d, d),
                    qkv_b=weights.vector(b + "attn_qkv.bias", 3 * d),
                    proj=weights.matrix(b + "attn_out.weight", d, d),
                    proj_b=weights.vector(b + "attn_out.bias", d),
                    ln2=norm(b + "ln2"),
                    fc1=weights.matrix(b + "ffn_up.weight", ff, d),
                    fc1_b=weights.vector(b + "ffn_up.bias", ff),
                    fc2=weights.matrix(b + "ffn_down.weight", d, ff),
                    fc2_b=weights.vector(b + "ffn_down.bias", d),
                )
            )
        wide = self._load_merger(weights, norm)
        self.deepstack = []  # per deepstack merger: (norm over the wide row, fc1, fc1 bias, fc2, fc2 bias)
        for block in shape.deepstack:
            b = f"v.deepstack.{block}."
            self.deepstack.append((
                (weights.vector(b + "norm.weight", wide), weights.vector(b + "norm.bias", wide)),
                weights.matrix(b + "fc1.weight", wide, wide), weights.vector(b + "fc1.bias", wide),
                weights.matrix(b + "fc2.weight", shape.text_hidden, wide),
                weights.vector(b + "fc2.bias", shape.text_hidden),
            ))

    def _setup(self, shape: Qwen35VisionShape, weights, source: Path) -> None:
        """What the Qwen towers share: the shape, the patch kernel (summed over its frames: the same image in
        each), the 2D rotary frequencies."""
        self.shape = shape
        self.source = source
        self.text_hidden = shape.text_hidden
        self.depth = shape.layers
        d, p, t = shape.hidden, shape.patch, shape.temporal
        conv = weights.floats_any("v.patch_embd.weight", (d, 3, t, p, p), (d, 3, p, p))
        if conv.ndim == 5:
            conv = conv.sum(axis=2)  # the same image in every frame
        else:  # an mmproj keeps the frames' kernels apart: .weight, .weight.1
            for i in range(1, t):
                conv = conv + weights.floats(f"v.patch_embd.weight.{i}", (d, 3, p, p))
        self.patch_w = conv.reshape(d, 3 * p * p).T.copy()
        quarter = shape.head_dim // 2  # frequencies per axis: half of the head's pairs
        self.inv_freq = 1.0 / shape.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float64) / quarter)
        self._grids: dict[str, tuple[int, int]] = {}  # image digest -> merged (rows, columns)

    def _load_merger(self, weights, norm) -> int:
        """The patch merger (llama.cpp's v.post_ln, mm.0, mm.2): its norm over a patch, then a two-layer MLP
        over the merge x merge patches' concatenation (wide) into the language model's rows. Returns wide."""
        shape = self.shape
        wide = shape.hidden * shape.merge * shape.merge
        self.merge_ln = norm("v.post_ln")
        self.merge_fc1 = weights.matrix("mm.0.weight", wide, wide)
        self.merge_fc1_b = weights.vector("mm.0.bias", wide)
        self.merge_fc2 = weights.matrix("mm.2.weight", shape.text_hidden, wide)
        self.merge_fc2_b = weights.vector("mm.2.bias", shape.text_hidden)
        return wide

    def attach(self, model) -> None:
        """As VisionTower.attach, with a table that knows each image's grid, and M-RoPE's sections (the
        frequency masks of t, h, w) on the model. Every check runs before the model is touched, so a tower
        that does not fit leaves it text-only.

        Raises:
            ModelFormatError: the tower does not fit the model (its sections, or its deepstack sets against
                the model's layers and n_deepstack_layers).
        """
        pairs = model.cfg.rotary_dim // 2
        if sum(self.shape.mrope_section) != pairs:
            raise ModelFormatError(
                self.source, f"mrope_section {list(self.shape.mrope_section)} does not cover the {pairs} "
                "rotary pairs of the language model's heads"
            )
        if len(self.shape.deepstack) > model.cfg.num_hidden_layers:
            raise ModelFormatError(
                self.source, f"{len(self.shape.deepstack)} deepstack mergers for a language model of "
                f"{model.cfg.num_hidden_layers} layers"
            )
        expected = getattr(model.cfg, "deepstack_layers", 0)
        if len(self.shape.deepstack) != expected:
            raise ModelFormatError(
                self.source, f"the vision tower gives {len(self.shape.deepstack)} deepstack sets but the "
                f"language model takes {expected} (n_deepstack_layers); use the mmproj published with this "
                "model"
            )
        super().attach(model)
        self.images = Qwen35ImageTable(model.cfg.vocab_size, model.cfg.hidden_size, len(self.shape.deepstack))
        model.images = self.images
        model.mrope = mrope_masks(self.shape.mrope_section, pairs, self.shape.mrope_interleaved)

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to (transformers' smart_resize)."""
        shape, f = self.shape, self.shape.cell
        if max(height, width) / min(height, width) > 200:
            raise ImageInputError(
                f"the image is {width}x{height} pixels; its sides may differ 200-fold at most: crop it"
            )
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > shape.max_pixels:
            beta = math.sqrt(height * width / shape.max_pixels)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < shape.min_pixels:
            beta = math.sqrt(shape.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def steps(self, pixels: np.ndarray):
        """encode as a generator that yields the blocks done after each; returns the merged rows (with
        Qwen3-VL's deepstack sets after them, each row [merged | set 0 | ...])."""
        shape = self.shape
        m, d = shape.merge, shape.hidden
        x, rows, cols = self._patches(pixels)
        n = len(x)
        x += self._positions(rows, cols, pixels.shape[1] // shape.patch, pixels.shape[2] // shape.patch)
        cos, sin = self._rotary(rows, cols)
        h = np.empty_like(x)
        stacked = []  # deepstack sets in block order (the language model's layer order)
        for i, block in enumerate(self.blocks):
            with ops.batch_phase(n):
                layernorm(h, x, *block.ln1, shape.eps)
                x += linear(block.proj, self._attention(block, h, cos, sin), block.proj_b)
                layernorm(h, x, *block.ln2, shape.eps)
                x += linear(block.fc2, gelu_tanh(linear(block.fc1, h, block.fc1_b)), block.fc2_b)
                if i in shape.deepstack:
                    norm, fc1, fc1_b, fc2, fc2_b = self.deepstack[shape.deepstack.index(i)]
                    wide = np.empty((n // (m * m), d * m * m), np.float32)
                    layernorm(wide, np.ascontiguousarray(x.reshape(wide.shape)), *norm, shape.eps)
                    stacked.append(self._project(wide, fc1, fc1_b, fc2, fc2_b))
            yield i + 1
        layernorm(h, x, *self.merge_ln, shape.eps)
        rows = self._merge(h)
        return np.concatenate([rows, *stacked], axis=1) if stacked else rows

    def _patches(self, pixels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(n, hidden) patch embeddings of an image in merge order (each merge x merge square's patches one
        after another, squares row by row), and each patch's row and column in the patch grid."""
        p, m = self.shape.patch, self.shape.merge
        gh, gw = pixels.shape[1] // p, pixels.shape[2] // p
        n = gh * gw
        # (C, gh/m, m, p, gw/m, m, p) -> merge order: square row, square column, row in it, column in it
        patches = pixels.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        x = patches.reshape(n, 3 * p * p) @ self.patch_w
        if self.patch_b is not None:
            x += self.patch_b
        sq_r, sq_c, in_r, in_c = np.unravel_index(np.arange(n), (gh // m, gw // m, m, m))
        return np.ascontiguousarray(x, np.float32), sq_r * m + in_r, sq_c * m + in_c

    def _rotary(self, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (n, head_dim / 2) of the 2D rotary angles: the first half turns by the patch's row, the
        second by its column."""
        angles = np.concatenate([np.outer(rows, self.inv_freq), np.outer(cols, self.inv_freq)], axis=1)
        return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)

    def _merge(self, h: np.ndarray) -> np.ndarray:
        """The merger's rows (n / merge^2, text_hidden) of the normed patches h (n, hidden) in merge order:
        each square's patches concatenated, then linear -> exact GELU -> linear."""
        m, d = self.shape.merge, self.shape.hidden
        wide = np.ascontiguousarray(h.reshape(len(h) // (m * m), d * m * m))
        return self._project(wide, self.merge_fc1, self.merge_fc1_b, self.merge_fc2, self.merge_fc2_b)

    @staticmethod
    def _project(wide: np.ndarray, fc1, fc1_b, fc2, fc2_b) -> np.ndarray:
        """A merger's linear -> exact GELU -> linear over normed squares (rows, d * m * m) -> (rows, text)."""
        y = linear(fc1, wide, fc1_b)
        gelu_erf_fast(y)
        return linear(fc2, y, fc2_b)

    def _positions(self, rows: np.ndarray, cols: np.ndarray, gh: int, gw: int) -> np.ndarray:
        """(n, hidden) learned position embeddings resampled bilinearly (corners aligned) to gh x gw."""
        side = self.side

        def taps(index: np.ndarray, size: int):
            src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
            lo = np.floor(src)
            frac = (src - lo).astype(np.float32)
            lo = lo.astype(np.int64)
            return lo, np.minimum(lo + 1, side - 1), np.float32(1) - frac, frac

        r0, r1, wr0, wr1 = taps(rows, gh)
        c0, c1, wc0, wc1 = taps(cols, gw)
        table = self.pos_embed
        out = table[r0 * side + c0] * (wr0 * wc0)[:, None]
        out += table[r0 * side + c1] * (wr0 * wc1)[:, None]
        out += table[r1 * side + c0] * (wr1 * wc0)[:, None]
        out += table[r1 * side + c1] * (wr1 * wc1)[:, None]
        return out

    def _attention(self, block: _Block, h: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        shape = self.shape
        n, heads, hd = len(h), shape.heads, shape.head_dim
        qkv = linear(block.qkv, h, block.qkv_b).reshape(n, 3, heads, hd).transpose(1, 2, 0, 3)
        q, k = rotate_half(qkv[0], cos, sin), rotate_half(qkv[1], cos, sin)
        return attend_all(q, k, np.ascontiguousarray(qkv[2]))

    def _remember(self, digest: str, pixels: np.ndarray) -> None:
        grid = (pixels.shape[1] // self.shape.cell, pixels.shape[2] // self.shape.cell)
        self._grids[digest] = grid
        self.images.grids[self.images.slot_of(digest)] = grid

    def encode_prompt(self, tokenizer, text: str, images) -> list[int]:
        """Token ids of a rendered prompt whose template wrote <|image_pad|> once per image.

        Raises:
            ImageInputError: the template placed another number of images, or an image is unreadable.
        """
        self.check_placed(text, IMAGE_PAD, images)
        pieces = text.split(IMAGE_PAD)
        pad = single_token(tokenizer, IMAGE_PAD)
        if pad is None:
            raise ImageInputError(f"the tokenizer has no {IMAGE_PAD} token")
        rows = []
        for i, data in enumerate(images):
            ids = self.image_ids(data)
            pieces[i] += IMAGE_PAD * len(ids)
            rows += ids
        out, n = [], 0
        for t in tokenizer.encode("".join(pieces), add_special=False):
            if t == pad:
                t, n = rows[n], n + 1
            out.append(t)
        if n != len(rows):
            raise ImageInputError(f"the prompt holds {n} image positions for {len(rows)} image rows")
        return out


def mrope_masks(section: Sequence[int], pairs: int, interleaved: bool = True) -> np.ndarray:
    """(3, pairs) float32: 1 where rotary pair j turns by the t, h or w position.

    Interleaved sections (Qwen3.5, Qwen3-VL; llama.cpp's IMROPE): pair j by h when j % 3 == 1 and
    j < 3 h-pairs, by w when j % 3 == 2 and j < 3 w-pairs, else by t. Sections in a row (Qwen2-VL, Qwen2.5-VL;
    llama.cpp's MROPE): the first section[0] pairs by t, the next section[1] by h, the rest by w."""
    axis = np.zeros(pairs, np.int64)
    j = np.arange(pairs)
    if interleaved:
        axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    else:
        axis[j >= section[0]] = 1
        axis[j >= section[0] + section[1]] = 2
    return (axis[None, :] == np.arange(3)[:, None]).astype(np.float32)


