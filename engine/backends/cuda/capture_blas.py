"""cuBLAS calls CuPy refuses while a stream is being captured into a CUDA graph.

CuPy's cuBLAS wrappers raise NotImplementedError ("calling cuBLAS API during stream capture is
currently unsupported", CuPy 13 and 14, seen on the H200), although cuBLAS itself can be captured.
A captured prefill (decoder._capture_prefill) therefore calls the libcublas that CuPy loaded through
ctypes, on CuPy's handle, with the capturing stream set on it first. `api()` offers the four calls
ops.gemm_nt and ops.gemm_batched make, under CuPy's names and argument order.
"""

from __future__ import annotations

import ctypes
import functools

from models.errors import HearthError

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong

_SIGNATURES = {
    "cublasSetStream_v2": (_P, _P),
    "cublasSetPointerMode_v2": (_P, _I),
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute, algo
    "cublasGemmEx": (_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I),
    # handle, transa, transb, m, n, k, alpha, A, lda, strideA, B, ldb, strideB, beta, C, ldc, strideC, batch
    "cublasSgemmStridedBatched": (_P, _I, _I, _I, _I, _I, _P, _P, _I, _L, _P, _I, _L, _P, _P, _I, _L, _I),
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA, B, Btype, ldb, strideB, beta,
    # C, Ctype, ldc, strideC, batch, compute, algo
    "cublasGemmStridedBatchedEx": (
        _P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _L, _P, _I, _I, _L, _P, _P, _I, _I, _L, _I, _I, _I
    ),
}


class CaptureBlasError(HearthError):
    """libcublas could not be reached through ctypes, or a call returned an error status."""


def _loaded_libcublas() -> str:
    """Path of the libcublas this process mapped (CuPy's; its soname changes with the CUDA major)."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            path = line.rstrip("\n").rsplit(" ", 1)[-1]  # the mapped file, when there is one
            if path.rsplit("/", 1)[-1].startswith("libcublas.so"):
                return path
    raise CaptureBlasError("no libcublas is loaded in this process (CuPy loads it on its first cuBLAS call)")


class _Api:
    def __init__(self, lib, stream_ptr):
        self._lib, self._stream_ptr = lib, stream_ptr

    def _call(self, name: str, *args) -> None:
        status = getattr(self._lib, name)(*args)
        if status != 0:
            raise CaptureBlasError(f"{name} returned cuBLAS status {status}")

    def setPointerMode(self, handle, mode):  # noqa: N802 - CuPy's names
        self._call("cublasSetPointerMode_v2", handle, mode)

    def gemmEx(self, handle, *args):  # noqa: N802
        self._call("cublasSetStream_v2", handle, self._stream_ptr())
        self._call("cublasGemmEx", handle, *args)

    def sgemmStridedBatched(self, handle, *args):  # noqa: N802
        self._call("cublasSetStream_v2", handle, self._stream_ptr())
        self._call("cublasSgemmStridedBatched", handle, *args)

    def gemmStridedBatchedEx(self, handle, *args):  # noqa: N802
        self._call("cublasSetStream_v2", handle, self._stream_ptr())
        self._call("cublasGemmStridedBatchedEx", handle, *args)


@functools.cache
def _lib():
    lib = ctypes.CDLL(_loaded_libcublas())
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def api(stream_ptr) -> _Api:
    """The calls, on the stream whose pointer stream_ptr() gives at each call."""
    return _Api(_lib(), stream_ptr)
