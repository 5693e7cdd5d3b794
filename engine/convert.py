"""`hearth convert SRC --to FORMAT [-o OUT]`: the driver around the target-format registry.

What every conversion gets, whatever the format:
  * the source opened read-only (GGUF file or Hugging Face folder), never written;
  * output written under a temporary name next to OUT (".OUT.part-PID"), renamed onto OUT only once
    complete; on any failure or interruption (Ctrl-C, disk full, encoder error) the temporary file or
    folder is removed and OUT is left as it was;
  * a free-space check before writing when the output size is known, and a typed DiskFullError when
    the disk fills up anyway;
  * progress as (done, total, message) callbacks.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine.quant.registry import ConvertResult, ProgressFn, TargetFormat, default_output, lookup
from engine.quant.source import open_source
from models.errors import HearthError


class ConvertError(HearthError):
    """A conversion cannot run as asked (output path problems and the like)."""


class DiskFullError(ConvertError):
    """The disk filled up while writing; nothing partial was left behind."""


@dataclass
class ConvertOutcome:
    """A finished conversion."""

    source: Path
    output: Path
    format: str
    seconds: float
    nbytes: int
    result: ConvertResult = field(default_factory=ConvertResult)
    mmproj: Path | None = None  # the vision tower's mmproj GGUF written beside a GGUF output


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def estimate_bytes(fmt: TargetFormat, source, param: str | None = None) -> int | None:
    """Weight bytes of the output of a preset GGUF format (known from the type plan, fallbacks
    included), None for the other formats. The file adds its metadata (tokenizer: ~1-5 MB)."""
    from engine.quant.presets import PRESETS

    name = fmt.name.upper()
    if fmt.container != "gguf" or name not in PRESETS:
        return None
    from engine.quant.gguf_formats import preset_plan
    from models.formats.ggml_types import row_nbytes

    types = preset_plan(name, source)
    total = 0
    for n, s in source.shapes.items():
        rows = 1
        for d in s[:-1]:
            rows *= d
        total += row_nbytes(types[n], s[-1]) * rows
    return total


def convert(
    src: str | Path,
    to: str,
    out: str | Path | None = None,
    *,
    options: dict | None = None,
    progress: ProgressFn | None = None,
    overwrite: bool = False,
) -> ConvertOutcome:
    """Convert a GGUF file or Hugging Face folder to format `to`.

    Args:
        src: GGUF file or Hugging Face folder.
        to: a registered format name ("Q4_K_M", "mixed:4.5", "safetensors", ...).
        out: output file (GGUF) or folder (safetensors); default: next to the source, named after the format.
        options: format options passed to the converter.
        progress: progress(done, total, message) callback.
        overwrite: replace an existing OUT (otherwise that is an error).

    Raises:
        UnknownFormatError, ConvertError, DiskFullError, ModelFormatError, UnsupportedArchitectureError.
    """
    fmt, param = lookup(to)
    src = Path(src)
    options = dict(options or {})
    if param is not None:
        options["param"] = param
    report = progress or (lambda done, total, msg: None)
    t0 = time.perf_counter()
    with open_source(src) as source:
        out_path = Path(out) if out is not None else default_output(src, fmt, param)
        if out_path.resolve() == src.resolve():
            raise ConvertError(f"{out_path}: the output would overwrite the source; pick another -o")
        if out_path.exists() and not overwrite:
            raise ConvertError(f"{out_path} already exists; remove it or pass --force")
        if not out_path.parent.is_dir():
            raise ConvertError(f"{out_path.parent}: no such folder for the output")
        need = estimate_bytes(fmt, source, param)
        if need is not None:
            free = shutil.disk_usage(out_path.parent).free
            if free < need:
                raise DiskFullError(
                    f"{out_path.parent}: {need / 1e6:.1f} MB are needed for the output but only "
                    f"{free / 1e6:.1f} MB are free; free some space or pick another -o"
                )
        tmp = out_path.parent / f".{out_path.name}.part-{os.getpid()}"
        _remove(tmp)
        try:
            result = fmt.write(source, tmp, options, report)
            if out_path.exists():
                _remove(out_path)
            os.replace(tmp, out_path)
        except OSError as e:
            _remove(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    f"{out_path.parent}: the disk is full; nothing was written "
                    "(free some space or pick another -o)"
                ) from e
            raise
        except BaseException:
            _remove(tmp)
            raise
    mmproj = _vision_beside(src, out_path, overwrite)
    return ConvertOutcome(
        src,
        out_path,
        fmt.name + (f":{param}" if param else ""),
        time.perf_counter() - t0,
        _size(out_path),
        result,
        mmproj,
    )


def _vision_beside(src: Path, out_path: Path, overwrite: bool) -> Path | None:
    """A multimodal folder converted to GGUF: its vision tower as an mmproj GGUF beside the output (what
    llama.cpp and Hearth load images with), None when there is none. An existing mmproj is kept unless
    `overwrite`."""
    if not src.is_dir() or out_path.suffix != ".gguf":
        return None
    from engine.hf_repo import read_json
    from engine.vision.export import mmproj_path, write_mmproj
    from models.formats.safetensors import open_safetensors_repo

    target = mmproj_path(out_path)
    if target.exists() and not overwrite:
        raise ConvertError(f"{target} already exists; remove it or pass --force")
    with open_safetensors_repo(src) as st:
        try:
            return write_mmproj(src, read_json(src / "config.json"), st, target)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    f"{target.parent}: the disk is full; the vision tower was not written"
                ) from e
            raise
