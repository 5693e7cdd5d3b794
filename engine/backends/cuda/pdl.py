"""Programmatic dependent launches (Hopper and later): a kernel launched with the
PROGRAMMATIC_STREAM_SERIALIZATION attribute may start while the kernel before it in the stream is still
running, once that one's blocks have all executed `griddepcontrol.launch_dependents` (or exited). It runs
what does not depend on its predecessor (matvec_qb prefetches its first weight rows into L2) and then
waits in `griddepcontrol.wait` until the predecessor has finished and its writes are visible. Inside a
captured CUDA graph the launches become programmatic edges, so a decode step's ~80 kernel boundaries
overlap the next kernel's launch and ramp with the previous one's tail.

CuPy's RawKernel has no launch attributes, so `launch` calls the driver's cuLaunchKernelEx through ctypes
with the function handle CuPy loaded (`RawKernel.kernel.ptr`). A kernel launched this way must call
griddepcontrol.wait before it reads anything an earlier kernel writes, and before it writes anything an
earlier kernel reads (step.cu's matvec_qb and ops.cu's attn_decode do, through pdl_wait()).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

from models.errors import HearthError

_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)


class PdlLaunchError(HearthError):
    """The driver has no cuLaunchKernelEx, or refused a programmatic dependent launch."""


class _AttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic_stream_serialization_allowed", ctypes.c_int)]


class _Attribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class _Config(ctypes.Structure):
    _fields_ = [
        ("grid_x", ctypes.c_uint),
        ("grid_y", ctypes.c_uint),
        ("grid_z", ctypes.c_uint),
        ("block_x", ctypes.c_uint),
        ("block_y", ctypes.c_uint),
        ("block_z", ctypes.c_uint),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_SCALARS = {
    np.dtype(np.int32): ctypes.c_int32,
    np.dtype(np.int64): ctypes.c_int64,
    np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float,
}


def params(args: tuple) -> list:
    """Each kernel argument as the ctypes value the driver copies: arrays (anything with .data.ptr, a
    CuPy array) as their device pointer, numpy scalars as their own C type."""
    out = []
    for a in args:
        if hasattr(a, "data") and hasattr(a.data, "ptr"):
            out.append(ctypes.c_void_p(int(a.data.ptr)))
        elif isinstance(a, np.generic) and a.dtype in _SCALARS:
            out.append(_SCALARS[a.dtype](a.item()))
        else:
            raise TypeError(f"no kernel parameter type for {type(a).__name__} {a!r}: pass a numpy scalar")
    return out


@functools.cache
def _driver():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernelEx
    except (OSError, AttributeError) as e:
        raise PdlLaunchError(f"no cuLaunchKernelEx in the CUDA driver ({e})") from e
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def launch(k, grid: tuple, block: tuple, args: tuple, shared_mem: int, stream_ptr: int) -> None:
    """k (a CuPy RawKernel) over grid x block on the stream stream_ptr, allowed to overlap the kernel
    before it (programmatic stream serialization)."""
    values = params(args)
    pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    attr = _Attribute(id=_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.programmatic_stream_serialization_allowed = 1
    g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    cfg = _Config(*g, *b, int(shared_mem), ctypes.c_void_p(stream_ptr), ctypes.pointer(attr), 1)
    status = _driver()(ctypes.byref(cfg), ctypes.c_void_p(k.kernel.ptr), pointers, None)
    if status != 0:
        raise PdlLaunchError(f"cuLaunchKernelEx returned CUresult {status}")
