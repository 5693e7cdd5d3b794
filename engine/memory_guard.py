"""Refuse a load that would not fit in RAM, before touching the weights.

Estimate = weights (the file is mapped and every page is read per token, so all of it ends up
resident) + the KV cache for the requested context (float32 or float16 keys and values for every layer)
+ working buffers for a prefill batch + a fixed overhead (interpreter, Numba, tokenizer). It is
compared with what the OS reports as available (free plus reclaimable), keeping a margin for the
rest of the system, so Hearth declines with advice instead of swapping or being OOM-killed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from models.errors import HearthError, ModelFormatError
from models.fit import ENCODER_ARCHS, SHARED_KV_ARCHS, gemma4_kv_widths_gguf

FIXED_OVERHEAD = 300 << 20  # Python, numpy/Numba runtime, tokenizer, chat template
HEADROOM = 0.9  # use at most this share of the available memory
KV_ITEMSIZE = 4  # float32 keys and values (the default; a float16 cache passes kv_itemsize=2)


class InsufficientMemoryError(HearthError):
    """A model with the requested context would not fit in the memory available."""

    def __init__(self, estimate: MemoryEstimate):
        self.estimate = estimate
        mib = 1 << 20
        advice = (
            f"load it with a context of at most {estimate.max_fitting_ctx} tokens"
            if estimate.max_fitting_ctx >= 256
            else "the weights alone do not fit"
        )
        super().__init__(
            f"not enough memory: {estimate.n_ctx} tokens of context need about "
            f"{estimate.total_bytes // mib} MiB (weights {estimate.weights_bytes // mib} MiB, KV cache "
            f"{estimate.kv_bytes // mib} MiB, buffers {estimate.overhead_bytes // mib} MiB) but only "
            f"{estimate.available_bytes // mib} MiB are available; {advice}, pick a smaller quantization, "
            "or close other programs / unload other models"
        )


@dataclass(frozen=True)
class KVShape:
    """What the KV cache size depends on, read from a model's metadata."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    trained_ctx: int
    # LFM2's convolution layers (among n_layers): no keys and values, their inputs (hidden_size) instead
    conv_layers: int = 0
    # Qwen3.5's recurrent layers (among n_layers): nothing per token, a fixed state per sequence instead
    recurrent_layers: int = 0
    state_bytes: int = 0
    # n_kv_heads * head_dim of each layer keeping keys and values, when they differ (Gemma 4: windowed and
    # global layers apart, shared-KV layers keep none); empty: n_kv_heads * head_dim on every attending layer
    kv_widths: tuple[int, ...] = ()
    # arrays per attending layer: keys and values (2), or one row serving as both (1: multi-head latent
    # attention's cache, engine.kv_cache.LatentKVCache)
    kv_copies: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values per token with a float32 cache."""
        return self.kv_bytes_per_token_at(KV_ITEMSIZE)

    def kv_bytes_per_token_at(self, itemsize: int) -> int:
        """Bytes of keys and values per token with `itemsize`-byte elements (4: float32, 2: float16)."""
        attending = self.n_layers - self.conv_layers - self.recurrent_layers
        widths = sum(self.kv_widths) if self.kv_widths else attending * self.n_kv_heads * self.head_dim
        attention = self.kv_copies * widths
        return (attention + self.conv_layers * self.hidden_size) * int(itemsize)


@dataclass
class MemoryEstimate:
    """Bytes a load would need against bytes available. `warnings` are for the user, not errors."""

    n_ctx: int
    weights_bytes: int
    kv_bytes: int
    overhead_bytes: int
    available_bytes: int
    kv_bytes_per_token: int
    max_fitting_ctx: int
    trained_ctx: int
    warnings: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.overhead_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.available_bytes * HEADROOM


# GGUF architectures with recurrent layers (a fixed state per sequence, no keys and values): Qwen3.5's and
# Qwen3-Next's DeltaNet, Granite 4.0-H's and Nemotron-H's Mamba-2
_RECURRENT_ARCHS = frozenset({"qwen35", "qwen35moe", "qwen3next", "granitehybrid", "nemotron_h"})
# GGUF architectures whose cache shape only their config knows (deepseek2: the latent row of MLA)
_CONFIG_SHAPED_ARCHS = frozenset({"deepseek2"})


def kv_shape_from_gguf(metadata: dict[str, Any], path: str = "model") -> KVShape:
    """Layers, KV heads, head size and trained context from GGUF metadata (`{arch}.*` keys).

    Raises:
        ModelFormatError: the keys the estimate needs are missing or not integers.
    """
    arch = metadata.get("general.architecture")
    if arch in _RECURRENT_ARCHS or arch in _CONFIG_SHAPED_ARCHS:  # the shape the architecture's config reads
        from engine.arch import model_class

        try:
            return kv_shape_from_config(model_class(arch).config_class.from_gguf(metadata, vocab_size=1))
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(path, f"metadata lacks the {arch} hyper-parameters ({e})") from e
    try:
        layers = int(metadata[f"{arch}.block_count"])
        heads = int(metadata[f"{arch}.attention.head_count"])
        kv_heads = metadata.get(f"{arch}.attention.head_count_kv", heads)
        conv_layers = 0
        if hasattr(kv_heads, "__len__"):  # per layer (LFM2: 0 in its convolution layers)
            per_layer = [int(h) for h in kv_heads]
            conv_layers = per_layer.count(0) if metadata.get(f"{arch}.shortconv.l_cache") else 0
            kv_heads = max(per_layer)
        kv_heads = int(kv_heads)
        hidden = int(metadata[f"{arch}.embedding_length"])
        head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
        trained = int(metadata.get(f"{arch}.context_length", 0))
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelFormatError(path, f"metadata lacks the {arch} hyper-parameters ({e})") from e
    widths = tuple(gemma4_kv_widths_gguf(metadata)) if arch in SHARED_KV_ARCHS else ()
    if arch in ENCODER_ARCHS:
        kv_heads = 0
    return KVShape(layers, kv_heads, head_dim, hidden, trained, conv_layers, kv_widths=widths)


def kv_shape_from_config(cfg) -> KVShape:
    """The same from an architecture config (engine.arch: a Hugging Face folder's config.json, read)."""
    layers, kv_heads, trained = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.max_position_embeddings
    if getattr(cfg, "architecture", None) in ENCODER_ARCHS:
        kv_heads = 0
    conv_layers = getattr(cfg, "n_conv_layers", 0)
    recurrent = getattr(cfg, "n_recurrent_layers", 0)
    state = 0
    if recurrent:
        from engine.kv_cache import RecurrentKVCache

        shape = getattr(cfg, "delta", None) or cfg.mamba
        state = (1 + RecurrentKVCache.MAX_SNAPSHOTS) * recurrent * shape.state_floats * 4
    widths = tuple(getattr(cfg, "kv_widths", ()))
    copies = 1 if getattr(cfg, "mla", False) else 2  # one latent row per layer and token
    return KVShape(
        layers, kv_heads, cfg.head_dim, cfg.hidden_size, trained, conv_layers, recurrent, state, widths,
        copies,
    )


def available_bytes() -> int:
    """Memory the OS can give us now without swapping (psutil's `available`)."""
    import psutil

    return int(psutil.virtual_memory().available)


def estimate(
    weights_bytes: int,
    shape: KVShape,
    n_ctx: int,
    batch: int = 512,
    available: int | None = None,
    kv_itemsize: int = KV_ITEMSIZE,
    gpu_layers: int = 0,
) -> MemoryEstimate:
    """Estimate the memory of a load with `n_ctx` tokens of context and prefill batches of `batch`.

    Args:
        weights_bytes: size of the model file (mapped, eventually all resident).
        shape: from kv_shape_from_gguf.
        n_ctx: requested context length.
        batch: prefill batch size (sizes activation buffers).
        available: bytes available (default: asked from the OS).
        kv_itemsize: bytes per KV cache element (4 for float32, 2 for float16).
        gpu_layers: layers that run on a GPU (all of them: the whole model): their weights are read
            from the mapped file once, for the upload (pages the OS can take back), and their KV cache
            is in GPU memory, so neither counts against RAM. (GPU memory is checked at the upload.)
    """
    if n_ctx < 1:
        raise ValueError("n_ctx must be at least 1")
    available = available_bytes() if available is None else int(available)
    n = shape.n_layers
    cpu_share = (n - min(max(int(gpu_layers), 0), n)) / n if n else 1.0
    weights_bytes = int(weights_bytes * cpu_share)
    per_token = int(shape.kv_bytes_per_token_at(kv_itemsize) * cpu_share)
    # activations of a prefill batch: residual, norm, q/k/v/o and the FFN's gate/up (~4x hidden each)
    activations = batch * shape.hidden_size * 16 * 4
    overhead = FIXED_OVERHEAD + activations
    room = int(available * HEADROOM) - weights_bytes - overhead - int(shape.state_bytes * cpu_share)
    warnings = []
    if shape.trained_ctx and n_ctx > shape.trained_ctx:
        warnings.append(
            f"the context of {n_ctx} tokens is longer than the {shape.trained_ctx} this model was trained "
            f"on; replies will degrade past {shape.trained_ctx} tokens"
        )
    return MemoryEstimate(
        n_ctx=n_ctx,
        weights_bytes=int(weights_bytes),
        kv_bytes=per_token * n_ctx + int(shape.state_bytes * cpu_share),
        overhead_bytes=overhead,
        available_bytes=available,
        kv_bytes_per_token=per_token,
        max_fitting_ctx=max(0, room // per_token) if per_token else (n_ctx if room >= 0 else 0),
        trained_ctx=shape.trained_ctx,
        warnings=warnings,
    )


def check(
    weights_bytes: int,
    shape: KVShape,
    n_ctx: int,
    batch: int = 512,
    available: int | None = None,
    kv_itemsize: int = KV_ITEMSIZE,
    gpu_layers: int = 0,
) -> MemoryEstimate:
    """estimate(), raising InsufficientMemoryError when it does not fit.

    Raises:
        InsufficientMemoryError: with the numbers and the largest context that would fit.
    """
    result = estimate(weights_bytes, shape, n_ctx, batch, available, kv_itemsize, gpu_layers)
    if not result.fits:
        raise InsufficientMemoryError(result)
    return result
