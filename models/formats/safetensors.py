"""Read safetensors files and sharded safetensors repos as validated, zero-copy numpy views.

Layout of one file: u64 little-endian header length N, N bytes of JSON
`{"name": {"dtype": "F16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}}`,
then the data section; offsets are relative to its start.
A sharded repo adds `model.safetensors.index.json`: `{"metadata": {..}, "weight_map": {name: shard}}`.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import ModelFormatError, ModelNotFoundError

MAX_HEADER_BYTES = 100 * 1024 * 1024
_INT64_MAX = 2**63 - 1  # numpy's largest array size
MAX_DIMS = 32  # numpy 1.x's limit (2.x allows 64)
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

# dtype string -> numpy dtype of the view; float8 variants have no numpy dtype and are shown as raw bytes,
# BF16 as its raw 16-bit pattern
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype("?"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "F8_E4M3": np.dtype("u1"),
    "F8_E5M2": np.dtype("u1"),
    "F8_E4M3FNUZ": np.dtype("u1"),
    "F8_E5M2FNUZ": np.dtype("u1"),
    "F8_E8M0": np.dtype("u1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "F32": np.dtype("<f4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
}
# sub-byte dtypes the format defines but whose element views we do not offer
UNSUPPORTED_DTYPES = ("F4", "F6_E2M3", "F6_E3M2")


@dataclass(frozen=True)
class STensor:
    """One tensor of a safetensors file, checked to lie inside its file.

    Attributes:
        name: tensor name as stored (Hugging Face naming, e.g. "model.layers.0.self_attn.q_proj.weight").
        dtype: safetensors dtype string ("F32", "BF16", "F8_E4M3", "U8", ...).
        shape: numpy-order shape.
        file: the file holding it.
        offsets: absolute [begin, end) byte range in that file.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offsets: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]


class _MappedFile:
    """A read-only mapping of one safetensors file and its validated tensor table."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise ModelNotFoundError(f"{path}: no such safetensors file")
        with open(path, "rb") as fh:
            size = fh.seek(0, 2)
            if size < 8:
                raise ModelFormatError(path, f"file is only {size} bytes, too small to be safetensors")
            self.mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self.tensors, self.metadata = _parse_header(path, self.mm, size)
        except BaseException:
            self.mm.close()
            raise
        self.u8: np.ndarray | None = np.frombuffer(self.mm, dtype=np.uint8)

    def view(self, t: STensor) -> np.ndarray:
        if self.u8 is None:
            raise ValueError(f"{self.path}: safetensors file is closed")
        begin, end = t.offsets
        return self.u8[begin:end].view(DTYPES[t.dtype]).reshape(t.shape)

    def close(self) -> None:
        self.u8 = None
        # views handed out still export the buffer; the mapping goes when they do
        with contextlib.suppress(BufferError):
            self.mm.close()


def _parse_header(path: Path, mm: mmap.mmap, size: int) -> tuple[dict[str, STensor], dict[str, str]]:
    def fail(problem: str) -> ModelFormatError:
        return ModelFormatError(path, problem)

    (n,) = struct.unpack_from("<Q", mm, 0)
    if n > MAX_HEADER_BYTES:
        raise fail(f"header length {n} is larger than the {MAX_HEADER_BYTES >> 20} MiB limit; "
                   "this is not a safetensors file or it is corrupt")
    if 8 + n > size:
        raise fail(f"header of {n} bytes runs past the end of the file ({size} bytes); the file is truncated")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise fail(f"header names {k!r} twice")
            out[k] = v
        return out

    try:
        header = json.loads(mm[8 : 8 + n].decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise fail(f"header is not valid JSON ({e}); the file is corrupt or not safetensors") from None
    if not isinstance(header, dict):
        raise fail("header is not a JSON object")

    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise fail("__metadata__ must be an object of string values")

    data_start, data_size = 8 + n, size - 8 - n
    tensors: dict[str, STensor] = {}
    for name, entry in header.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise fail(f"entry {name!r} must have exactly dtype, shape and data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES and dtype not in UNSUPPORTED_DTYPES:
            raise fail(f"tensor {name!r} has unknown dtype {dtype!r}")
        if dtype in UNSUPPORTED_DTYPES:
            raise fail(f"tensor {name!r} uses the sub-byte dtype {dtype}, which Hearth does not read")
        if not _valid_shape(shape):
            raise fail(f"tensor {name!r} has an invalid shape {shape!r} (need a list of non-negative ints)")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise fail(f"tensor {name!r} has data_offsets {offsets!r} outside the "
                       f"{data_size}-byte data section")
        expected = math.prod(shape) * DTYPES[dtype].itemsize
        if offsets[1] - offsets[0] != expected:
            raise fail(f"tensor {name!r} has {offsets[1] - offsets[0]} bytes "
                       f"but {dtype} {shape} needs {expected}")
        tensors[name] = STensor(name, dtype, tuple(shape), path,
                                (data_start + offsets[0], data_start + offsets[1]))

    ordered = sorted((t for t in tensors.values() if t.nbytes), key=lambda t: t.offsets[0])
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.offsets[1] > b.offsets[0]:
            raise fail(f"tensors {a.name!r} and {b.name!r} overlap in the file")
    return tensors, metadata


def _valid_shape(shape: Any) -> bool:
    """A list of at most 32 non-negative ints that numpy can reshape to, even when one of them is 0."""
    return (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(type(d) is int and d >= 0 for d in shape)
            and math.prod(d for d in shape if d) <= _INT64_MAX)


class SafetensorsModel:
    """One safetensors file or all shards of a repo, mapped read-only.

    Attributes:
        tensors: name -> STensor, across all shards (file order within a shard, shards in order).
        metadata: the shards' `__metadata__` merged (first shard wins on conflicts).
        files: the mapped files, in order.
    """

    def __init__(self, files: list[_MappedFile]):
        self._files = {f.path: f for f in files}
        self.files = [f.path for f in files]
        self.tensors: dict[str, STensor] = {}
        self.metadata: dict[str, str] = {}
        for f in files:
            for name, t in f.tensors.items():
                if name in self.tensors:
                    other = self.tensors[name].file.name
                    raise ModelFormatError(f.path, f"tensor {name!r} is also in {other}")
                self.tensors[name] = t
            for k, v in f.metadata.items():
                self.metadata.setdefault(k, v)

    def array(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of tensor `name` in its numpy shape (BF16 as uint16, F8 as uint8).

        Raises:
            KeyError: no tensor of that name.
        """
        t = self.tensors[name]
        return self._files[t.file].view(t)

    def close(self) -> None:
        """Drop the mappings. Views already handed out keep their pages mapped until freed."""
        for f in self._files.values():
            f.close()

    def __enter__(self) -> SafetensorsModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsModel({len(self.files)} files, {len(self.tensors)} tensors)"


def _open_all(paths: list[Path]) -> SafetensorsModel:
    files: list[_MappedFile] = []
    try:
        for p in paths:
            files.append(_MappedFile(p))
        return SafetensorsModel(files)
    except BaseException:
        for f in files:
            f.close()
        raise


def open_safetensors(path: str | Path) -> SafetensorsModel:
    """Map one .safetensors file read-only and validate its header.

    Raises:
        ModelNotFoundError: there is no such file.
        ModelFormatError: the header is invalid, or a tensor lies outside the file or overlaps another.
    """
    return _open_all([Path(path)])


def open_safetensors_repo(folder: str | Path) -> SafetensorsModel:
    """Map every shard of a safetensors model folder.

    Uses `model.safetensors.index.json` when present (every shard it names must exist and every tensor it
    lists must be in the shard it names), else `model.safetensors`, else all `*.safetensors` in the folder.

    Raises:
        ModelNotFoundError: the folder does not exist or holds no safetensors file.
        ModelFormatError: the index or a shard is invalid, or a tensor appears in two shards.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder}: no such model folder")
    index_path = folder / INDEX_NAME
    if not index_path.is_file():
        single = folder / SINGLE_NAME
        paths = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
        if not paths:
            raise ModelNotFoundError(f"{folder}: no .safetensors files in this folder")
        return _open_all(paths)

    weight_map = _read_index(index_path)
    shard_names = list(dict.fromkeys(weight_map.values()))
    for s in shard_names:
        if not (folder / s).is_file():
            raise ModelFormatError(index_path, f"shard {s!r} named in the index is missing; "
                                   "download it again")
    model = _open_all([folder / s for s in shard_names])
    for name, shard in weight_map.items():
        t = model.tensors.get(name)
        if t is None or t.file.name != shard:
            model.close()
            where = "in no shard" if t is None else f"in {t.file.name}"
            raise ModelFormatError(index_path, f"index puts tensor {name!r} in {shard} but it is {where}")
    return model


def _read_index(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFormatError(index_path, f"index is not valid JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFormatError(index_path, "index has no weight_map object")
    for name, shard in weight_map.items():
        # a shard must be a plain file name in the same folder: no paths, no escaping the folder
        if not isinstance(shard, str) or not shard or Path(shard).name != shard or shard in (".", ".."):
            raise ModelFormatError(index_path, f"index maps {name!r} to an invalid shard name {shard!r}")
    return weight_map
