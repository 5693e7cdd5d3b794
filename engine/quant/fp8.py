"""FP8 (E4M3, per-output-channel or per-block scale): codec and `hearth convert --to fp8` / `fp8:block`.

E4M3 ("float8_e4m3fn", OCP FP8): 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, one NaN
code per sign (0x7F/0xFF), largest finite 448, subnormals m * 2**-9. Encoding rounds to nearest, ties
to even, and saturates at +-448 (as compressed-tensors does: it clamps before the cast).

A weight (rows, cols) is stored as compressed-tensors' "float-quantized" format writes it:
  `weight`        F8_E4M3 (rows, cols), q = e4m3(w / scale[r])
  `weight_scale`  F32 (rows, 1), scale[r] = max|w[r]| / 448 (1.0 for an all-zero row)
and decodes as w = e4m3_value(q) * scale[r]. The output folder's config.json carries the
compressed-tensors `quantization_config` (weights fp8, strategy "channel"; activations left in
float: Hearth's CPU kernels never quantize them), so vLLM / transformers load it too.

`--to fp8:block` writes the block-wise layout of DeepSeek-V3's and Qwen3's FP8 checkpoints instead:
  `weight`            F8_E4M3 (rows, cols), q = e4m3(w / scale_inv[r // 128, c // 128])
  `weight_scale_inv`  F32 (ceil(rows/128), ceil(cols/128)) = max|w| over the 128 x 128 block / 448
(despite its name the scale multiplies: w = e4m3_value(q) * scale_inv), with config.json's
`quantization_config` {"quant_method": "fp8", "weight_block_size": [128, 128], ...}.

Which tensors: every per-layer linear weight. Embeddings and the output head stay F16, as the Hub's
FP8 recipes leave them (`ignore: ["lm_head"]`; embeddings are no Linear).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.errors import ModelFormatError
from engine.quant.registry import ConvertResult, ProgressFn, TargetFormat, register
from engine.quant.source import SourceModel

E4M3_MAX = 448.0
FP8_BYTES_PER_ROW_SCALE = 4
BLOCK = 128  # block-wise FP8: rows and columns of a block (DeepSeek / Qwen `weight_block_size`)


def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    e = (codes >> 3) & 0xF
    m = codes & 0x7
    mag = np.where(e == 0, m * 2.0**-9, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))
    mag = np.where((codes & 0x7F) == 0x7F, np.nan, mag)
    return (sign * mag).astype(np.float32)


# code -> float32 value, all 256 codes (the CPU kernels' lookup table)
E4M3_VALUES = _e4m3_table()


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 codes (uint8): round to nearest even, saturate at +-448, NaN -> 0x7F (| sign)."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint8)
    a = np.fmin(np.abs(x), np.float32(E4M3_MAX))  # NaN -> 448 here, its code is set below
    # normal range (|x| >= 2**-6): round float32's mantissa to 3 bits (carry may bump the exponent),
    # then rebias the exponent from 127 to 7
    ab = a.view(np.uint32)
    r = (ab + np.uint32(0x7FFFF) + ((ab >> 20) & 1)) >> 20
    normal = (r.astype(np.int64) - ((127 - 7) << 3)).clip(0, 0x7E)
    # subnormal range: multiples of 2**-9; rint rounds half to even and 8 * 2**-9 is code 0x08 (2**-6)
    sub = np.rint(a * np.float32(512.0)).astype(np.int64)
    code = np.where(a < np.float32(2.0**-6), sub, normal).astype(np.uint8)
    code = np.where(np.isnan(x), np.uint8(0x7F), code)
    return code | sign


def e4m3_decode(codes: np.ndarray) -> np.ndarray:
    """E4M3 codes (uint8) -> float32 values."""
    return E4M3_VALUES[np.asarray(codes, dtype=np.uint8)]


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-output-channel FP8 of a float (rows, cols) matrix.

    Returns:
        (codes uint8 (rows, cols), scale float32 (rows,)) with w ~= e4m3_decode(codes) * scale[:, None].
    """
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8 takes a 2-D matrix, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("matrix holds NaN or infinite values; FP8 cannot encode it")
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    return e4m3_encode(w / scale[:, None]), scale


def dequantize_fp8(codes: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Reference decoder (the kernels' oracle): float32 (rows, cols) = value(codes) * scale per row."""
    return e4m3_decode(codes) * np.asarray(scale, dtype=np.float32).reshape(-1, 1)


def quantize_fp8_blocks(w: np.ndarray, block: int = BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Block-wise FP8 of a float (rows, cols) matrix, as DeepSeek-V3 and Qwen3's FP8 checkpoints store it.

    Returns:
        (codes uint8 (rows, cols), scale_inv float32 (ceil(rows/block), ceil(cols/block))) with
        w ~= e4m3_decode(codes) * scale_inv of the element's block; scale_inv = max|w| of the block / 448
        (1.0 for an all-zero block).
    """
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8_blocks takes a 2-D matrix, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("matrix holds NaN or infinite values; FP8 cannot encode it")
    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    padded = np.zeros((br * block, bc * block), np.float32)
    padded[:rows, :cols] = np.abs(w)
    amax = padded.reshape(br, block, bc, block).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    return e4m3_encode(w / _expand_blocks(scale, rows, cols, block)), scale


def dequantize_fp8_blocks(codes: np.ndarray, scale_inv: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """Reference decoder of block-wise FP8: float32 (rows, cols) = value(codes) * its block's scale_inv."""
    rows, cols = codes.shape
    return e4m3_decode(codes) * _expand_blocks(np.asarray(scale_inv, np.float32), rows, cols, block)


def _expand_blocks(scale: np.ndarray, rows: int, cols: int, block: int) -> np.ndarray:
    return np.repeat(np.repeat(scale, block, axis=0)[:rows], block, axis=1)[:, :cols]


# ---------------------------------------------------------------------------------------------
# Writing a Hugging Face folder with some tensors quantized (shared with nvfp4.py)
# ---------------------------------------------------------------------------------------------

# one output tensor: (HF name, safetensors dtype, shape, bytes)
Part = tuple[str, str, tuple[int, ...], bytes]
# quantizer(hf base name without ".weight", float32 matrix) -> parts to write
Quantizer = Callable[[str, np.ndarray], list[Part]]


def quantized_names(source: SourceModel, cols_multiple: int) -> set[str]:
    """Canonical names of the tensors a Hub-style FP recipe quantizes: per-layer 2-D linear weights
    whose row length is a multiple of `cols_multiple` (embeddings and the output head stay F16)."""
    return {
        n
        for n, s in source.shapes.items()
        if n.startswith("blk.") and n.endswith(".weight") and len(s) == 2 and s[1] % cols_multiple == 0
    }


def write_quantized_repo(
    source: SourceModel,
    out_path: Path,
    progress: ProgressFn,
    *,
    quantize: Quantizer,
    cols_multiple: int,
    type_label: str,
    quantization_config: dict,
    extra_files: dict[str, dict] | None = None,
) -> ConvertResult:
    """A Hugging Face folder (config.json with `quantization_config`, model.safetensors, tokenizer files)
    with the linear weights encoded by `quantize` and everything else as `hearth convert --to
    safetensors` writes it (matrices F16, vectors F32). Tensors are written one at a time."""
    from engine.export import _to_hf, hf_name
    from engine.quant.hf_meta import config_json, tokenizer_files

    md = source.metadata
    arch = source.architecture
    config = config_json(md, source.shapes["token_embd.weight"][0], tied="output.weight" not in source.shapes)
    config["quantization_config"] = quantization_config
    tok_json, tok_config = tokenizer_files(md)
    chosen = quantized_names(source, cols_multiple)
    out_path.mkdir()
    types: dict[str, str] = {}
    skipped = []
    data_path = out_path / "model.safetensors.data.part"
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    with open(data_path, "wb") as fh:
        for i, name in enumerate(source.names):
            key = hf_name(name, arch)
            progress(i, len(source.names), f"[{i + 1}/{len(source.names)}] {name}")
            x = _to_hf(source, name)
            if name in chosen:
                parts = quantize(key[: -len(".weight")], x)
                types[key] = type_label
            elif x.ndim >= 2:
                parts = [(key, "F16", x.shape, x.astype(np.float16).tobytes())]
                types[key] = "F16"
                if name.startswith("blk.") and name.endswith(".weight"):
                    skipped.append(key)
            else:
                parts = [(key, "F32", x.shape, x.tobytes())]
                types[key] = "F32"
            for pname, dtype, shape, data in parts:
                header[pname] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
                fh.write(data)
                off += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(out_path / "model.safetensors", "wb") as out, open(data_path, "rb") as data:
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        while chunk := data.read(16 << 20):
            out.write(chunk)
    data_path.unlink()
    (out_path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out_path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    (out_path / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (out_path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    for fname, obj in (extra_files or {}).items():
        (out_path / fname).write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    progress(len(source.names), len(source.names), "done")
    report = [f"{sum(t == type_label for t in types.values())} linear weights in {type_label}; "
              "embeddings, output head and vectors in F16/F32"]
    if skipped:
        report.append(f"kept in F16 (row length not a multiple of {cols_multiple}): {', '.join(skipped)}")
    return ConvertResult(tensor_types=types, report=report)


def _fp8_parts(base: str, w: np.ndarray) -> list[Part]:
    codes, scale = quantize_fp8(w)
    return [
        (f"{base}.weight", "F8_E4M3", codes.shape, codes.tobytes()),
        (f"{base}.weight_scale", "F32", (codes.shape[0], 1), scale.tobytes()),
    ]


def compressed_tensors_fp8_config() -> dict:
    """config.json `quantization_config` of a weight-only, per-channel FP8 compressed-tensors checkpoint."""
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "symmetric": True,
                    "strategy": "channel",
                    "dynamic": False,
                    "group_size": None,
                    "block_structure": None,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def _fp8_block_parts(base: str, w: np.ndarray) -> list[Part]:
    codes, scale = quantize_fp8_blocks(w)
    return [
        (f"{base}.weight", "F8_E4M3", codes.shape, codes.tobytes()),
        (f"{base}.weight_scale_inv", "F32", scale.shape, scale.tobytes()),
    ]


def block_fp8_config() -> dict:
    """config.json `quantization_config` of a block-wise FP8 checkpoint (the DeepSeek-V3 / Qwen3-FP8 one,
    which transformers' FineGrainedFP8 and vLLM read)."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"]}


def _fp8_writer(quantize: Quantizer, type_label: str, quantization_config: Callable[[], dict]):
    def write(source: SourceModel, out_path: Path, options: dict, progress: ProgressFn) -> ConvertResult:
        if source.architecture not in ("llama", "qwen2", "qwen3", "gemma3"):
            raise ModelFormatError(
                out_path, f"FP8 export has no Hugging Face layout for {source.architecture}"
            )
        return write_quantized_repo(
            source,
            out_path,
            progress,
            quantize=quantize,
            cols_multiple=1,
            type_label=type_label,
            quantization_config=quantization_config(),
        )

    return write


register(
    TargetFormat(
        "fp8",
        "safetensors",
        _fp8_writer(_fp8_parts, "FP8_E4M3", compressed_tensors_fp8_config),
        "FP8 E4M3 linear weights, per-channel scale (compressed-tensors safetensors folder)",
    )
)

register(
    TargetFormat(
        "fp8:block",
        "safetensors",
        _fp8_writer(_fp8_block_parts, "FP8_E4M3_BLOCK", block_fp8_config),
        "FP8 E4M3 linear weights, a scale per 128x128 block (DeepSeek / Qwen3-FP8 safetensors folder)",
    )
)
