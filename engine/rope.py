"""Rotary-embedding frequencies, including the scaling schemes models ship with."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RopeScaling:
    """How a model stretches RoPE beyond its training context.

    kind: "none", "linear" (positions divided by factor), "llama3" (long wavelengths divided by
    factor, short ones kept, a smooth ramp in between, as Llama 3.1 does) or "yarn" (YaRN, as Qwen's
    long-context configs and DeepSeek use it: frequencies that turn fewer than beta_slow times over the
    original context are interpolated (divided by factor), those turning more than beta_fast times kept,
    a linear ramp in between over the frequency index; and the attention logits multiplied by
    rope_attention_factor(...) ** 2, since cos and sin carry that factor each).
    """

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # YaRN: None = 0.1 ln(factor) + 1 (or the mscale ratio below)
    mscale: float = 0.0  # YaRN, DeepSeek style: both set -> attention factor mscale(m) / mscale(m_all)
    mscale_all_dim: float = 0.0
    truncate: bool = True  # YaRN: round the ramp's ends to whole dimensions
    # LongRoPE (Phi-3.5, Phi-4-mini): per-frequency divisors for contexts up to original_max_position
    # (short) and beyond (long); cos and sin scaled by attention_factor (None: sqrt(1 + ln f / ln orig))
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


def _yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude scale for a context `factor` times the original: 0.1 m ln(factor) + 1 (1 when
    factor <= 1); DeepSeek squares it with m = mscale_all_dim into the softmax scale."""
    return _yarn_mscale(factor, m)


def rope_attention_factor(scaling: RopeScaling) -> float:
    """What a scaling scheme multiplies cos and sin by (so q.k by its square): YaRN's and LongRoPE's;
    1 otherwise."""
    if scaling.kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.kind == "longrope":
        f = scaling.factor
        return 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(scaling.original_max_position))
    if scaling.mscale and scaling.mscale_all_dim:
        f = scaling.factor
        return _yarn_mscale(f, scaling.mscale) / _yarn_mscale(f, scaling.mscale_all_dim)
    return _yarn_mscale(scaling.factor)


def rope_inv_freq(
    n_rot: int,
    base: float,
    scaling: RopeScaling = RopeScaling(),
    freq_factors: np.ndarray | None = None,
    n_ctx: int = 0,
) -> np.ndarray:
    """Inverse frequencies (n_rot//2,) float32 for positions * inv_freq angles.

    Args:
        n_rot: rotated dims per head (even).
        base: rope theta.
        scaling: the model's scaling scheme.
        freq_factors: per-frequency divisors stored in the file (GGUF `rope_freqs.weight`, how
            llama.cpp bakes Llama 3 scaling into a model); applied after `scaling`.
        n_ctx: the context the frequencies serve (LongRoPE: its long factors past the original context,
            as llama.cpp chooses them, for the whole cache).
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
    elif scaling.kind == "yarn":
        inv = _yarn_inv_freq(inv, n_rot, base, scaling)
    elif scaling.kind == "longrope":
        factors = scaling.long_factor if n_ctx > scaling.original_max_position else scaling.short_factor
        if len(factors) != n_rot // 2:
            raise ValueError(f"LongRoPE needs {n_rot // 2} factors, got {len(factors)}")
        inv = inv / np.asarray(factors, dtype=np.float64)
    elif scaling.kind not in ("none", ""):
        raise ValueError(f"unsupported RoPE scaling {scaling.kind!r}")
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, dtype=np.float64)
    return inv.astype(np.float32)


def _yarn_inv_freq(inv: np.ndarray, n_rot: int, base: float, scaling: RopeScaling) -> np.ndarray:
    # the frequency index where a frequency turns `rotations` times over the original context
    def index(rotations: float) -> float:
        turns = scaling.original_max_position / (rotations * 2 * math.pi)
        return n_rot * math.log(turns) / (2 * math.log(base))

    low, high = index(scaling.beta_fast), index(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, n_rot - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(n_rot // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    keep = 1.0 - ramp  # 1: extrapolate (the frequency as trained), 0: interpolate (divided by factor)
    return inv / scaling.factor * (1.0 - keep) + inv * keep


def rope_scaling_from_gguf(metadata: dict, arch: str) -> RopeScaling:
    """The scaling a GGUF's `{arch}.rope.scaling.*` keys describe (llama.cpp's names; YaRN's attention
    factor as llama.cpp computes it when the file gives none)."""

    def key(name, default):
        return metadata.get(f"{arch}.rope.scaling.{name}", default)

    attn = key("attn_factor", None)
    return RopeScaling(
        kind=str(key("type", "none")),
        factor=float(key("factor", 1.0)),
        original_max_position=int(key("original_context_length", 8192)),
        beta_fast=float(key("yarn_beta_fast", 32.0)),
        beta_slow=float(key("yarn_beta_slow", 1.0)),
        attention_factor=None if attn is None else float(attn),
    )
