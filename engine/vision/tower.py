"""What every vision tower shares: reading an image file, the table its rows go to, and encoding step by step.

A family (engine.vision.gemma3, engine.vision.pixtral) gives `pixels(data)` (the image as its encoder takes
it) and `steps(pixels)` (a generator over the encoder's layers that returns the image's rows); this base
keeps them in the language model's ImageTable and reports progress between layers.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np

from engine.errors import ImageInputError, ModelFormatError
from engine.vision.tokens import ImageTable

# decoded images larger than this many pixels are refused (a decompression bomb, not a photo)
MAX_PIXELS = 100_000_000
# CLIP's normalization, which Pixtral's and Qwen's processors use
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def open_rgb(data: bytes, resize=None):
    """An encoded image file as an RGB Pillow image (EXIF orientation applied), resized by
    `resize(width, height) -> (size, resample)` when given.

    Raises:
        ImageInputError: not an image Pillow can read, or an absurdly large one.
    """
    from PIL import Image, ImageOps

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                if img.width * img.height > MAX_PIXELS:
                    raise ImageInputError(
                        f"the image is {img.width}x{img.height} pixels; the most Hearth reads is "
                        f"{MAX_PIXELS:,} pixels: scale it down"
                    )
                img = ImageOps.exif_transpose(img).convert("RGB")
                if resize is not None:
                    size, resample = resize(img.width, img.height)
                    img = img.resize(size, resample)
                return img
    except ImageInputError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageInputError(
            f"the image could not be read ({e}); send a PNG, JPEG, WebP, GIF or BMP file"
        ) from e


def normalized(img, mean, std) -> np.ndarray:
    """(3, H, W) float32: the image scaled to [0, 1], minus mean, over std (per channel)."""
    x = np.asarray(img, dtype=np.float32) * np.float32(1 / 255)
    x = (x - np.array(mean, np.float32)) / np.array(std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)


# queries per block of the encoders' score matrices (a block's scores: QUERY_BLOCK x patches float32)
QUERY_BLOCK = 1024


def linear(w, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x @ W.T (+ bias) for an encoder's n patch rows, W in its stored type (the CPU backend's linear)."""
    from engine.backends import cpu as ops

    out = np.empty((len(x), w.rows), np.float32)
    ops.linear(out, w, np.ascontiguousarray(x))
    if bias is not None:
        out += bias
    return out


def attend_all(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Attention of every patch over every patch of one image, per head: q, k, v (heads, n, head_dim) ->
    (n, heads * head_dim), scores scaled by head_dim^-0.5, in blocks of QUERY_BLOCK queries."""
    from engine.backends.cpu.ops import softmax_fast

    heads, n, hd = q.shape
    scale = np.float32(hd**-0.5)
    out = np.empty((n, heads, hd), np.float32)
    for head in range(heads):
        queries = np.ascontiguousarray(q[head])
        keys, values = np.ascontiguousarray(k[head]), np.ascontiguousarray(v[head])
        for a in range(0, n, QUERY_BLOCK):
            scores = queries[a : a + QUERY_BLOCK] @ keys.T
            softmax_fast(scores, scale)
            out[a : a + QUERY_BLOCK, head] = scores @ values
    return out.reshape(n, heads * hd)


def rotate_half(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x (heads, n, head_dim) by per-patch angles (n, head_dim / 2)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.ascontiguousarray(np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1))


def layernorm(out: np.ndarray, x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> None:
    """out = LayerNorm(x) * w + b over each row."""
    centered = x - x.mean(axis=1, keepdims=True)
    var = np.mean(centered * centered, axis=1, keepdims=True)
    np.multiply(centered, 1.0 / np.sqrt(var + np.float32(eps)), out=out)
    out *= w
    out += b


def rmsnorm(out: np.ndarray, x: np.ndarray, w: np.ndarray | None, eps: float) -> None:
    """out = x / rms(x) (times w when given) over the last axis."""
    rms = np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps))
    np.divide(x, rms, out=out)
    if w is not None:
        out *= w


def _rows(x: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 array as a 2-D view of its rows (the CPU kernels' in-place shape)."""
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError("an activation works in place on a C-contiguous float32 array")
    return x.reshape(-1, x.shape[-1])


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU with the tanh approximation (PyTorch's gelu(approximate='tanh')), in place."""
    from engine.backends.cpu.ops import gelu_tanh_fast

    gelu_tanh_fast(_rows(x))
    return x


def gelu_quick(x: np.ndarray) -> np.ndarray:
    """GELU's sigmoid approximation x * sigmoid(1.702 x) (transformers' quick_gelu), in place."""
    from engine.backends.cpu.ops import gelu_quick_fast

    gelu_quick_fast(_rows(x))
    return x


def single_token(tokenizer, text: str) -> int | None:
    """The id of a special token's text, None when the vocabulary has no such token."""
    ids = tokenizer.encode(text, add_special=False)
    return ids[0] if len(ids) == 1 else None


def finish(steps):
    """Run a step generator to its end; its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class VisionTower:
    """Base of the families' towers (see the module's docstring)."""

    source: Path
    text_hidden: int
    depth: int  # steps of the encoder: its layers (progress is reported after each)
    bidirectional: bool  # an image's rows attend to each other both ways (engine.vision.tokens)
    images: ImageTable | None = None  # the language model's, set by attach()

    def pixels(self, data: bytes) -> np.ndarray:
        """(3, H, W) float32 input of an encoded image file: resized (bicubic) to the family's
        target_size(height, width), normalized by its shape's mean and std (Gemma's towers override it).

        Raises:
            ImageInputError: not an image Pillow can read, or an absurdly large one.
        """
        from PIL import Image

        img = open_rgb(data, lambda w, h: (self.target_size(h, w)[::-1], Image.Resampling.BICUBIC))
        return normalized(img, self.shape.mean, self.shape.std)

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        raise NotImplementedError

    def steps(self, pixels: np.ndarray):
        raise NotImplementedError

    def attach(self, model) -> None:
        """Let `model` embed this tower's images: ids past its vocabulary, rows of its hidden size."""
        cfg = model.cfg
        if cfg.hidden_size != self.text_hidden:
            raise ModelFormatError(
                self.source,
                f"the vision projector gives rows of {self.text_hidden}, the model's hidden size is "
                f"{cfg.hidden_size}: this mmproj belongs to another model",
            )
        self.images = ImageTable(cfg.vocab_size, cfg.hidden_size, bidirectional=self.bidirectional)
        model.images = self.images

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """(rows, text_hidden) float32 of one image's pixels."""
        return finish(self.steps(pixels))

    def holds(self, data: bytes) -> bool:
        """Whether the image with these bytes is encoded already (its ids cost nothing)."""
        return self.images.slot_of(self.images.digest(data)) is not None

    def read(self, data: bytes):
        """Encode an image into the table unless it is there, as a generator that yields the fraction done
        after each encoder layer (the worker reports it and checks for a cancel between them).

        Raises:
            ImageInputError: not an image Pillow can read.
        """
        digest = self.images.digest(data)
        if self.images.slot_of(digest) is not None:
            return
        pixels = self.pixels(data)
        steps = self.steps(pixels)
        while True:
            try:
                yield next(steps) / self.depth
            except StopIteration as done:
                self.images.add(digest, done.value)
                self._remember(digest, pixels)
                return

    def image_ids(self, data: bytes) -> list[int]:
        """The prompt ids of an image's rows, encoding it unless the table holds it already."""
        for _ in self.read(data):
            pass
        return self.images.ids(self.images.slot_of(self.images.digest(data)))

    def _remember(self, digest: str, pixels: np.ndarray) -> None:
        """What a family keeps of an image beside its rows (Mistral 3: its grid)."""

    def check_placed(self, text: str, marker: str, images) -> None:
        """Raises ImageInputError unless the rendered prompt holds `marker` once per image (and the images
        fit the table: check_count)."""
        self.check_count(images)
        placed = text.count(marker)
        if placed != len(images):
            raise ImageInputError(
                f"the chat template placed {placed} image(s) for the {len(images)} given; this model's "
                "template does not take images in that position (put images in user messages)"
            )

    def check_count(self, images) -> None:
        """Raises ImageInputError when a prompt holds more distinct images than the table keeps."""
        if len(set(images)) > self.images.capacity:
            raise ImageInputError(
                f"the conversation holds {len(set(images))} different images; one prompt can hold "
                f"{self.images.capacity} at most: start a new chat or remove some"
            )
