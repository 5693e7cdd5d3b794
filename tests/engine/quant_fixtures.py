"""Session-wide conversions of the starter models, cached next to them (keyed by source and code hash)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tests.conftest import TEST_MODELS

_CODE = [
    Path(__file__).parents[2] / "engine" / p
    for p in (
        "export.py",
        "convert.py",
        "quant/encode.py",
        "quant/kernels_k.py",
        "quant/kernels_legacy.py",
        "quant/hf_meta.py",
        "quant/source.py",
        "quant/gguf_writer.py",
        "quant/gguf_formats.py",
        "quant/presets.py",
    )
]


def code_version() -> str:
    h = hashlib.sha256()
    for p in _CODE:
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


def cached_conversion(src: Path, fmt: str) -> Path:
    """src converted to fmt (a folder for "safetensors"), made once per source file and code version."""
    from engine.convert import convert

    key = hashlib.sha256(f"{src.name}:{src.stat().st_size}:{src.stat().st_mtime_ns}".encode()).hexdigest()[
        :12
    ]
    folder = TEST_MODELS / "converted" / f"{key}-{code_version()}"
    folder.mkdir(parents=True, exist_ok=True)
    stem = src.name[:-5] if src.name.endswith(".gguf") else src.name
    out = folder / (f"{stem}-hf" if fmt == "safetensors" else f"{stem}.{fmt}.gguf")
    if not out.exists():
        convert(src, fmt, out)
    return out
