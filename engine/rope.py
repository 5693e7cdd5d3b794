"""Rotary-embedding frequencies, including the scaling schemes models ship with."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RopeScaling:
    """How a model stretches RoPE beyond its training context.

    kind: "none", "linear" (positions divided by factor) or "llama3" (long wavelengths divided by
    factor, short ones kept, a smooth ramp in between, as Llama 3.1 does).
    """

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


def rope_inv_freq(
    n_rot: int, base: float, scaling: RopeScaling = RopeScaling(), freq_factors: np.ndarray | None = None
) -> np.ndarray:
    """Inverse frequencies (n_rot//2,) float32 for positions * inv_freq angles.

    Args:
        n_rot: rotated dims per head (even).
        base: rope theta.
        scaling: the model's scaling scheme.
        freq_factors: per-frequency divisors stored in the file (GGUF `rope_freqs.weight`, how
            llama.cpp bakes Llama 3 scaling into a model); applied after `scaling`.
    """
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if scaling.kind == "linear":
        inv = inv / scaling.factor
    elif scaling.kind == "llama3":
        low_wavelen = scaling.original_max_position / scaling.low_freq_factor
        high_wavelen = scaling.original_max_position / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        mid = (1 - smooth) * inv / scaling.factor + smooth * inv
        inv = np.where(
            wavelen > low_wavelen, inv / scaling.factor, np.where(wavelen < high_wavelen, inv, mid)
        )
    elif scaling.kind not in ("none", ""):
        raise ValueError(f"unsupported RoPE scaling {scaling.kind!r}")
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64)
    return inv.astype(np.float32)
