"""`hearth convert MODEL.gguf --to safetensors`: a Hugging Face repo folder from a GGUF.

The folder holds config.json, generation_config.json, model.safetensors (matrices in F16 by default,
`options["dtype"]` = "bf16" or "f32" otherwise; 1-D tensors in F32), tokenizer.json and
tokenizer_config.json (special tokens, add_bos, the chat template). GGUF conventions are undone:
llama q/k rows go back to HF's half-split RoPE order, Gemma norms back to w (GGUF stores 1 + w), and
names become HF's. A tied embedding (no output.weight) gives tie_word_embeddings = true. The folder
loads through engine/hf_repo.py and through transformers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from engine.errors import ModelFormatError
from engine.quant.encode import bf16_bits
from engine.quant.hf_meta import config_json, tokenizer_files
from engine.quant.registry import ConvertResult, ProgressFn, TargetFormat, register
from engine.quant.source import GEMMA_NORM_OFFSET, PERMUTED_QK, SourceModel, unpermute_qk

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GEMMA3_LAYER = {
    **_LAYER,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_DTYPES = {"f16": ("F16", 2), "bf16": ("BF16", 2), "f32": ("F32", 4)}


def hf_name(name: str, arch: str) -> str:
    """HF tensor name of a canonical GGUF name. Raises ModelFormatError for names without one."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    layer_names = _GEMMA3_LAYER if arch == "gemma3" else _LAYER
    if name.startswith("blk."):
        layer, _, rest = name[4:].partition(".")
        if rest in layer_names:
            return f"model.layers.{layer}.{layer_names[rest]}"
    raise ModelFormatError(name, f"tensor {name!r} has no Hugging Face {arch} counterpart; cannot export it")


def _to_hf(source: SourceModel, name: str) -> np.ndarray:
    x = source.tensor(name)
    a = source.architecture
    md = source.metadata
    if a in PERMUTED_QK and name.endswith("attn_q.weight"):
        x = unpermute_qk(x, int(md[f"{a}.attention.head_count"]))
    elif a in PERMUTED_QK and name.endswith("attn_k.weight"):
        x = unpermute_qk(x, int(md.get(f"{a}.attention.head_count_kv", md[f"{a}.attention.head_count"])))
    if a in GEMMA_NORM_OFFSET and name.endswith("norm.weight"):
        x = x - np.float32(1.0)
    return np.ascontiguousarray(x, dtype=np.float32)


def write_safetensors(path: Path, source: SourceModel, dtype: str, progress: ProgressFn) -> None:
    """model.safetensors with every tensor of `source` (matrices in `dtype`, vectors in F32)."""
    st_dtype, width = _DTYPES[dtype]
    header: dict = {"__metadata__": {"format": "pt"}}
    plan = []
    off = 0
    for name in source.names:
        shape = source.shapes[name]
        dt, w = (st_dtype, width) if len(shape) >= 2 else ("F32", 4)
        n = int(np.prod(shape)) * w
        key = hf_name(name, source.architecture)
        header[key] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        plan.append((name, dt, n))
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for i, (name, dt, n) in enumerate(plan):
            progress(i, len(plan), f"[{i + 1}/{len(plan)}] {name} -> {dt}")
            x = _to_hf(source, name)
            data = (x.astype(np.float16) if dt == "F16" else bf16_bits(x) if dt == "BF16" else x).tobytes()
            assert len(data) == n
            fh.write(data)
        progress(len(plan), len(plan), "done")


def _write_folder(source: SourceModel, out_path: Path, options: dict, progress: ProgressFn) -> ConvertResult:
    dtype = str(options.get("dtype") or "f16").lower()
    if dtype not in _DTYPES:
        raise ModelFormatError(out_path, f"export dtype {dtype!r} is not one of f16, bf16, f32")
    md = source.metadata
    vocab = source.shapes["token_embd.weight"][0]
    config = config_json(md, vocab, tied="output.weight" not in source.shapes)
    tok_json, tok_config = tokenizer_files(md)
    out_path.mkdir()
    write_safetensors(out_path / "model.safetensors", source, dtype, progress)
    (out_path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    (out_path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", encoding="utf-8")
    (out_path / "tokenizer.json").write_text(tok_json, encoding="utf-8")
    (out_path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n", encoding="utf-8")
    return ConvertResult(
        tensor_types={
            hf_name(n, source.architecture): (dtype.upper() if len(s) >= 2 else "F32")
            for n, s in source.shapes.items()
        },
        report=[f"wrote a Hugging Face folder: config.json, model.safetensors ({dtype}), tokenizer files"],
    )


register(
    TargetFormat(
        "safetensors",
        "safetensors",
        _write_folder,
        "Hugging Face repo folder (config.json, model.safetensors in F16, tokenizer files)",
    )
)
