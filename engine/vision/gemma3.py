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

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import ImageInputError, ModelFormatError
from engine.vision.siglip import SiglipEncoder, SiglipShape
from engine.vision.tower import VisionTower, normalized, open_rgb, single_token

BOI, EOI = "<start_of_image>", "<end_of_image>"


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


class Gemma3Vision(VisionTower):
    """Gemma 3's vision tower over a weight source with mmproj names (engine.vision.load)."""

    bidirectional = True

    def __init__(self, shape: Gemma3VisionShape, weights, source: Path):
        self.shape = shape
        self.source = source
        self.text_hidden = shape.text_hidden
        enc = shape.encoder
        self.depth = enc.layers
        if enc.side % shape.pool:
            raise ModelFormatError(source, f"a {enc.side}-patch side does not pool by {shape.pool}")
        self.encoder = SiglipEncoder(enc, weights)
        self.norm = weights.vector("mm.soft_emb_norm.weight", enc.hidden)  # 1 + w
        proj = weights.floats_any("mm.input_projection.weight", (enc.hidden, shape.text_hidden),
                                  (shape.text_hidden, enc.hidden))
        # HF's and llama.cpp's layout is (vision, text), used as x @ W
        self.projection = np.ascontiguousarray(proj if proj.shape[0] == enc.hidden else proj.T)

    def pixels(self, data: bytes) -> np.ndarray:
        """(3, size, size) float32 input of an encoded image file.

        Raises:
            ImageInputError: not an image Pillow can read, or an absurdly large one.
        """
        from PIL import Image

        size = self.shape.encoder.image_size
        img = open_rgb(data, lambda w, h: ((size, size), Image.Resampling.BILINEAR))
        return normalized(img, self.shape.mean, self.shape.std)

    def steps(self, pixels: np.ndarray):
        """The encoder layer by layer (yielding after each), then its outputs pooled, normed and projected
        (the return value: (tokens, text_hidden))."""
        x = yield from self.encoder.steps(pixels)  # (side * side, hidden), row-major over the patch grid
        shape, enc = self.shape, self.shape.encoder
        k, side = shape.pool, enc.side // shape.pool
        pooled = x.reshape(side, k, side, k, enc.hidden).mean(axis=(1, 3)).reshape(side * side, enc.hidden)
        rms = np.sqrt(np.mean(pooled * pooled, axis=1, keepdims=True) + np.float32(enc.eps))
        pooled = pooled / rms
        pooled *= self.norm
        return np.ascontiguousarray(pooled @ self.projection, dtype=np.float32)

    def encode_prompt(self, tokenizer, text: str, images) -> list[int]:
        """Token ids of a rendered prompt whose template wrote <start_of_image> once per image.

        Raises:
            ImageInputError: the template placed another number of images, or an image is unreadable.
        """
        self.check_placed(text, BOI, images)
        text = text.replace(BOI, f"\n\n{BOI}{EOI}\n\n")
        ids = tokenizer.encode(text, add_special=False)
        boi = single_token(tokenizer, BOI)
        if boi is None or single_token(tokenizer, EOI) is None:
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
