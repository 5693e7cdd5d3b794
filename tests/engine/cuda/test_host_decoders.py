"""The CUDA block decoders (dec_<type> in kernels/quant.cu, the code every matvec and dequant kernel
runs) compiled for the host with g++ and checked against the CPU backend's dequantization.

This runs without a GPU: the decoders are plain C++ once a small shim replaces the CUDA intrinsics
(PTX half conversion, uint4, __uint_as_float). It is what catches a wrong block layout in CI. The
FP8 / NVFP4 decoders build here with their portable E4M3 path (bit moves; sm_89+ GPUs convert E4M3 in
hardware instead, which tests/engine/cuda/test_compile.py assembles with ptxas).
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import gguf
import numpy as np
import pytest

from engine.backends.cpu import fpquant
from engine.backends.cuda import kernels
from engine.quant.encode import dequantize, quantize
from engine.quant.fp8 import dequantize_fp8, quantize_fp8
from engine.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

SHIM = r"""
#include <cmath>
#include <cstring>
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
#define __device__
#define __forceinline__ inline
struct uint4 { uint x, y, z, w; };
static inline float __uint_as_float(uint u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float h2f(ushort h) {
    int s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24)
            : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024), e - 25);
    return s ? -v : v;
}
static inline float ldh(const uchar* p) { ushort h; std::memcpy(&h, p, 2); return h2f(h); }
"""

# type name -> (ggml id, elements per block, bytes per block)
QUANT = {
    "q8_0": (8, 32, 34),
    "q4_0": (2, 32, 18),
    "q4_1": (3, 32, 20),
    "q5_0": (6, 32, 22),
    "q5_1": (7, 32, 24),
    "q2_k": (10, 256, 84),
    "q3_k": (11, 256, 110),
    "q4_k": (12, 256, 144),
    "q5_k": (13, 256, 176),
    "q6_k": (14, 256, 210),
    "mxfp4": (39, 32, 17),
}
FLOAT = {"f16": (1, 8, 2), "bf16": (30, 8, 2), "f32": (0, 4, 4)}


def _driver() -> str:
    lines = ['extern "C" {']
    for name, (_, block, nbytes) in QUANT.items():
        subs = block // 32
        lines.append(
            f"void host_{name}(const uchar* raw, long units, float* out) {{"
            f" for (long u = 0; u < units; u++) dec_{name}(raw + (u / {subs}) * {nbytes}, (int)(u % {subs}),"
            f" out + u * 32); }}"
        )
    for name, (_, per, _esize) in FLOAT.items():
        lines.append(
            f"void host_{name}(const uchar* raw, long loads, float* out) {{"
            f" for (long u = 0; u < loads; u++) {{ uint4 p; std::memcpy(&p, raw + u * 16, 16);"
            f" unpack{per}_{name}(p, out + u * {per}); }} }}"
        )
    # FP8 / NVFP4 rows as the dequant kernels write them (row / global scale times the unit)
    lines.append(
        "void host_fp8(const uchar* raw, const float* scale, long rows, long cols, float* out) {"
        " for (long r = 0; r < rows; r++) for (long u = 0; u < cols / 32; u++) {"
        " float* v = out + r * cols + u * 32; dec_fp8(raw + r * cols + u * 32, v);"
        " for (int i = 0; i < 32; i++) v[i] *= scale[r] * E4M3_UNIT; } }"
    )
    lines.append(
        "void host_nvfp4(const uchar* raw, const uchar* sc, float g, long rows, long cols, float* out) {"
        " for (long r = 0; r < rows; r++) for (long u = 0; u < cols / 32; u++) {"
        " float* v = out + r * cols + u * 32;"
        " dec_nvfp4(raw + r * cols / 2 + u * 16, sc + r * cols / 16 + 2 * u, v);"
        " for (int i = 0; i < 32; i++) v[i] *= g * (E2M1_UNIT * E4M3_UNIT); } }"
    )
    lines.append("float host_e4m3_unit() { return E4M3_UNIT; }")
    lines.append("}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: the host build of the CUDA decoders needs a C++ compiler")
    text = (kernels._DIR / "quant.cu").read_text()
    decoders = text[: text.index("// Activations for a matvec")]
    common = (kernels._DIR / "common.cuh").read_text()
    unpack = common[common.index("__device__ __forceinline__ void unpack8_f16") :]
    src = tmp_path_factory.mktemp("host-dec") / "dec.cpp"
    src.write_text(SHIM + decoders + unpack + _driver())
    so = src.with_suffix(".so")
    subprocess.run([gxx, "-O1", "-shared", "-fPIC", "-o", str(so), str(src)], check=True, capture_output=True)
    return ctypes.CDLL(str(so))


def _call(lib, name: str, raw: np.ndarray, count: int, n_out: int) -> np.ndarray:
    out = np.zeros(n_out, np.float32)
    raw = np.ascontiguousarray(raw)
    fn = getattr(lib, f"host_{name}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    fn(raw.ctypes.data, count, out.ctypes.data)
    return out


@pytest.mark.parametrize("name", sorted(QUANT))
def test_quant_decoder_matches_cpu(lib, name):
    ggml, block, nbytes = QUANT[name]
    rng = np.random.default_rng(ggml)
    rows, cols = 3, 512
    w = (rng.standard_normal((rows, cols)) * rng.uniform(0.01, 2.0, (rows, 1))).astype(np.float32)
    raw = quantize(ggml, w)
    assert raw.shape == (rows, cols // block * nbytes)
    ref = dequantize(ggml, raw, cols).reshape(-1)
    got = _call(lib, name, raw, rows * cols // 32, rows * cols)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("name", sorted(FLOAT))
def test_float_unpack_matches_cpu(lib, name):
    ggml, per, esize = FLOAT[name]
    w = np.random.default_rng(ggml).standard_normal((2, 64)).astype(np.float32)
    raw = quantize(ggml, w)
    ref = dequantize(ggml, raw, 64).reshape(-1)
    got = _call(lib, name, raw, raw.size // 16, w.size)
    np.testing.assert_array_equal(got, ref)


def _fp8(lib, codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    rows, cols = codes.shape
    out = np.zeros(codes.size, np.float32)
    fn = lib.host_fp8
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    codes, scale = np.ascontiguousarray(codes), np.ascontiguousarray(scale, np.float32)
    fn(codes.ctypes.data, scale.ctypes.data, rows, cols, out.ctypes.data)
    return out.reshape(rows, cols)


def _nvfp4(lib, packed: np.ndarray, scales: np.ndarray, g: float) -> np.ndarray:
    rows, cols = packed.shape[0], packed.shape[1] * 2
    out = np.zeros(rows * cols, np.float32)
    fn = lib.host_nvfp4
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_long, ctypes.c_long]
    fn.argtypes += [ctypes.c_void_p]
    packed, scales = np.ascontiguousarray(packed), np.ascontiguousarray(scales)
    fn(packed.ctypes.data, scales.ctypes.data, g, rows, cols, out.ctypes.data)
    return out.reshape(rows, cols)


def test_host_build_takes_the_portable_e4m3_path(lib):
    lib.host_e4m3_unit.restype = ctypes.c_float
    assert lib.host_e4m3_unit() == 256.0  # value / 256 from the bit moves, folded into the scales


def test_fp8_decoder_every_code_and_quantized_rows(lib):
    # all 256 codes but the two NaN ones (no weights: the encoder never writes them), one row each
    codes = np.arange(256, dtype=np.uint8)
    codes = np.where(np.isin(codes, (0x7F, 0xFF)), 0x38, codes).reshape(8, 32)
    scale = np.array([1.0, 0.5, 3.0, 2.0**-20, 7.25, 1e3, 1.0, 0.125], np.float32)
    np.testing.assert_array_equal(_fp8(lib, codes, scale), dequantize_fp8(codes, scale))
    np.testing.assert_array_equal(_fp8(lib, codes, np.ones(8, np.float32)), fpquant.E4M3_LUT[codes])
    rng = np.random.default_rng(1001)
    w = (rng.standard_normal((5, 256)) * rng.uniform(0.01, 2.0, (5, 1))).astype(np.float32)
    codes, scale = quantize_fp8(w)
    np.testing.assert_array_equal(_fp8(lib, codes, scale), dequantize_fp8(codes, scale))


def test_nvfp4_decoder_every_code_and_quantized_rows(lib):
    # every E2M1 code in both nibbles, under block scales 1.0 (0x38) and 2**-9 (0x01, subnormal)
    nibbles = np.arange(256, dtype=np.uint8).reshape(8, 32)  # byte b: low nibble b & 15, high b >> 4
    scales = np.tile(np.array([0x38, 0x01, 0x7E, 0x40], np.uint8), (8, 1))
    np.testing.assert_array_equal(_nvfp4(lib, nibbles, scales, 1.0), dequantize_nvfp4(nibbles, scales, 1.0))
    rng = np.random.default_rng(1002)
    w = (rng.standard_normal((5, 256)) * rng.uniform(0.01, 2.0, (5, 1))).astype(np.float32)
    packed, scales, g = quantize_nvfp4(w)
    ref = dequantize_nvfp4(packed, scales, g)
    # the host decoder multiplies the block scale and E2M1 value first (exact), the reference the
    # block and global scale first: one rounding apart
    np.testing.assert_allclose(_nvfp4(lib, packed, scales, float(g)), ref, rtol=2e-7, atol=0)


def test_mxfp4_decoder_every_code_and_extreme_scales(lib):
    """Every byte of codes (both nibbles: all 16 E2M1 values) under every E8M0 exponent: 0 and 1 (the
    denormal scales 2^-128, 2^-127 of ggml_e8m0_to_fp32_half), 254 and 255 (2^126, 2^127: 12 times that
    is inf, as on the CPU), and all-zero blocks: bit for bit the CPU's dequantization (and gguf's)."""
    codes = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (16, 1))  # each byte in 16 blocks
    exps = np.arange(256, dtype=np.uint8)[:, None]  # block i: exponent i
    zero = np.hstack([np.array([[0], [1], [127], [255]], np.uint8), np.zeros((4, 16), np.uint8)])
    raw = np.concatenate([np.hstack([exps, codes]), zero]).reshape(-1, 4 * 17)  # rows of 128 elements
    ref = dequantize(39, raw, 128).reshape(-1)
    with np.errstate(over="ignore"):
        oracle = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4).reshape(-1)
    np.testing.assert_array_equal(ref, oracle)
    assert (ref == 0).any() and (np.abs(ref[ref != 0]) < 2**-126).any() and np.isinf(ref).any()
    np.testing.assert_array_equal(_call(lib, "mxfp4", raw, raw.size // 17, ref.size), ref)
    raw = np.random.default_rng(1003).integers(0, 256, (7, 8 * 17), dtype=np.uint8)  # random exponents
    ref = dequantize(39, raw, 256).reshape(-1)
    np.testing.assert_array_equal(_call(lib, "mxfp4", raw, 7 * 8, ref.size), ref)
