"""Put a loaded model on the device a `--device` option asks for (CPU fallback with a notice)."""

from __future__ import annotations

import sys

from engine.backends.cuda.device import Device, DeviceChoice, choose_device


def place_model(
    lm, spec: str | None, n_ctx: int = 4096, notify=None, progress=None, gpu_layers: int | None = None
) -> DeviceChoice:
    """Move lm.model (a LoadedModel's CPU model) to the GPU when spec asks for CUDA and CUDA works.

    Args:
        lm: an engine.loader.LoadedModel; lm.model is replaced by a CudaDecoder (every layer on
            the GPU) or a HybridDecoder (the first gpu_layers layers) on success.
        spec: "cpu", "cuda", "cuda:N" or None (cpu).
        n_ctx: context the VRAM estimate plans for.
        notify: called with the fallback notice (default: print to stderr as `hearth: ...`).
        progress: progress(done_bytes, total_bytes) while weights upload.
        gpu_layers: layers to offload (None or >= the layer count: all; 0: none, the CPU runs it).

    Returns:
        the DeviceChoice made (its notice set when CUDA was asked for and is not usable).

    A model the CUDA kernels do not cover (UnsupportedCudaModelError: a weight type without kernels, a
    mixture-of-experts model, Gemma's soft-capped attention) stays on the CPU, with a notice.

    Raises:
        DeviceSpecError, CudaOutOfMemoryError, ValueError (gpu_layers < 0).
    """
    if gpu_layers is not None and gpu_layers < 0:
        raise ValueError(f"gpu_layers must be >= 0, got {gpu_layers}")
    notify = notify or (lambda text: print(f"hearth: {text}", file=sys.stderr))
    choice = choose_device(spec)
    if choice.notice:
        notify(choice.notice)
    if choice.device.kind != "cuda":
        return choice
    if gpu_layers == 0:  # CUDA works, but no layer is asked to go there
        return DeviceChoice(Device("cpu"))
    from engine.backends.cuda.decoder import CudaDecoder, UnsupportedCudaModelError

    n_all = lm.model.cfg.num_hidden_layers
    try:
        if gpu_layers is None or gpu_layers >= n_all:
            lm.model = CudaDecoder(lm.model, device=choice.device.index, n_ctx=n_ctx, progress=progress)
        else:
            from engine.backends.cuda.hybrid import HybridDecoder

            lm.model = HybridDecoder(
                lm.model, gpu_layers, device=choice.device.index, n_ctx=n_ctx, progress=progress
            )
    except UnsupportedCudaModelError as e:  # a model the kernels do not cover runs where it can
        notice = str(e).removesuffix("; use --device cpu") + "; running on the CPU instead"
        notify(notice)
        return DeviceChoice(Device("cpu"), notice)
    return choice


def upload_progress(done: int, total: int) -> None:
    """A stderr progress line for weight uploads, redrawn in place."""
    end = "\n" if done >= total else ""
    print(f"\ruploading weights: {done * 100 // max(total, 1):3d}%", end=end, file=sys.stderr, flush=True)
