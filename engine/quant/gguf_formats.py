"""The built-in GGUF target formats (F16 ... Q6_K, Q4_K_M, mixed:BPW), registered in engine.quant.registry.

`write_gguf(source, out_path, types, progress)` writes any per-tensor type plan as one self-contained
GGUF: the source's metadata (architecture, hyper-parameters, tokenizer, chat template) with
general.file_type updated, then every tensor encoded in its planned type, one at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from engine.quant.encode import quantize
from engine.quant.gguf_writer import GGUFWriter
from engine.quant.presets import F16, F32, MXFP4, PRESETS, is_quantizable, plan
from engine.quant.registry import ConvertResult, ProgressFn, TargetFormat, register
from engine.quant.source import SourceModel
from models.formats.ggml_types import row_nbytes, type_name

# written into general.quantization_version (the ggml K-quant layout revision)
QUANTIZATION_VERSION = 2


def gqa(source: SourceModel) -> int:
    """Attention heads per KV head (LFM2 gives KV heads per layer, 0 in its convolution layers)."""
    a = source.architecture
    heads = int(source.metadata[f"{a}.attention.head_count"])
    kv = source.metadata.get(f"{a}.attention.head_count_kv", heads)
    return heads // int(max(kv) if hasattr(kv, "__len__") else kv)


def preset_plan(fmt: str, source: SourceModel) -> dict[str, int]:
    """presets.plan for `source`: tensor name -> ggml type of preset `fmt`."""
    experts = int(source.metadata.get(f"{source.architecture}.expert_count", 0))
    return plan(fmt, source.shapes, source.n_layers, gqa(source), experts)


def output_metadata(
    source: SourceModel, file_type: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    md = {k: v for k, v in source.metadata.items() if k != "general.alignment"}
    md["general.file_type"] = file_type
    md["general.quantization_version"] = QUANTIZATION_VERSION
    md.update(extra or {})
    return md


def write_gguf(
    source: SourceModel,
    out_path: Path,
    types: dict[str, int],
    progress: ProgressFn,
    metadata: dict[str, Any],
    encoded: dict[str, np.ndarray] | None = None,
) -> int:
    """Write `source` with tensor types `types` to out_path. Returns the number of bytes written.

    Args:
        encoded: already-encoded tensors (name -> raw rows) to reuse instead of encoding again.
    """
    names = source.names
    shapes = source.shapes
    specs = [(n, types[n], shapes[n]) for n in names]
    total_bytes = sum(row_nbytes(t, s[-1]) * int(np.prod(s[:-1], dtype=np.int64)) for _, t, s in specs)
    with open(out_path, "wb") as fh:
        w = GGUFWriter(fh, metadata, specs)
        w.write_header()
        done = 0
        for i, (name, t, shape) in enumerate(specs):
            progress(done, total_bytes, f"[{i + 1}/{len(specs)}] {name} -> {type_name(t)}")
            raw = encoded.get(name) if encoded else None
            if raw is None:
                x = source.tensor(name)
                raw = quantize(t, x.reshape(-1, shape[-1]))
            w.write_tensor(name, raw)
            done += raw.nbytes
        w.finish()
        progress(total_bytes, total_bytes, "done")
        return fh.tell()


# MXFP4 tensors of the source (gpt-oss's experts) stay MXFP4 in a quantized output, as llama.cpp keeps
# them: re-encoding the 4-bit codes to another 4-bit type could only lose. Float outputs decode them.
_FLOAT_OUTPUTS = ("F32", "F16", "BF16")


def _preset_writer(fmt: str):
    def write(source: SourceModel, out_path: Path, options: dict, progress: ProgressFn) -> ConvertResult:
        types = preset_plan(fmt, source)
        if fmt not in _FLOAT_OUTPUTS:
            types.update({n: MXFP4 for n, t in source.source_types.items() if t == MXFP4})
        write_gguf(source, out_path, types, progress, output_metadata(source, PRESETS[fmt][1]))
        return ConvertResult(tensor_types={n: type_name(t) for n, t in types.items()})

    return write


_DESCRIPTIONS = {
    "F32": "32-bit floats (no quantization)",
    "F16": "16-bit floats",
    "BF16": "bfloat16",
    "Q8_0": "8-bit, block 32",
    "Q4_0": "4-bit symmetric, block 32",
    "Q4_1": "4-bit with min, block 32",
    "Q5_0": "5-bit symmetric, block 32",
    "Q5_1": "5-bit with min, block 32",
    "Q2_K": "llama.cpp's Q2_K mix (2-bit K-quants, attn_v/ffn_down/attn_output at 3-4 bits)",
    "Q3_K": "3-bit K-quants, every matrix",
    "Q4_K": "4-bit K-quants, every matrix",
    "Q5_K": "5-bit K-quants, every matrix",
    "Q6_K": "6-bit K-quants",
    "Q3_K_M": "llama.cpp's Q3_K_M mix",
    "Q4_K_M": "llama.cpp's Q4_K_M mix",
    "Q5_K_M": "llama.cpp's Q5_K_M mix",
    "MXFP4_MOE": "mixture-of-experts models: experts in MXFP4 (gpt-oss's 4-bit floats), the rest Q8_0",
}

for _name in PRESETS:
    register(TargetFormat(_name, "gguf", _preset_writer(_name), _DESCRIPTIONS.get(_name, "")))


def _write_mixed(source: SourceModel, out_path: Path, options: dict, progress: ProgressFn) -> ConvertResult:
    from engine.quant.mixed import assign, measure, parse_budget

    budget = parse_budget(options.get("param"))
    errors = measure(source, progress)
    choice = assign(errors, budget)
    # matrices whose rows split into no candidate's blocks stay F16 (presets.fallback), the rest F32
    unsplit = {n for n in source.names if is_quantizable(n, source.shapes[n])}
    types = {n: choice.types.get(n, F16 if n in unsplit else F32) for n in source.names}
    # general.file_type 7 (MOSTLY_Q8_0) would be wrong; 1024 is llama.cpp's "guessed" marker
    write_gguf(source, out_path, types, progress, output_metadata(source, 1024))
    return ConvertResult(
        tensor_types={n: type_name(t) for n, t in types.items()},
        report=choice.report_lines(),
        extra={"bits_per_weight": choice.bpw, "budget": budget, "per_tensor": choice.rows()},
    )


register(
    TargetFormat(
        "mixed",
        "gguf",
        _write_mixed,
        "per-tensor types chosen to minimise weight error at an average bits/weight budget",
        takes_param=True,
    )
)
