"""Our ggml encoders against the executable spec (gguf.quants) and ggml's error levels."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

import engine  # noqa: F401  (Numba cache location)
from engine.quant import dequantize, quantize
from engine.quant.encode import QuantizeError

BYTE_EXACT = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
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


@pytest.mark.parametrize("name", K_QUANTS + ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_our_decoder_matches_spec_decoder(name):
    x = _matrix(cols=256 * 3)
    raw = quantize(name, x)
    ours = dequantize(name, raw, x.shape[1])
    ref = quants.dequantize(raw, T[name]).reshape(x.shape)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)


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
