"""Writing a Hugging Face folder's vision tower as an mmproj GGUF, as llama.cpp names and lays it out.

`hearth convert` of a Gemma 3 multimodal folder to GGUF writes the language model as usual and, beside it,
mmproj-<name>-f16.gguf (general.architecture "clip", clip.projector_type "gemma3", clip.vision.* sizes; the
matrices and the patch embedding F16, norms, biases and the position table F32, Gemma's soft_emb_norm stored
as 1 + w), which Hearth (engine.vision.load) and llama.cpp read back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.quant.gguf_writer import GGUFWriter
from engine.vision.load import _HFSource, hf_vision, mmproj_name

F32, F16 = 0, 1


def mmproj_path(out_path: Path) -> Path:
    """Where the mmproj of a converted model goes: beside it, named after it."""
    return out_path.with_name(f"mmproj-{out_path.stem}-f16.gguf")


def write_mmproj(folder: Path, config: dict, st, out_path: Path) -> Path | None:
    """Write the folder's vision tower as an mmproj GGUF at out_path; None (nothing written) when the folder
    has no tower Hearth runs."""
    tower = hf_vision(folder, config, st)
    if tower is None:
        return None
    shape, enc = tower.shape, tower.shape.encoder
    source = _HFSource(st, folder)
    names = sorted(n for n in (mmproj_name(hf) for hf in st.tensors) if n is not None)
    metadata = {
        "general.architecture": "clip",
        "general.name": folder.name,
        "general.file_type": F16,
        "clip.has_vision_encoder": True,
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
    arrays = {}
    for name in names:
        values = source.floats(name, source.shape(name))  # float32 (soft_emb_norm as 1 + w)
        keep_f16 = values.ndim >= 2 and name != "v.position_embd.weight"
        arrays[name] = values.astype(np.float16 if keep_f16 else np.float32)
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
