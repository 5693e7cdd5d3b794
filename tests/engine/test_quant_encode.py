"""Our ggml encoders against the executable spec (gguf.quants) and ggml's error levels."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

import engine  # noqa: F401  (Numba cache location)
from engine.quant import dequantize, quantize
from engine.quant.encode import QuantizeError

BYTE_EXACT = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _matrix(rows=24, cols=512, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.02
    x[1] *= 50  # a row with large values
    x[2, :64] = 0  # all-zero blocks
    x[3] = np.abs(x[3])  # all-positive row (min 0 for the affine types)
    x[4, 5] = 3.0  # an outlier
    return x


@pytest.mark.parametrize("name", BYTE_EXACT)
def test_bytes_equal_gguf_reference(name):
    x = _matrix()
    ours = quantize(name, x)
    ref = quants.quantize(x, T[name]).view(np.uint8).reshape(ours.shape)
    assert np.array_equal(ours, ref)


def _rel_rmse(name: str, x: np.ndarray) -> float:
    raw = quantize(name, x)
    back = quants.dequantize(raw, T[name]).reshape(x.shape)  # the spec's decoder, not ours
    return float(np.sqrt(np.mean((back - x) ** 2) / np.mean(x**2)))


def test_k_quant_errors_ordered_and_at_ggml_levels():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 1024)).astype(np.float32)
    errs = {name: _rel_rmse(name, x) for name in K_QUANTS}
    # ggml's reference quantizers on Gaussian data (relative RMSE): Q2_K ~0.30, Q3_K ~0.15, Q4_K ~0.07,
    # Q5_K ~0.036, Q6_K ~0.018. A broken scale search or bit packing lands far from these.
    bounds = {"Q2_K": 0.33, "Q3_K": 0.17, "Q4_K": 0.080, "Q5_K": 0.040, "Q6_K": 0.020}
    for name, bound in bounds.items():
        assert errs[name] < bound, (name, errs[name])
    assert errs["Q2_K"] > errs["Q3_K"] > errs["Q4_K"] > errs["Q5_K"] > errs["Q6_K"]
    # the search beats the plain 32-block formats of similar size
    assert errs["Q4_K"] < _rel_rmse("Q4_0", x)
    assert errs["Q5_K"] < _rel_rmse("Q5_0", x)


@pytest.mark.parametrize("name", K_QUANTS + ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"])
def test_our_decoder_matches_spec_decoder(name):
    x = _matrix(cols=256 * 3)
    raw = quantize(name, x)
    ours = dequantize(name, raw, x.shape[1])
    ref = quants.dequantize(raw, T[name]).reshape(x.shape)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)


def test_mxfp4_bytes_equal_gguf_at_ties_and_every_scale():
    # Weights on the values' midpoints (ties: the smaller magnitude, zero as nibble 0), past the largest
    # value, -0.0 and zero blocks, block maxima from 2^-125 (exponent byte 0) to 2^121: gguf's bytes, and
    # decoding them back (the CPU kernel) within a quarter of each block's maximum of the weights.
    rng = np.random.default_rng(3)
    steps = np.array([0, 0.5, 1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 10, 12, 14, 15.5])
    x = rng.choice(steps, (64, 8, 32)) * rng.choice([-1.0, 1.0], (64, 8, 32))
    x[:, :, 0] = 15.5  # every block's maximum: exponent floor(log2(15.5)) + 125 at scale 1
    x *= 2.0 ** (np.arange(512) % 245 - 128).reshape(64, 8, 1)  # exponent bytes 0 .. 244, each
    x[0, :2] = 0.0
    x[1, 0] = -0.0
    x = x.reshape(64, 256).astype(np.float32)
    ours = quantize("MXFP4", x)
    assert np.array_equal(ours, quants.quantize(x, T.MXFP4))
    assert set(ours[:, ::17].ravel()) == set(range(245))
    back = dequantize("MXFP4", ours, 256)
    err = np.abs(back - x).reshape(64, 8, 32).max(axis=2)
    assert np.all(err <= np.abs(x).reshape(64, 8, 32).max(axis=2) / 4)


def test_mxfp4_round_trips():
    # Our blocks re-encode to the same bytes (a block's largest code is always +-8 or +-12). Any file's
    # blocks (random bytes, every finite exponent, the denormal ones too) re-encode to the same values
    # (a block whose codes stay below 8 gets a smaller exponent and codes 2, 4 or 8 times larger): a convert
    # that decodes gpt-oss's MXFP4 experts and writes MXFP4 again loses nothing.
    x = _matrix(cols=320)
    raw = quantize("MXFP4", x)
    assert np.array_equal(quantize("MXFP4", dequantize("MXFP4", raw, 320)), raw)
    rng = np.random.default_rng(4)
    blocks = rng.integers(0, 256, (253 * 4, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(253 * 4) % 253
    blocks[1::3, 1:] &= 0xDD  # nibbles of 0, +-1, +-4, +-6 only
    blocks[2::3, 1:] &= 0xBB  # 0 .. +-3 only
    values = quants.dequantize(blocks.reshape(253, 4 * 17), T.MXFP4)
    again = quants.dequantize(quantize("MXFP4", values), T.MXFP4)
    np.testing.assert_array_equal(again.view(np.uint32), values.view(np.uint32))


def test_zero_and_constant_blocks():
    x = np.zeros((2, 256), np.float32)
    x[1] = 0.5
    for name in K_QUANTS + ["Q4_0", "Q8_0"]:
        back = dequantize(name, quantize(name, x), 256)
        assert np.all(np.isfinite(back))
        np.testing.assert_allclose(back[0], 0.0)
        np.testing.assert_allclose(back[1], 0.5, rtol=0.1)


def test_bad_inputs_raise_typed_errors():
    with pytest.raises(QuantizeError, match="multiple of 256"):
        quantize("Q4_K", np.zeros((2, 576), np.float32))
    with pytest.raises(QuantizeError, match="multiple of 32"):
        quantize("Q4_0", np.zeros((2, 40), np.float32))
    x = np.zeros((1, 32), np.float32)
    x[0, 3] = np.nan
    with pytest.raises(QuantizeError, match="NaN"):
        quantize("Q8_0", x)
    with pytest.raises(QuantizeError, match="unknown ggml type"):
        quantize("Q9_9", np.zeros((1, 32), np.float32))
    with pytest.raises(QuantizeError, match="cannot encode"):
        quantize("IQ2_XXS", np.zeros((1, 256), np.float32))
