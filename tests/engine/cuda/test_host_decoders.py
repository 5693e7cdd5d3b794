"""The CUDA block decoders (dec_<type> in kernels/quant.cu, the code every matvec and dequant kernel
runs) compiled for the host with g++ and checked against the CPU backend's dequantization.

This runs without a GPU: the decoders are plain C++ once a small shim replaces the CUDA intrinsics
(PTX half conversion, uint4, __uint_as_float). It is what catches a wrong block layout in CI.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from engine.backends.cuda import kernels
from engine.quant.encode import dequantize, quantize

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
    lines.append("}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: the host build of the CUDA decoders needs a C++ compiler")
    text = (kernels._DIR / "quant.cu").read_text()
    decoders = text[: text.index("// Activations for a matvec")]
    unpack = text[text.index("__device__ __forceinline__ void unpack8_f16") : text.index("#define FMATVEC")]
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
