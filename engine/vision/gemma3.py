"""Gemma 3's vision: SigLIP, then 256 rows per image in the language model's input.

As transformers' Gemma3ForConditionalGeneration (and llama.cpp's gemma3 mmproj) run it:
- the image is converted to RGB, resized to image_size x image_size (bilinear, aspect not kept), scaled to
  [0, 1] and normalized by the processor's mean and std (0.5 each);
- SigLIP encodes its (image_size / patch)^2 patches;
- the patch grid is average-pooled in squares of `pool` (64 x 64 -> 16 x 16 on the released models),
  each pooled row RMS-normed (Gemma's norm: times 1 + w, stored so in GGUF) and multiplied by the input
  projection (vision hidden -> text hidden);
- the prompt gets "\\n\\n<start_of_image>" + one token per row + "<end_of_image>\\n\\n" where the chat
  template wrote <start_of_image>; those rows replace the tokens' embeddings (not scaled by sqrt(hidden),
  as text embeddings are), and attend to each other both ways.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import ImageInputError, ModelFormatError
from engine.vision.siglip import SiglipEncoder, SiglipShape
from engine.vision.tokens import ImageTable

BOI, EOI = "<start_of_image>", "<end_of_image>"
# decoded images larger than this many pixels are refused (a decompression bomb, not a photo)
MAX_PIXELS = 100_000_000


@dataclass(frozen=True)
class Gemma3VisionShape:
    encoder: SiglipShape
    text_hidden: int
    pool: int  # the average pool's side, in patches
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    @property
    def tokens(self) -> int:
        return (self.encoder.side // self.pool) ** 2


class Gemma3Vision:
    """Gemma 3's vision tower over a weight source with mmproj names (engine.vision.load)."""

    def __init__(self, shape: Gemma3VisionShape, weights, source: Path):
        self.shape = shape
        self.source = source
        enc = shape.encoder
        if enc.side % shape.pool:
            raise ModelFormatError(source, f"a {enc.side}-patch side does not pool by {shape.pool}")
        self.encoder = SiglipEncoder(enc, weights)
        self.norm = weights.vector("mm.soft_emb_norm.weight", enc.hidden)  # 1 + w
        proj = weights.floats_any("mm.input_projection.weight", (enc.hidden, shape.text_hidden),
                                  (shape.text_hidden, enc.hidden))
        # HF's and llama.cpp's layout is (vision, text), used as x @ W
        self.projection = np.ascontiguousarray(proj if proj.shape[0] == enc.hidden else proj.T)
        self.images: ImageTable | None = None  # the language model's, set by attach()

    def attach(self, model) -> None:
        """Let `model` (a Gemma 3 decoder) embed this tower's images, whose ids start past its vocabulary."""
        cfg = model.cfg
        if cfg.hidden_size != self.shape.text_hidden:
            raise ModelFormatError(
                self.source,
                f"the vision projector gives rows of {self.shape.text_hidden}, the model's hidden size is "
                f"{cfg.hidden_size}: this mmproj belongs to another model",
            )
        self.images = ImageTable(cfg.vocab_size, cfg.hidden_size, bidirectional=True)
        model.images = self.images

    def pixels(self, data: bytes) -> np.ndarray:
        """(3, size, size) float32 input of an encoded image file.

        Raises:
            ImageInputError: not an image Pillow can read, or an absurdly large one.
        """
        from PIL import Image, ImageOps

        size = self.shape.encoder.image_size
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
                    img = img.resize((size, size), Image.Resampling.BILINEAR)
        except ImageInputError:
            raise
        except (OSError, ValueError, Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ImageInputError(
                f"the image could not be read ({e}); send a PNG, JPEG, WebP, GIF or BMP file"
            ) from e
        x = np.asarray(img, dtype=np.float32) * np.float32(1 / 255)
        x = (x - np.array(self.shape.mean, np.float32)) / np.array(self.shape.std, np.float32)
        return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)

    def encode(self, pixels: np.ndarray) -> np.ndarray:
        """(tokens, text_hidden) float32 rows of one image's pixels."""
        return self._project(self.encoder(pixels))

    def holds(self, data: bytes) -> bool:
        """Whether the image with these bytes is encoded already (its ids cost nothing)."""
        return self.images.slot_of(self.images.digest(data)) is not None

    def read(self, data: bytes):
        """Encode an image into the table unless it is there, as a generator that yields the fraction done
        after each encoder layer (the worker reports it and checks for a cancel between them).

        Raises:
            ImageInputError: not an image Pillow can read.
        """
        if self.holds(data):
            return
        n = self.shape.encoder.layers
        steps = self.encoder.steps(self.pixels(data))
        while True:
            try:
                yield next(steps) / n
            except StopIteration as done:
                self.images.add(self.images.digest(data), self._project(done.value))
                return

    def _project(self, x: np.ndarray) -> np.ndarray:
        """Pool, norm and project the encoder's (side * side, hidden) outputs (row-major over the grid)."""
        shape, enc = self.shape, self.shape.encoder
        k, side = shape.pool, enc.side // shape.pool
        pooled = x.reshape(side, k, side, k, enc.hidden).mean(axis=(1, 3)).reshape(side * side, enc.hidden)
        rms = np.sqrt(np.mean(pooled * pooled, axis=1, keepdims=True) + np.float32(enc.eps))
        pooled = pooled / rms
        pooled *= self.norm
        return np.ascontiguousarray(pooled @ self.projection, dtype=np.float32)

    def image_ids(self, data: bytes) -> list[int]:
        """The prompt ids of an encoded image, encoding it unless the table holds it already."""
        table = self.images
        digest = table.digest(data)
        slot = table.slot_of(digest)
        if slot is None:
            slot = table.add(digest, self.encode(self.pixels(data)))
        return table.ids(slot)

    def encode_prompt(self, tokenizer, text: str, images) -> list[int]:
        """Token ids of a rendered prompt whose template wrote <start_of_image> once per image.

        Raises:
            ImageInputError: the template placed another number of images, or an image is unreadable.
        """
        if len(set(images)) > self.images.capacity:
            raise ImageInputError(
                f"the conversation holds {len(set(images))} different images; one prompt can hold "
                f"{self.images.capacity} at most: start a new chat or remove some"
            )
        placed = text.count(BOI)
        if placed != len(images):
            raise ImageInputError(
                f"the chat template placed {placed} image(s) for the {len(images)} given; this model's "
                "template does not take images in that position (put images in user messages)"
            )
        text = text.replace(BOI, f"\n\n{BOI}{EOI}\n\n")
        ids = tokenizer.encode(text, add_special=False)
        boi = _single_token(tokenizer, BOI)
        if boi is None or _single_token(tokenizer, EOI) is None:
            raise ImageInputError("the tokenizer has no <start_of_image> / <end_of_image> tokens")
        out, n = [], 0
        for t in ids:
            out.append(t)
            if t == boi:
                out += self.image_ids(images[n])
                n += 1
        if n != len(images):
            raise ImageInputError(f"the prompt holds {n} image marker(s) for {len(images)} images")
        return out


def pool_of(side: int, tokens: int) -> int:
    """The pool side that turns side x side patches into `tokens` rows."""
    per_side = math.isqrt(tokens)
    if per_side * per_side != tokens or side % per_side:
        raise ValueError(f"{tokens} image tokens do not tile a {side}-patch side")
    return side // per_side


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special=False)
    return ids[0] if len(ids) == 1 else None
