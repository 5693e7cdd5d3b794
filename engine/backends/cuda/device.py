"""Which device a model runs on: `--device cpu|cuda[:N]`, with a fallback to the CPU.

Nothing here imports CuPy at module import; `probe()` tries it and says why CUDA cannot be used
(CuPy missing, no driver, no GPU, index out of range). `choose_device` turns a request into the
device to use plus the notice to show when a CUDA request falls back to the CPU.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from models.errors import HearthError


class DeviceSpecError(HearthError):
    """A --device value that is neither `cpu`, `cuda` nor `cuda:N`."""


class CudaOutOfMemoryError(HearthError):
    """The model (weights + KV cache + buffers) does not fit the GPU's free memory."""

    def __init__(self, needed: int, free: int, device: int, layers_fit: int | None = None, n_layers: int = 0):
        self.needed, self.free, self.device = int(needed), int(free), int(device)
        self.layers_fit = layers_fit
        partial = (
            f"offload only {layers_fit} of the {n_layers} layers (--gpu-layers {layers_fit}), "
            if layers_fit and layers_fit < n_layers
            else ""
        )
        super().__init__(
            f"the model needs about {needed / 2**30:.2f} GiB on GPU {device} but only "
            f"{free / 2**30:.2f} GiB is free; {partial}use a smaller quantization or context (--ctx), "
            "or run on the CPU (--device cpu)"
        )


class CudaMemoryExhaustedError(HearthError, MemoryError):
    """The GPU ran out of memory while a loaded model ran (a long prompt's buffers, a new KV cache, a
    decode step's buffers): nothing was written to the cache, and the request can be retried smaller.
    A MemoryError too, as CuPy's own error is: the server waits for a running request's cache on one."""

    def __init__(self, what: str, device: int):
        self.what, self.device = what, int(device)
        super().__init__(
            f"GPU {device} ran out of memory {what}; shorten the prompt or the context (--ctx), offload "
            "fewer layers (--gpu-layers), use a smaller quantization, or run on the CPU (--device cpu)"
        )


@dataclass(frozen=True)
class Device:
    """kind "cpu" or "cuda"; index: the CUDA device ordinal (0 for cpu)."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


@dataclass(frozen=True)
class DeviceChoice:
    device: Device
    notice: str | None = None  # set when a CUDA request fell back to the CPU


def parse_device(spec: str | None) -> Device:
    """'cpu', 'cuda', 'cuda:N' (None: cpu) -> Device. Raises DeviceSpecError otherwise."""
    text = (spec or "cpu").strip().lower()
    if text == "cpu":
        return Device("cpu")
    if text == "cuda":
        return Device("cuda", 0)
    if text.startswith("cuda:") and text[5:].isdigit():
        return Device("cuda", int(text[5:]))
    raise DeviceSpecError(f"unknown device {spec!r}: use cpu, cuda or cuda:N (N = GPU index)")


def _import_cupy():
    return importlib.import_module("cupy")


def probe(index: int = 0) -> str | None:
    """None when CUDA device `index` is usable, else the reason it is not (one line)."""
    try:
        cupy = _import_cupy()
    except Exception as e:  # ImportError, or a broken install raising at import
        return f"CuPy is not installed ({type(e).__name__}: {e}); install hearth[cuda]"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # CUDARuntimeError: no driver, insufficient driver, ...
        return f"no usable CUDA driver ({e})"
    if count == 0:
        return "no CUDA GPU found"
    if index >= count:
        return f"GPU {index} does not exist ({count} CUDA device{'s' if count > 1 else ''} found)"
    try:  # the kernels are compiled at load time by NVRTC
        from engine.backends.cuda.kernels import _add_pip_nvrtc_path

        _add_pip_nvrtc_path()
        cupy.cuda.nvrtc.getVersion()
    except Exception as e:  # the library is missing or does not load
        return f"NVRTC, the CUDA compiler, cannot be loaded ({e}); pip install nvidia-cuda-nvrtc-cu12"
    return None


def choose_device(spec: str | None) -> DeviceChoice:
    """The device to run on for a --device value; CUDA falls back to the CPU with a notice.

    Raises:
        DeviceSpecError: spec is not a device name.
    """
    device = parse_device(spec)
    if device.kind == "cpu":
        return DeviceChoice(device)
    reason = probe(device.index)
    if reason is None:
        return DeviceChoice(device)
    return DeviceChoice(Device("cpu"), f"CUDA unavailable: {reason}; running on the CPU")
