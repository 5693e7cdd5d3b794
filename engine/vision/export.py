"""Writing a Hugging Face folder's vision tower as an mmproj GGUF, as llama.cpp names and lays it out.

`hearth convert` of a Gemma 3, Mistral 3, Qwen3.5 (dense or MoE), Qwen3-VL (dense or MoE), Qwen2.5-VL or
Qwen2-VL multimodal folder to GGUF writes the language model as usual and, beside it, mmproj-<name>-f16.gguf
(general.architecture "clip", clip.projector_type "gemma3", "pixtral", "qwen3vl_merger", "qwen2.5vl_merger"
or "qwen2vl_merger", clip.vision.* sizes; the matrices and the patch embedding F16, norms, biases and the
position table F32, Gemma's soft_emb_norm stored as 1 + w; Qwen2.5-VL's and Qwen2-VL's fused qkv split into
attn_q, attn_k, attn_v as llama.cpp's converter writes them), which Hearth (engine.vision.load) and llama.cpp
read back. Qwen3-VL's deepstack mergers go in as llama.cpp's converter writes them:
v.deepstack.<vision block>.{norm,fc1,fc2}, the blocks flagged in clip.vision.is_deepstack_layers.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from engine.quant.gguf_writer import GGUFWriter
from engine.vision.gemma4 import Gemma4Vision
from engine.vision.load import _HFSource, hf_vision, mmproj_name, qwen35_namer
from engine.vision.pixtral import PixtralVision
from engine.vision.qwen25 import Qwen25Vision, periodic_blocks
from engine.vision.qwen35 import Qwen35Vision
from engine.weights import float32_of

F32, F16 = 0, 1


def mmproj_path(out_path: Path) -> Path:
    """Where the mmproj of a converted model goes: beside it, named after it."""
    return out_path.with_name(f"mmproj-{out_path.stem}-f16.gguf")


def write_mmproj(folder: Path, config: dict, st, out_path: Path) -> Path | None:
    """Write the folder's vision tower as an mmproj GGUF at out_path; None (nothing written) when the folder
    has no tower Hearth runs, or one the mmproj keys cannot describe (a Pixtral with another RoPE base, a
    Qwen3.5 kernel over other than two frames, Qwen2.5-VL full-attention blocks that are not every n-th)."""
    tower = hf_vision(folder, config, st)
    if tower is None or isinstance(tower, Gemma4Vision):  # no mmproj layout is written for Gemma 4's tower
        return None
    rename = qwen35_namer(tower.shape.deepstack) if isinstance(tower, Qwen35Vision) else mmproj_name
    source = _HFSource(st, folder, rename)
    names = sorted(n for n in (rename(hf) for hf in st.tensors) if n is not None)
    metadata = {
        "general.architecture": "clip",
        "general.name": folder.name,
        "general.file_type": F16,
        "clip.has_vision_encoder": True,
    }
    extra = {}
    if isinstance(tower, PixtralVision):
        if tower.shape.rope_theta != 10000.0:  # GGUF's pixtral keys keep no RoPE base: llama.cpp's is fixed
            return None
        metadata |= _pixtral_metadata(tower.shape)
        extra = _img_break(folder, st, tower.shape.text_hidden)
    elif isinstance(tower, Qwen35Vision):
        if tower.shape.temporal != 2:  # llama.cpp's qwen3vl_merger holds two temporal slices of the kernel
            return None
        keys = _qwen25_metadata(tower.shape, config) if isinstance(tower, Qwen25Vision) else (
            _qwen35_metadata(tower.shape, config))
        if keys is None:
            return None
        metadata |= keys
    else:
        metadata |= _gemma3_metadata(tower.shape)
    arrays = {}
    for name in names:
        values = source.floats(name, source.shape(name))  # float32 (soft_emb_norm as 1 + w)
        if name == "v.patch_embd.weight" and values.ndim == 5:  # Qwen3.5's 3D kernel: a 2D kernel per frame
            arrays[name + ".1"] = values[:, :, 1].astype(np.float16)
            values = values[:, :, 0]
        if isinstance(tower, Qwen25Vision) and ".attn_qkv." in name:  # qwen2.5vl_merger keeps q, k, v apart
            for part, third in zip("qkv", np.split(values, 3), strict=True):
                arrays[name.replace("attn_qkv", "attn_" + part)] = _stored(name, third)
            continue
        arrays[name] = _stored(name, values)
    arrays |= extra
    specs = [(n, F16 if a.dtype == np.float16 else F32, a.shape) for n, a in arrays.items()]
    tmp = out_path.with_name(f".{out_path.name}.part")
    try:
        with open(tmp, "wb") as fh:
            writer = GGUFWriter(fh, metadata, specs)
            writer.write_header()
            for name, array in arrays.items():
                writer.write_tensor(name, array.view(np.uint8).reshape(-1))
            writer.finish()
        tmp.replace(out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def _stored(name: str, values: np.ndarray) -> np.ndarray:
    """A tensor as the mmproj stores it: matrices and kernels F16, vectors and position embeddings F32."""
    keep_f16 = values.ndim >= 2 and name != "v.position_embd.weight"
    return values.astype(np.float16 if keep_f16 else np.float32)


def _gemma3_metadata(shape) -> dict:
    enc = shape.encoder
    return {
        "clip.projector_type": "gemma3",
        "clip.use_gelu": True,
        "clip.vision.image_size": enc.image_size,
        "clip.vision.patch_size": enc.patch,
        "clip.vision.embedding_length": enc.hidden,
        "clip.vision.feed_forward_length": enc.ff,
        "clip.vision.block_count": enc.layers,
        "clip.vision.attention.head_count": enc.heads,
        "clip.vision.attention.layer_norm_epsilon": float(enc.eps),
        "clip.vision.projection_dim": shape.text_hidden,
        "clip.vision.projector.scale_factor": shape.pool,
        "clip.vision.image_mean": [float(v) for v in shape.mean],
        "clip.vision.image_std": [float(v) for v in shape.std],
    }


def _pixtral_metadata(shape) -> dict:
    """llama.cpp's keys for Mistral 3's tower (projector "pixtral"; its RoPE base is the fixed 10000)."""
    return {
        "clip.projector_type": "pixtral",
        "clip.use_silu" if shape.act == "silu" else "clip.use_gelu": True,
        "clip.vision.image_size": shape.longest_edge,
        "clip.vision.patch_size": shape.patch,
        "clip.vision.embedding_length": shape.hidden,
        "clip.vision.feed_forward_length": shape.ff,
        "clip.vision.block_count": shape.layers,
        "clip.vision.attention.head_count": shape.heads,
        "clip.vision.attention.layer_norm_epsilon": shape.projector_eps,  # llama.cpp's projector norm too
        "clip.vision.projection_dim": shape.text_hidden,
        "clip.vision.spatial_merge_size": shape.merge,
        "clip.vision.image_mean": [float(v) for v in shape.mean],
        "clip.vision.image_std": [float(v) for v in shape.std],
    }


def _qwen35_metadata(shape, config: dict) -> dict:
    """llama.cpp's keys for Qwen3.5's and Qwen3-VL's tower (projector "qwen3vl_merger")."""
    return _qwen_vision_metadata(shape, config) | {
        "clip.projector_type": "qwen3vl_merger",
        "clip.use_gelu": True,
        "clip.vision.image_size": math.isqrt(shape.positions) * shape.patch,
        # the vision blocks Qwen3-VL's deepstack mergers follow (none in Qwen3.5's)
        "clip.vision.is_deepstack_layers": [i in shape.deepstack for i in range(shape.layers)],
    }


def _qwen25_metadata(shape, config: dict) -> dict | None:
    """llama.cpp's keys for Qwen2.5-VL's tower (projector "qwen2.5vl_merger"): the full-attention blocks as
    a period (n_wa_pattern: block i attends fully when (i + 1) % n == 0, as llama.cpp's converter derives it
    from fullatt_block_indexes) and the window's pixels (clip.vision.window_size, which llama.cpp's converter
    leaves to its default of 112). None when the full-attention blocks are not every n-th (no key says so).
    Qwen2-VL's (projector "qwen2vl_merger"): neither clip.use_silu nor clip.use_gelu, which llama.cpp reads as
    its quick GELU; feed_forward_length the MLP's (llama.cpp's converter writes the text width there, and
    both read the tensors' rows)."""
    # image_size: llama.cpp's converter's value for configs without one (unused)
    qwen2 = {"clip.projector_type": "qwen2vl_merger", "clip.vision.image_size": 560}
    if not shape.gated:
        return _qwen_vision_metadata(shape, config) | qwen2
    full = shape.full_blocks
    period = full[0] + 1 if full else 0
    if not period or tuple(sorted(full)) != periodic_blocks(period, shape.layers):
        return None
    return _qwen_vision_metadata(shape, config) | qwen2 | {
        "clip.projector_type": "qwen2.5vl_merger",
        "clip.use_silu": True,
        "clip.vision.n_wa_pattern": period,
        "clip.vision.window_size": shape.window,
    }


def _qwen_vision_metadata(shape, config: dict) -> dict:
    """The clip.vision keys of the Qwen towers, and the image processor's pixel bounds
    (clip.vision.image_{min,max}_pixels), which llama.cpp's converter leaves to the runtime's defaults."""
    text = config.get("text_config") or config  # published Qwen2.5-VL configs: the text fields at the top
    return {
        "clip.vision.patch_size": shape.patch,
        "clip.vision.embedding_length": shape.hidden,
        "clip.vision.feed_forward_length": shape.ff,
        "clip.vision.block_count": shape.layers,
        "clip.vision.attention.head_count": shape.heads,
        # as llama.cpp writes it: the text model's RMSNorm epsilon (the tower's LayerNorms use 1e-6 too)
        "clip.vision.attention.layer_norm_epsilon": float(text.get("rms_norm_eps", shape.eps)),
        "clip.vision.projection_dim": int(text.get("hidden_size", shape.text_hidden)),
        "clip.vision.spatial_merge_size": shape.merge,
        "clip.vision.image_min_pixels": shape.min_pixels,
        "clip.vision.image_max_pixels": shape.max_pixels,
        "clip.vision.image_mean": [float(v) for v in shape.mean],
        "clip.vision.image_std": [float(v) for v in shape.std],
    }


def _img_break(folder: Path, st, text_hidden: int) -> dict:
    """The [IMG_BREAK] token's embedding as llama.cpp's pixtral mmproj carries it (v.token_embd.img_break:
    its image chunks hold the breaks); Hearth keeps the breaks as tokens and ignores it."""
    from engine.hf_repo import folder_tokenizer

    tokenizer, _ = folder_tokenizer(folder)
    ids = tokenizer.encode("[IMG_BREAK]", add_special=False)
    table = next((n for n in st.tensors if n.endswith("embed_tokens.weight")), None)
    if len(ids) != 1 or table is None:
        return {}
    row = st.array(table)[ids[0]]
    bf16 = st.tensors[table].dtype == "BF16"
    return {"v.token_embd.img_break": float32_of(np.asarray(row), bf16).reshape(text_hidden)}
