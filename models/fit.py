"""Will a model fit this machine? Weights + KV cache for a context (+ a draft model) vs RAM (and VRAM).

The engine keeps K and V in float32: per token and layer it stores n_kv_heads * (key_length +
value_length) floats. GGUF metadata gives those numbers exactly; for a remote file we only know
the size, so the KV cache is estimated from the parameter count that size implies (and we say so).

Verdicts: "fits" when the total is at most 80% of the memory available now; "tight" when it is
within 90% of all installed memory (other programs would have to give some back); else "too large".
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.errors import ModelFormatError
from models.formats.ggml_types import BLOCK_SIZES, TYPE_NAMES
from models.hf_config import gemma4_global_shape, language_config

KV_BYTES = 4  # float32 K and V
OVERHEAD_BYTES = 128 << 20  # activations, logits, scratch buffers, the Python runtime's share
FITS_SHARE = 0.8
TIGHT_SHARE = 0.9
# layers * kv_width ~= KV_SQRT_FACTOR * sqrt(params) across Llama/Qwen/Mistral/Gemma/SmolLM shapes,
# chosen on the high side (SmolLM2-135M 5760 vs 5810 estimated, Llama-3-8B 32768 vs 44721)
KV_SQRT_FACTOR = 0.5
_BITS_BY_NAME = {
    name: 8 * nbytes / elems for t, name in TYPE_NAMES.items() for elems, nbytes in [BLOCK_SIZES[t]]
}


@dataclass(frozen=True)
class MemoryInfo:
    """Memory of this machine in bytes; VRAM fields are None without an NVIDIA GPU."""

    total_ram: int
    available_ram: int
    total_vram: int | None = None
    free_vram: int | None = None


def system_memory() -> MemoryInfo:
    """RAM from psutil; VRAM of the first NVIDIA GPU from nvidia-smi when it is installed."""
    import psutil

    vm = psutil.virtual_memory()
    total_vram = free_vram = None
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run(
                [smi, "--query-gpu=memory.total,memory.free", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            ).stdout.splitlines()
            total_mib, free_mib = (int(x) for x in out[0].split(","))
            total_vram, free_vram = total_mib << 20, free_mib << 20
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    return MemoryInfo(int(vm.total), int(vm.available), total_vram, free_vram)


@dataclass(frozen=True)
class FitEstimate:
    """The verdict and the numbers behind it (bytes)."""

    verdict: str  # "fits", "tight", "too large"
    weights: int
    kv_cache: int
    draft: int  # draft model weights + its KV cache
    overhead: int
    needed: int
    available: int
    total: int
    n_ctx: int
    kv_estimated: bool  # True when the KV cache size was guessed from the file size
    vram_verdict: str | None = None  # same rule against VRAM, when a GPU is present
    note: str = ""

    def summary(self) -> str:
        """One line for a UI or the CLI."""
        gib = 2**30
        parts = f"weights {self.weights / gib:.2f} + KV cache {self.kv_cache / gib:.2f}"
        if self.draft:
            parts += f" + draft {self.draft / gib:.2f}"
        text = (
            f"{self.verdict}: needs {self.needed / gib:.2f} GiB "
            f"({parts} + runtime {self.overhead / gib:.2f}) "
            f"for {self.n_ctx} tokens; {self.available / gib:.1f} of {self.total / gib:.1f} GiB RAM available"
        )
        if self.vram_verdict:
            text += f"; GPU: {self.vram_verdict}"
        return text + (f" ({self.note})" if self.note else "")


def label(est: FitEstimate, device: str) -> str:
    """The short verdict for where the model will run: the GPU's (marked so) when the device is CUDA and
    a GPU was found, else the RAM one."""
    if device.startswith("cuda") and est.vram_verdict:
        return f"{est.vram_verdict} (GPU)"
    return est.verdict


def _verdict(needed: int, available: int, total: int) -> str:
    if needed <= FITS_SHARE * available:
        return "fits"
    if needed <= TIGHT_SHARE * total:
        return "tight"
    return "too large"


def kv_bytes_per_token(metadata: Mapping[str, Any]) -> int:
    """KV cache bytes one token takes (all layers, float32 K and V) from GGUF metadata; 0 for an encoder.

    Uses {arch}.block_count, .attention.head_count_kv (scalar or per layer; default head_count),
    .attention.key_length / .value_length (default embedding_length / head_count).

    Raises:
        ModelFormatError: a needed key is missing or nonsensical.
    """
    arch = metadata.get("general.architecture")
    if arch in ENCODER_ARCHS:
        return 0

    def need(key: str) -> Any:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            raise ModelFormatError(f"<{arch} metadata>", f"{arch}.{key} is missing; cannot size the KV cache")
        return value

    n_layer = int(need("block_count"))
    n_head = _per_layer(need("attention.head_count"), n_layer)
    kv = metadata.get(f"{arch}.attention.head_count_kv")
    n_head_kv = _per_layer(kv, n_layer) if kv is not None else n_head
    if arch in SHARED_KV_ARCHS:
        return 2 * sum(gemma4_kv_widths_gguf(metadata)) * KV_BYTES
    key_len = metadata.get(f"{arch}.attention.key_length")
    if key_len is None:
        heads = max(n_head) if n_head else 0
        if heads <= 0:
            raise ModelFormatError(f"<{arch} metadata>", "attention.head_count is zero")
        key_len = int(need("embedding_length")) // heads
    value_len = metadata.get(f"{arch}.attention.value_length") or key_len
    every = int(metadata.get(f"{arch}.full_attention_interval") or 0)
    if every:  # Qwen3.5: every `every`-th layer attends, the others keep a fixed state
        n_head_kv = [h if (i + 1) % every == 0 else 0 for i, h in enumerate(n_head_kv)]
    total = sum(h * (int(key_len) + int(value_len)) for h in n_head_kv) * KV_BYTES
    if metadata.get(f"{arch}.shortconv.l_cache"):  # LFM2's convolution layers keep their inputs per token
        total += n_head_kv.count(0) * int(need("embedding_length")) * KV_BYTES
    if n_layer <= 0 or total <= 0:
        raise ModelFormatError(f"<{arch} metadata>", "block_count/head counts give an empty KV cache")
    return total


def gemma4_kv_widths(windowed: list[bool], kv_heads: list[int], head_dim: int, global_head_dim: int,
                     shared: int) -> list[int]:
    """n_kv_heads * head_dim of each Gemma 4 layer that keeps keys and values: all but the last `shared`
    (which attend over earlier layers'), windowed layers' heads head_dim wide, global ones global_head_dim."""
    keep = len(windowed) - int(shared)
    return [h * (head_dim if w else global_head_dim) for w, h in zip(windowed[:keep], kv_heads[:keep])]


# encoders (embedding models) keep no keys and values: GGUF architectures, config.json model types
ENCODER_ARCHS = frozenset({"bert", "nomic-bert", "modern-bert"})
ENCODER_MODEL_TYPES = frozenset({"bert", "nomic_bert", "xlm-roberta", "xlm_roberta", "modernbert"})


# architectures whose last layers reuse earlier layers' keys and values (llama.cpp's shared_kv_layers)
SHARED_KV_ARCHS = ("gemma4", "gemma3n")


def gemma4_kv_widths_gguf(metadata: Mapping[str, Any]) -> list[int]:
    """gemma4_kv_widths from llama.cpp's gemma4 keys, or its gemma3n ones (one head size: key_length). Raises
    ModelFormatError when they are missing."""
    a = metadata.get("general.architecture")
    try:
        n = int(metadata[f"{a}.block_count"])
        windowed = [bool(f) for f in metadata[f"{a}.attention.sliding_window_pattern"]]
        kv = metadata.get(f"{a}.attention.head_count_kv", metadata[f"{a}.attention.head_count"])
        shared = int(metadata.get(f"{a}.attention.shared_kv_layers", 0))
        global_hd = int(metadata[f"{a}.attention.key_length"])
        return gemma4_kv_widths(
            windowed, _per_layer(kv, n), int(metadata.get(f"{a}.attention.key_length_swa", global_hd)),
            global_hd, shared,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFormatError(f"<{a} metadata>", f"cannot size the KV cache ({e!r})") from None


def _gemma4_kv_widths_config(cfg: Mapping[str, Any]) -> list[int]:
    """gemma4_kv_widths from a gemma4_text config.json, or a gemma3n_text one (one head shape on every layer;
    transformers' default of 15 shared-KV layers)."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or ["full_attention" if (i + 1) % 5 == 0 else "sliding" for i in range(n)]
    windowed = [t != "full_attention" for t in types]
    kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim", 256))
    if cfg.get("model_type") == "gemma3n_text":
        global_hd, global_kv, shared = head_dim, kv, int(cfg.get("num_kv_shared_layers", 15))
    else:
        global_hd, global_kv = gemma4_global_shape({**cfg, "layer_types": types})
        shared = int(cfg.get("num_kv_shared_layers") or 0)
    heads = [kv if w else global_kv for w in windowed]
    return gemma4_kv_widths(windowed, heads, head_dim, global_hd, shared)


def _per_layer(value: Any, n_layer: int) -> list[int]:
    """A head count that is one number for all layers, or an array with one per layer."""
    if hasattr(value, "__len__") and not isinstance(value, str):
        values = [int(v) for v in value]
        if len(values) != n_layer:
            raise ModelFormatError("<metadata>", f"{len(values)} per-layer head counts for {n_layer} layers")
        return values
    return [int(value)] * n_layer


def kv_bytes_per_token_config(config: Mapping[str, Any]) -> int:
    """The same from a Hugging Face config.json (num_hidden_layers, num_key_value_heads, head_dim); 0 for an
    encoder."""
    cfg = language_config(config)
    cfg = cfg.get("text_config") or cfg  # other multimodal layouts: their text_config as it is
    if cfg.get("model_type") in ENCODER_MODEL_TYPES:
        return 0
    try:
        if cfg.get("model_type") in ("gemma4_text", "gemma3n_text"):
            return 2 * sum(_gemma4_kv_widths_config(cfg)) * KV_BYTES
        types = list(cfg.get("layer_types") or cfg.get("layers_block_type") or [])
        if cfg.get("model_type") == "qwen3_next" and not types:  # its published configs: the interval only
            every = int(cfg.get("full_attention_interval") or 4)
            types = ["linear_attention" if (i + 1) % every else "full_attention"
                     for i in range(int(cfg["num_hidden_layers"]))]
        if cfg.get("model_type") == "nemotron_h" and not types:  # its older configs' block pattern
            kinds = {"*": "attention", "M": "mamba", "-": "mlp", "E": "moe"}
            types = [kinds.get(c, c) for c in cfg.get("hybrid_override_pattern", "")]
        # Nemotron-H's configs as transformers writes them back give the layers by their types only
        n_layer = int(cfg.get("num_hidden_layers") or len(types) or cfg["num_hidden_layers"])
        n_head = int(cfg["num_attention_heads"])
        n_kv = int(cfg.get("num_key_value_heads") or n_head)
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_head)
        # LFM2: its convolution layers keep their inputs (hidden_size a token) instead of keys and values;
        # layer_types names them, or they are the layers not in the older configs' full_attn_idxs
        n_conv = 0
        if cfg.get("model_type") in ("lfm2", "lfm2_moe"):
            n_conv = types.count("conv") if types else n_layer - len(cfg.get("full_attn_idxs") or [])
        conv_bytes = n_conv * int(cfg["hidden_size"]) * KV_BYTES
        # Qwen3.5's and Qwen3-Next's DeltaNet and Mamba-2 layers (Granite 4.0-H, Nemotron-H) keep a fixed
        # state, no keys and values; nor do Nemotron-H's MLP blocks
        attending = n_layer - n_conv - sum(t in ("linear_attention", "mamba", "mlp", "moe") for t in types)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ModelFormatError("config.json", f"cannot size the KV cache from it ({e!r})") from None
    return attending * n_kv * 2 * head_dim * KV_BYTES + conv_bytes


def bits_per_weight(quant: str | None) -> float:
    """Average bits per weight of a quantization name ("Q4_K_M" -> Q4_K's 4.5); 16 when unknown."""
    if not quant:
        return 16.0
    q = quant.upper()
    for name in (q, q.rsplit("_", 1)[0]):
        if name in _BITS_BY_NAME:
            return _BITS_BY_NAME[name]
    return {"FP16": 16.0, "FP32": 32.0, "F8_E4M3": 8.0, "FP8": 8.0, "MXFP4": 4.25}.get(q, 16.0)


def estimate_kv_from_size(size: int, quant: str | None) -> int:
    """A guess of KV bytes per token for a model known only by file size and quantization."""
    params = size * 8 / bits_per_weight(quant)
    return int(2 * KV_SQRT_FACTOR * math.sqrt(max(params, 1.0)) * KV_BYTES)


def estimate_fit(
    weights: int,
    kv_per_token: int,
    n_ctx: int,
    draft_weights: int = 0,
    draft_kv_per_token: int = 0,
    memory: MemoryInfo | None = None,
    kv_estimated: bool = False,
    note: str = "",
) -> FitEstimate:
    """Combine weights, KV cache for `n_ctx` tokens and an optional draft model into a verdict.

    Raises:
        ValueError: a negative size or a context below 1.
    """
    if n_ctx < 1 or min(weights, kv_per_token, draft_weights, draft_kv_per_token) < 0:
        raise ValueError("sizes must be >= 0 and the context at least 1 token")
    memory = memory or system_memory()
    kv = kv_per_token * n_ctx
    draft = draft_weights + draft_kv_per_token * n_ctx if draft_weights else 0
    needed = weights + kv + draft + OVERHEAD_BYTES
    vram = None
    if memory.total_vram:
        vram = _verdict(needed, memory.free_vram or memory.total_vram, memory.total_vram)
    return FitEstimate(
        verdict=_verdict(needed, memory.available_ram, memory.total_ram),
        weights=weights,
        kv_cache=kv,
        draft=draft,
        overhead=OVERHEAD_BYTES,
        needed=needed,
        available=memory.available_ram,
        total=memory.total_ram,
        n_ctx=n_ctx,
        kv_estimated=kv_estimated,
        vram_verdict=vram,
        note=note,
    )


def local_sizes(path: str | Path) -> tuple[int, int, int | None]:
    """(weights bytes, KV bytes per token, trained context length) of a local model.

    Args:
        path: a .gguf file (first part of a split set) or a safetensors folder with config.json.

    Raises:
        ModelNotFoundError, ModelFormatError.
    """
    from models.formats.gguf import open_gguf
    from models.library import inspect_model

    path = Path(path)
    facts = inspect_model(path)
    if facts.format == "gguf":
        with open_gguf(path) as g:
            kv = kv_bytes_per_token(g.metadata)
        return facts.size, kv, facts.context_length
    folder = path if path.is_dir() else path.parent
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelFormatError(folder / "config.json", f"cannot read it ({e})") from None
    return facts.size, kv_bytes_per_token_config(config), facts.context_length


def fit_for_file(
    path: str | Path, n_ctx: int, draft_path: str | Path | None = None, memory: MemoryInfo | None = None
) -> FitEstimate:
    """Fit of a local model (+ draft) for a context of `n_ctx` tokens, from the files' own metadata."""
    weights, kv, _ = local_sizes(path)
    dw = dkv = 0
    if draft_path is not None:
        dw, dkv, _ = local_sizes(draft_path)
    return estimate_fit(weights, kv, n_ctx, dw, dkv, memory)


def fit_for_remote(
    size: int,
    n_ctx: int,
    quant: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    draft_size: int = 0,
    draft_quant: str | None = None,
    memory: MemoryInfo | None = None,
) -> FitEstimate:
    """Fit of a model not yet downloaded. With its GGUF `metadata` the KV cache is exact; without, it is
    estimated from the file size (and the estimate says so)."""
    if metadata is not None:
        kv, estimated, note = kv_bytes_per_token(metadata), False, ""
    else:
        kv, estimated = estimate_kv_from_size(size, quant), True
        note = "KV cache estimated from the file size; exact once downloaded"
    dkv = estimate_kv_from_size(draft_size, draft_quant) if draft_size else 0
    return estimate_fit(size, kv, n_ctx, draft_size, dkv, memory, kv_estimated=estimated, note=note)
