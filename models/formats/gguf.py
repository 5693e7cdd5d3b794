"""Read GGUF (v2, v3) files: validated header, metadata as Python values, tensors as zero-copy views.

Layout (all little-endian): magic "GGUF", u32 version, u64 tensor count, u64 key/value count, the
key/value pairs, one info record per tensor (name, u32 n_dims, u64 dims ne0 first, u32 ggml type,
u64 offset), padding to `general.alignment`, then the tensor data section.

Every number in the header is checked before it is used, so the views handed to kernels (which run
under Numba without bounds checks) can never reach outside the file.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from models.errors import ModelFormatError, ModelNotFoundError
from models.formats.ggml_types import BLOCK_SIZES, PLAIN_DTYPES, is_known, type_name

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Limits on what a header may claim. Real files stay far below: a 256k-token vocabulary with merges is
# a few tens of MiB, the largest models have a few thousand tensors.
MAX_HEADER_BYTES = 256 * 1024 * 1024
MAX_KEY_BYTES = 64 * 1024
MAX_NAME_BYTES = 64 * 1024
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 20
MAX_DIMS = 4
MAX_ARRAY_DEPTH = 4
_INT64_MAX = 2**63 - 1

# GGUF value type ids
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = range(10)
_UINT64, _INT64, _FLOAT64 = 10, 11, 12

# scalar value type id -> (struct for one value, numpy dtype for an array of them)
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    _UINT8: (struct.Struct("<B"), np.dtype("u1")),
    _INT8: (struct.Struct("<b"), np.dtype("i1")),
    _UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    _INT16: (struct.Struct("<h"), np.dtype("<i2")),
    _UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    _INT32: (struct.Struct("<i"), np.dtype("<i4")),
    _FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    _BOOL: (struct.Struct("<B"), np.dtype("u1")),
    _UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    _INT64: (struct.Struct("<q"), np.dtype("<i8")),
    _FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_INTEGER_TYPES = (_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _UINT64, _INT64)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# smallest possible encodings, used to reject counts the remaining bytes cannot hold
_MIN_KV_BYTES = 8 + 1 + 4 + 1  # key length, 1-byte key, value type, 1-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 1 + 4 + 8 + 4 + 8  # name length, 1-byte name, n_dims, one dim, type, offset
_MIN_ARRAY_BYTES = 4 + 8  # element type, element count


@dataclass(frozen=True, eq=False)
class TensorInfo:
    """One tensor of a GGUF file, checked to lie inside the file.

    Attributes:
        name: tensor name, e.g. "blk.0.attn_q.weight".
        ggml_type: a `gguf.GGMLQuantizationType` value.
        dims: sizes in ggml order, ne0 (the contiguous row length) first.
        offset: absolute byte offset of the data in the file.
        nbytes: size of the data in bytes.
    """

    name: str
    ggml_type: int
    dims: tuple[int, ...]
    offset: int
    nbytes: int
    _file: GGUFFile = field(repr=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes in numpy order (ne0 last)."""
        return tuple(reversed(self.dims))

    @property
    def n_rows(self) -> int:
        """Number of rows: the product of every dim except ne0 (1 for a vector)."""
        return math.prod(self.dims[1:])

    @property
    def row_nbytes(self) -> int:
        """Bytes of one row of ne0 elements (whole blocks for quantized types)."""
        return self.nbytes // self.n_rows

    @property
    def type_name(self) -> str:
        """The ggml type's name, e.g. "Q4_1"."""
        return type_name(self.ggml_type)

    def raw(self) -> np.ndarray:
        """Zero-copy read-only uint8 view (n_rows, row_nbytes) of the tensor's bytes in the mapped file."""
        return self._file._view(self.offset, self.nbytes).reshape(self.n_rows, self.row_nbytes)

    def array(self) -> np.ndarray:
        """Zero-copy read-only typed view in numpy shape, for plain element types.

        F32 -> float32, F16 -> float16, BF16 -> uint16 (the raw bit pattern), I8/I16/I32/I64/F64 as named.

        Raises:
            ModelFormatError: the type is block-quantized; use `raw()` and a format decoder instead.
        """
        dtype = PLAIN_DTYPES.get(self.ggml_type)
        if dtype is None:
            raise ModelFormatError(
                self._file.path,
                f"tensor {self.name!r} is {self.type_name}, a block-quantized type with no element view; "
                "read it with raw() and a format decoder",
            )
        return self._file._view(self.offset, self.nbytes).view(dtype).reshape(self.shape)


class GGUFFile:
    """An open, validated GGUF file. Tensor views stay valid as long as they are referenced.

    Attributes:
        path: the file.
        version: GGUF version (2 or 3).
        alignment: data alignment in bytes (general.alignment, default 32).
        data_offset: absolute offset of the tensor data section.
        metadata: key -> value; str/int/float/bool scalars, list[str] for string arrays, numpy arrays
            for numeric arrays, lists for arrays of arrays.
        tensors: name -> TensorInfo, in file order.
    """

    def __init__(
        self,
        path: Path,
        mm: mmap.mmap,
        version: int,
        alignment: int,
        data_offset: int,
        metadata: dict[str, Any],
        tensors: list[tuple[str, int, tuple[int, ...], int, int]],
    ):
        self.path = path
        self.version = version
        self.alignment = alignment
        self.data_offset = data_offset
        self.metadata = metadata
        self._mm: mmap.mmap | None = mm
        # one uint8 view of the whole mapping; every tensor view is a slice of it
        self._u8: np.ndarray | None = np.frombuffer(mm, dtype=np.uint8)
        self.tensors: dict[str, TensorInfo] = {
            name: TensorInfo(name, ggml_type, dims, offset, nbytes, self)
            for name, ggml_type, dims, offset, nbytes in tensors
        }

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value for `key`, or `default` when the file does not have it."""
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        """The model family (general.architecture), e.g. "llama".

        Raises:
            ModelFormatError: the key is missing or not a string.
        """
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelFormatError(self.path, "general.architecture is missing; this is not a model GGUF")
        return arch

    def _view(self, offset: int, nbytes: int) -> np.ndarray:
        if self._u8 is None:
            raise ValueError(f"{self.path}: GGUF file is closed")
        return self._u8[offset : offset + nbytes]

    def close(self) -> None:
        """Drop this object's mapping. Views already handed out keep the pages mapped until freed."""
        self._u8 = None
        if self._mm is not None:
            # live tensor views still export the buffer; the mapping goes when they do
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, v{self.version}, {len(self.tensors)} tensors)"


def open_gguf(path: str | Path) -> GGUFFile:
    """Map a GGUF file read-only and validate its whole header.

    Args:
        path: the .gguf file.

    Returns:
        The open file; its tensors are zero-copy views of the mapping.

    Raises:
        ModelNotFoundError: there is no such file.
        ModelFormatError: the file is not GGUF v2/v3 or any part of its header is invalid or truncated.
    """
    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such model file")
    with open(path, "rb") as fh:
        size = fh.seek(0, 2)
        if size < 4 + 4 + 8 + 8:
            raise ModelFormatError(path, f"file is only {size} bytes, too small to be a GGUF model")
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        parser = _HeaderParser(path, mm, size)
        version, alignment, data_offset, metadata, tensors = parser.parse()
        return GGUFFile(path, mm, version, alignment, data_offset, metadata, tensors)
    except BaseException:
        with contextlib.suppress(BufferError):
            mm.close()
        raise


class _HeaderParser:
    """Walks the header once, checking every length against the bytes that are actually there."""

    def __init__(self, path: Path, mm: mmap.mmap, size: int):
        self.path = path
        self.mm = mm
        self.size = size
        self.end = min(size, MAX_HEADER_BYTES)  # no header field may extend past this
        self.pos = 0

    def fail(self, problem: str) -> ModelFormatError:
        return ModelFormatError(self.path, problem)

    def need(self, n: int, what: str) -> None:
        """Fail unless `n` more bytes are available at the cursor."""
        if n > self.end - self.pos:
            if self.end < self.size:
                raise self.fail(f"{what} at byte {self.pos} would make the header larger than the "
                                f"{MAX_HEADER_BYTES >> 20} MiB limit")
            raise self.fail(f"header is truncated: {what} at byte {self.pos} needs {n} bytes, "
                            f"only {self.end - self.pos} are left")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.mm, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.mm, self.pos)
        self.pos += 8
        return v

    def string(self, what: str, max_len: int | None = None, strict: bool = False) -> str:
        n = self.u64(f"length of {what}")
        if max_len is not None and n > max_len:
            raise self.fail(f"{what} is {n} bytes long, more than the {max_len}-byte limit")
        self.need(n, what)
        data = self.mm[self.pos : self.pos + n]
        self.pos += n
        try:
            # keys and names must be clean text; string values keep odd bytes as surrogates (round-trippable
            # with .encode("utf-8", "surrogateescape")) since some vocabularies carry raw byte tokens
            return data.decode("utf-8", "strict" if strict else "surrogateescape")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def parse(self) -> tuple[int, int, int, dict[str, Any], list[tuple[str, int, tuple[int, ...], int, int]]]:
        version, n_tensors, metadata = self.parse_metadata()
        alignment = self.alignment(metadata)
        tensors = [self.tensor_info(i, alignment) for i in range(n_tensors)]
        names = set()
        for name, *_ in tensors:
            if name in names:
                raise self.fail(f"tensor {name!r} appears twice")
            names.add(name)

        data_offset = -(-self.pos // alignment) * alignment
        placed = [(name, t, dims, data_offset + off, nb) for name, t, dims, off, nb in tensors]
        self.check_placement(placed)
        return version, alignment, data_offset, metadata, placed

    def parse_metadata(self) -> tuple[int, int, dict[str, Any]]:
        """The preamble and the key/value section: (version, tensor count, metadata)."""
        mm = self.mm
        if mm[0:4] != MAGIC:
            raise self.fail(f"not a GGUF file (starts with {bytes(mm[0:4])!r}, expected {MAGIC!r})")
        self.pos = 4
        version = self.u32("version")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in SUPPORTED_VERSIONS:
                raise self.fail("big-endian GGUF is not supported; use a little-endian conversion")
            if version == 1:
                raise self.fail("GGUF version 1 (from before August 2023) is not supported; "
                                "download or convert a current (v3) file")
            raise self.fail(f"unsupported GGUF version {version} (supported: 2 and 3)")

        n_tensors = self.u64("tensor count")
        n_kv = self.u64("key/value count")
        left = self.end - self.pos
        if n_kv > MAX_KEYS or n_kv * _MIN_KV_BYTES > left:
            raise self.fail(f"header claims {n_kv} metadata keys, more than the file can hold; "
                            "it is truncated or corrupt")
        if n_tensors > MAX_TENSORS or n_tensors * _MIN_TENSOR_INFO_BYTES > left:
            raise self.fail(f"header claims {n_tensors} tensors, more than the file can hold; "
                            "it is truncated or corrupt")

        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = self.string(f"key #{i}", MAX_KEY_BYTES, strict=True)
            if key in metadata:
                raise self.fail(f"metadata key {key!r} appears twice")
            vtype = self.u32(f"value type of {key!r}")
            metadata[key] = self.value(vtype, key, 0)
        return version, n_tensors, metadata

    def value(self, vtype: int, key: str, depth: int) -> Any:
        scalar = _SCALARS.get(vtype)
        if scalar is not None:
            st = scalar[0]
            self.need(st.size, f"value of {key!r}")
            (v,) = st.unpack_from(self.mm, self.pos)
            self.pos += st.size
            if vtype == _BOOL:
                if v > 1:
                    raise self.fail(f"bool value of {key!r} is {v}, not 0 or 1")
                return bool(v)
            return v
        if vtype == _STRING:
            return self.string(f"value of {key!r}")
        if vtype == _ARRAY:
            return self.array(key, depth + 1)
        raise self.fail(f"{key!r} has unknown value type {vtype}")

    def array(self, key: str, depth: int) -> Any:
        if depth > MAX_ARRAY_DEPTH:
            raise self.fail(f"{key!r} nests arrays deeper than {MAX_ARRAY_DEPTH} levels")
        etype = self.u32(f"element type of {key!r}")
        count = self.u64(f"element count of {key!r}")
        left = self.end - self.pos
        scalar = _SCALARS.get(etype)
        if scalar is not None:
            dtype = scalar[1]
            if count > left // dtype.itemsize:
                raise self.fail(f"array {key!r} claims {count} elements, more than the {left} bytes left")
            self.need(count * dtype.itemsize, f"array {key!r}")
            arr = np.frombuffer(self.mm, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            if etype == _BOOL:
                if count and arr.max() > 1:
                    raise self.fail(f"bool array {key!r} holds values other than 0 and 1")
                return arr.astype(np.bool_)
            return arr.astype(dtype.newbyteorder("="), copy=False)
        if etype == _STRING:
            if count > left // 8:
                raise self.fail(f"string array {key!r} claims {count} elements, "
                                f"more than the {left} bytes left")
            return self.string_array(key, count)
        if etype == _ARRAY:
            if count > left // _MIN_ARRAY_BYTES:
                raise self.fail(f"array {key!r} claims {count} sub-arrays, more than the {left} bytes left")
            return [self.array(key, depth + 1) for _ in range(count)]
        raise self.fail(f"array {key!r} has unknown element type {etype}")

    def string_array(self, key: str, count: int) -> list[str]:
        # the hot loop of opening a file (49k tokens + 49k merges): locals only, no method calls
        mm, pos, end = self.mm, self.pos, min(self.end, len(self.mm))
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8, f"length of element {i} of {key!r}")
            (n,) = unpack(mm, pos)
            pos += 8
            if n > end - pos:
                self.pos = pos
                self.need(n, f"element {i} of {key!r}")
            append(mm[pos : pos + n].decode("utf-8", "surrogateescape"))
            pos += n
        self.pos = pos
        return out

    def alignment(self, metadata: dict[str, Any]) -> int:
        if "general.alignment" not in metadata:
            return DEFAULT_ALIGNMENT
        align = metadata["general.alignment"]
        if type(align) is not int:
            raise self.fail(f"general.alignment must be an integer, got {align!r}")
        if align <= 0 or align & (align - 1):
            raise self.fail(f"general.alignment is {align}, not a power of two")
        return align

    def tensor_info(self, i: int, alignment: int) -> tuple[str, int, tuple[int, ...], int, int]:
        name = self.string(f"name of tensor #{i}", MAX_NAME_BYTES, strict=True)
        if not name:
            raise self.fail(f"tensor #{i} has an empty name")
        n_dims = self.u32(f"n_dims of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(f"tensor {name!r} has {n_dims} dimensions (must be 1 to {MAX_DIMS})")
        dims = tuple(self.u64(f"dim {d} of {name!r}") for d in range(n_dims))
        for d in dims:
            if d == 0 or d > _INT64_MAX:
                raise self.fail(f"tensor {name!r} has an invalid dimension {d} in {list(dims)}")
        ggml_type = self.u32(f"type of {name!r}")
        if not is_known(ggml_type):
            raise self.fail(f"tensor {name!r} has unknown ggml type id {ggml_type}")
        offset = self.u64(f"offset of {name!r}")
        block, block_bytes = BLOCK_SIZES[ggml_type]
        if dims[0] % block:
            raise self.fail(f"tensor {name!r} is {type_name(ggml_type)} with rows of {dims[0]} elements, "
                            f"not a multiple of its block size {block}")
        if offset % alignment:
            raise self.fail(f"tensor {name!r} starts at data offset {offset}, not a multiple of the "
                            f"alignment {alignment}")
        # Python ints: no overflow however large the dims claim to be
        nbytes = dims[0] // block * block_bytes * math.prod(dims[1:])
        return name, ggml_type, dims, offset, nbytes

    def check_placement(self, tensors: list[tuple[str, int, tuple[int, ...], int, int]]) -> None:
        for name, _, _, start, nbytes in tensors:
            if start + nbytes > self.size:
                raise self.fail(f"tensor {name!r} (bytes {start}..{start + nbytes}) runs past the end of the "
                                f"file ({self.size} bytes); the file is truncated or corrupt")
        ordered = sorted(tensors, key=lambda t: t[3])
        for (a, _, _, a_start, a_nbytes), (b, _, _, b_start, _) in zip(ordered, ordered[1:], strict=False):
            if a_start + a_nbytes > b_start:
                raise self.fail(f"tensors {a!r} and {b!r} overlap in the file")


class _NeedMore(Exception):
    """The bytes at hand end inside the key/value section."""


class _PrefixParser(_HeaderParser):
    """A header parser over the first bytes of a file (a Range request's answer): every limit is checked
    against the whole file's size, and running out of the bytes at hand raises _NeedMore."""

    def __init__(self, name: str, data: bytes, total_size: int):
        super().__init__(Path(name), data, max(total_size, len(data)))  # type: ignore[arg-type]
        self.have = len(data)

    def need(self, n: int, what: str) -> None:
        super().need(n, what)
        if n > self.have - self.pos:
            raise _NeedMore(what)


def metadata_from_prefix(data: bytes, total_size: int | None, name: str) -> dict[str, Any] | None:
    """The key/value metadata of a GGUF file from its first bytes (no tensor infos are read).

    Args:
        data: the file's first bytes.
        total_size: the whole file's size when known (the limits a header may claim are checked against it).
        name: the file's name, for messages.

    Returns:
        The metadata; None when `data` ends before the key/value section does (fetch more bytes).

    Raises:
        ModelFormatError: the bytes are no GGUF v2/v3 header, or the header is invalid.
    """
    if len(data) < 4 + 4 + 8 + 8:
        if len(data) < (total_size or 0):
            return None
        raise ModelFormatError(Path(name), f"file is only {len(data)} bytes, too small to be a GGUF file")
    try:
        return _PrefixParser(name, data, total_size or MAX_HEADER_BYTES).parse_metadata()[2]
    except _NeedMore:
        return None
