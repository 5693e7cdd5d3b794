"""Float (F16/F32) copies of a quantized GGUF, for speculative-decoding tests and benchmarks.

Until `hearth convert --to F16` exists, the speculative tests need an F16/F32 target whose draft is
the Q4_1 starter it was made from. `write_float_copy` dequantizes every matrix with Hearth's own
dequant kernels (engine.backends.cpu.get_rows) and writes a GGUF with the `gguf` package's
GGUFWriter, copying all metadata; 1-D tensors (norms) are kept as float32.
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

# general.file_type values (llama.cpp's LLAMA_FTYPE): all-F32 and mostly-F16
_FILE_TYPE = {"F32": 0, "F16": 1}


def write_float_copy(src: Path, dst: Path, to: str = "F16") -> Path:
    """Write `dst`: the GGUF `src` with every 2-D tensor dequantized and stored as `to` (F16 or F32).

    The file is written next to dst under a temporary name and renamed, so a crash leaves no
    partial model behind. Returns dst.
    """
    from engine.backends import cpu
    from engine.weights import Weight
    from models.formats.gguf import open_gguf

    if to not in _FILE_TYPE:
        raise ValueError(f"to must be F16 or F32, got {to!r}")
    dst = Path(dst)
    reader = gguf.GGUFReader(str(src))
    ours = open_gguf(Path(src))
    arch = str(ours.metadata["general.architecture"])
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
                continue
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), vtype, sub)
        writer.add_file_type(_FILE_TYPE[to])
        for t in reader.tensors:
            info = ours.tensors[t.name]
            shape = tuple(int(s) for s in info.shape)  # (rows, cols) in our row-major convention
            if len(shape) == 2:
                w = Weight(info.ggml_type, info.raw(), shape[0], shape[1])
                rows = np.empty(shape, np.float32)
                cpu.get_rows(rows, w, np.arange(shape[0]))
                writer.add_tensor(t.name, rows.astype(np.float16 if to == "F16" else np.float32))
            else:
                writer.add_tensor(t.name, np.asarray(info.array(), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, dst)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dst


def float_copy(src: Path, to: str, cache_dir: Path) -> Path:
    """The cached float copy of src (made once): cache_dir/<stem>.<to>.gguf."""
    dst = Path(cache_dir) / f"{Path(src).stem.rsplit('.', 1)[0]}.{to}.gguf"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        write_float_copy(src, dst, to)
    return dst
