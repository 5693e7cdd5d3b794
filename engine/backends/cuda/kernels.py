"""The CUDA C sources of the CUDA backend, their PTX check and their compiled module.

Sources live in engine/backends/cuda/kernels/*.cu (common.cuh is prepended to each, so they need no
CUDA headers). `compile_ptx` compiles with NVRTC alone (no driver, no GPU: what CI checks);
`compile_cubin` also runs ptxas, which checks the inline PTX; `module()` builds a cupy.RawModule once
per process and device, on first use (for that device's architecture: __CUDA_ARCH__ picks the
hardware FP8 conversion on sm_89+).
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

_DIR = Path(__file__).with_name("kernels")
SOURCES = ("quant.cu", "ops.cu", "recurrent.cu", "flash.cu", "step.cu")  # step.cu uses quant.cu's decoders
NVRTC_OPTIONS = ("--std=c++17", "-default-device")


def source(name: str) -> str:
    """Full text of one kernel source, with the shared helpers in front."""
    return (_DIR / "common.cuh").read_text() + "\n" + (_DIR / name).read_text()


def full_source() -> str:
    """All kernels as one translation unit (what the RawModule compiles)."""
    common = (_DIR / "common.cuh").read_text()
    return "\n".join([common] + [(_DIR / n).read_text() for n in SOURCES])


def _add_pip_nvrtc_path() -> None:
    """Make the pip wheel nvidia-cuda-nvrtc-cu12's libnvrtc findable (cupy looks it up by name)."""
    try:
        import nvidia.cuda_nvrtc as pkg  # namespace package of the wheel
    except ImportError:
        return
    for root in getattr(pkg, "__path__", []):
        lib = Path(root) / "lib"
        if lib.is_dir():
            current = os.environ.get("LD_LIBRARY_PATH", "")
            if str(lib) not in current.split(os.pathsep):
                os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(lib), current) if p)
            if sys.platform.startswith("linux"):
                import ctypes

                for so in sorted(lib.glob("libnvrtc.so*")):
                    try:
                        ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)
                        return
                    except OSError:
                        continue


def compile_ptx(code: str, name: str = "kernels.cu", arch: str = "compute_90") -> str:
    """Compile CUDA C to PTX with NVRTC; needs no driver or GPU.

    Raises:
        ImportError: CuPy or NVRTC cannot be loaded.
        RuntimeError: the source does not compile (the message carries NVRTC's log).
    """
    ptx = _compile(code, name, arch, "getPTX")
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def compile_cubin(code: str, name: str = "kernels.cu", arch: str = "sm_90") -> bytes:
    """Compile CUDA C to a CUBIN for a real architecture: NVRTC runs ptxas too, so inline PTX is
    checked as well (compile_ptx passes asm text through). Needs no driver or GPU.

    Raises: as compile_ptx.
    """
    return bytes(_compile(code, name, arch, "getCUBIN"))


def _compile(code: str, name: str, arch: str, result: str):
    _add_pip_nvrtc_path()
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(code, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", *NVRTC_OPTIONS])
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"{name} does not compile: {e}\n{nvrtc.getProgramLog(prog)}") from e
        return getattr(nvrtc, result)(prog)
    finally:
        nvrtc.destroyProgram(prog)


@functools.cache
def module(device_id: int = 0):
    """The compiled cupy.RawModule of every kernel, for the current device (compiled once, cached)."""
    _add_pip_nvrtc_path()
    import cupy

    with cupy.cuda.Device(device_id):
        return cupy.RawModule(code=full_source(), options=NVRTC_OPTIONS, name_expressions=None)


@functools.cache
def kernel(name: str, device_id: int = 0):
    """One kernel of the module by its extern "C" name."""
    return module(device_id).get_function(name)
