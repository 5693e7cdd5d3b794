"""MXFP4 encoder (the type of gpt-oss's expert weights), in numpy: the bytes gguf.quants.quantize writes.

Block (17 bytes, 32 weights): u8 e (E8M0), qs[16] (low nibble: element j, high nibble: element j + 16);
value 2^(e-128) * VALUES[nibble], VALUES the E2M1 numbers doubled (0, 1, 2, 3, 4, 6, 8, 12, then the same
negated at nibbles 8..15).

ggml's reference quantizer: e = floor(log2(amax)) - 2 + 127 (float32 log2, as log2f), and each weight the
value nearest to it at that scale, the first nibble of equal error on ties (gguf's argmin). With a
power-of-two scale the two nearest values' errors are exact in float32, so that is the nearest magnitude
with ties to the smaller one (zero as nibble 0), which thresholds at the midpoints find without the
16-way search.
"""

from __future__ import annotations

import numpy as np

# midpoints between the magnitudes 0, 1, 2, 3, 4, 6, 8, 12: a weight's nibble is how many of them its
# magnitude exceeds (strictly: a tie keeps the smaller magnitude)
_MIDPOINTS = np.array([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0], np.float32)
_CHUNK_BLOCKS = 1 << 15  # blocks encoded at a time: bounds the temporaries to a few MiB


def e8m0_half(e: np.ndarray) -> np.ndarray:
    """float32 2^(e-128) of uint8 E8M0 exponents, exactly (denormals for e < 2), as ggml_e8m0_to_fp32_half."""
    e = e.astype(np.uint32)
    bits = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23))
    return bits.view(np.float32)


def quantize_mxfp4(out: np.ndarray, x: np.ndarray) -> None:
    # x (rows, cols) float32 C-contiguous, finite -> out (rows, cols//32*17) uint8
    blocks = x.reshape(-1, 32)
    dst = out.reshape(-1, 17)
    for b0 in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        _encode(dst[b0 : b0 + _CHUNK_BLOCKS], blocks[b0 : b0 + _CHUNK_BLOCKS])


def _encode(dst: np.ndarray, blocks: np.ndarray) -> None:
    # blocks (n, 32) float32 -> dst (n, 17) uint8
    mag = np.abs(blocks)
    amax = mag.max(axis=1)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) + np.float32(125), np.float32(0))
    # below 2^-125 ggml's exponent would wrap around its byte; 0, the smallest scale, is the nearest
    e = np.clip(e, 0, 255).astype(np.uint8)
    scale = e8m0_half(e)[:, None]
    q = np.zeros(blocks.shape, np.uint8)
    for m in _MIDPOINTS:
        q += mag > scale * m  # exact products: a power of two times a short midpoint
    q |= ((blocks < 0) & (q > 0)).view(np.uint8) << np.uint8(3)
    dst[:, 0] = e
    dst[:, 1:] = q[:, :16] | (q[:, 16:] << np.uint8(4))
