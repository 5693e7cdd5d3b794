"""CUDA backend on CuPy: the CPU backend's op set as CUDA C kernels (kernels/*.cu), a GPU decoder
for the llama and gemma3 families, and device selection with a CPU fallback.

Importing this package does not import CuPy: `device` (selection) and `kernels.compile_ptx`
(NVRTC only) work on machines without a GPU or driver; `ops` and `decoder` need a GPU.
"""

from engine.backends.cuda.device import (
    CudaMemoryExhaustedError,
    CudaOutOfMemoryError,
    Device,
    DeviceChoice,
    DeviceSpecError,
    choose_device,
    parse_device,
    probe,
)

__all__ = [
    "CudaMemoryExhaustedError",
    "CudaOutOfMemoryError",
    "Device",
    "DeviceChoice",
    "DeviceSpecError",
    "choose_device",
    "parse_device",
    "probe",
]
