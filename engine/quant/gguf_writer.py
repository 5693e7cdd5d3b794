"""Write GGUF v3 files: metadata, tensor infos, then tensor data streamed one tensor at a time.

The header (and so every tensor's offset) is known before any data is encoded, because a tensor's
byte size follows from its type and shape; the writer checks that each tensor handed to it has
exactly the announced size. Value types follow what llama.cpp expects: ints as UINT32 (INT32/INT64
when negative or large), floats as FLOAT32, numpy arrays keep their dtype; a caller may pin a key's
type with `value_types` (e.g. the types read from a source GGUF).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any, BinaryIO

import numpy as np

from models.formats.ggml_types import row_nbytes, type_name

ALIGNMENT = 32
# GGUF value type ids
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_NP_TYPES = {
    np.dtype("u1"): U8,
    np.dtype("i1"): I8,
    np.dtype("<u2"): U16,
    np.dtype("<i2"): I16,
    np.dtype("<u4"): U32,
    np.dtype("<i4"): I32,
    np.dtype("<f4"): F32,
    np.dtype("?"): BOOL,
    np.dtype("<u8"): U64,
    np.dtype("<i8"): I64,
    np.dtype("<f8"): F64,
}
_PACK = {
    U8: "<B",
    I8: "<b",
    U16: "<H",
    I16: "<h",
    U32: "<I",
    I32: "<i",
    F32: "<f",
    BOOL: "<?",
    U64: "<Q",
    I64: "<q",
    F64: "<d",
}
_NP_OF = {v: k for k, v in _NP_TYPES.items()}


def _str(s: str) -> bytes:
    b = s.encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(b)) + b


def _scalar_type(v: Any) -> int:
    if isinstance(v, (bool, np.bool_)):
        return BOOL
    if isinstance(v, (int, np.integer)):
        v = int(v)
        if 0 <= v < 2**32:
            return U32
        if -(2**31) <= v < 0:
            return I32
        return I64 if v < 2**63 else U64
    if isinstance(v, (float, np.floating)):
        return F32
    if isinstance(v, str):
        return STRING
    raise TypeError(f"cannot store {type(v).__name__} in GGUF metadata")


def encode_value(v: Any, vtype: int | None = None, elem_type: int | None = None) -> bytes:
    """(type id + payload) bytes of one metadata value."""
    if isinstance(v, np.ndarray):
        et = elem_type if elem_type is not None else _NP_TYPES.get(v.dtype.newbyteorder("<"))
        if v.dtype == np.bool_:
            et = BOOL
        if et is None:
            raise TypeError(f"cannot store a {v.dtype} array in GGUF metadata")
        data = np.ascontiguousarray(v, dtype=_NP_OF[et] if et != BOOL else np.uint8).tobytes()
        return struct.pack("<IIQ", ARRAY, et, v.size) + data
    if isinstance(v, (list, tuple)):
        if not v:
            return struct.pack("<IIQ", ARRAY, elem_type if elem_type is not None else STRING, 0)
        if all(isinstance(x, str) for x in v):
            return struct.pack("<IIQ", ARRAY, STRING, len(v)) + b"".join(_str(x) for x in v)
        if all(isinstance(x, (list, tuple, np.ndarray)) for x in v):
            return struct.pack("<IIQ", ARRAY, ARRAY, len(v)) + b"".join(encode_value(x)[4:] for x in v)
        et = (
            elem_type
            if elem_type is not None
            else max((_scalar_type(x) for x in v), key=lambda t: (t == F32, t == I64, t == I32))
        )
        return encode_value(
            np.asarray(v, dtype=_NP_OF[et]) if et != BOOL else np.asarray(v, bool), elem_type=et
        )
    t = vtype if vtype is not None else _scalar_type(v)
    if t == STRING:
        return struct.pack("<I", STRING) + _str(v)
    return struct.pack("<I", t) + struct.pack(_PACK[t], v)


class GGUFWriter:
    """Streams one GGUF file to an open binary file object.

    Usage: `w = GGUFWriter(fh, metadata, [(name, ggml_type, numpy_shape), ...])`, `w.write_header()`,
    then `w.write_tensor(name, raw)` for each tensor in the announced order, then `w.finish()`.
    """

    def __init__(
        self,
        fh: BinaryIO,
        metadata: dict[str, Any],
        tensors: Iterable[tuple[str, int, tuple[int, ...]]],
        value_types: dict[str, tuple[int, int | None]] | None = None,
    ):
        self.fh = fh
        self.metadata = dict(metadata)
        self.metadata.pop("general.alignment", None)
        self.value_types = value_types or {}
        self.tensors = [(n, int(t), tuple(int(d) for d in s)) for n, t, s in tensors]
        self.offsets: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        off = 0
        for name, t, shape in self.tensors:
            n_rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            nbytes = row_nbytes(t, shape[-1]) * n_rows
            self.offsets[name] = off
            self.sizes[name] = nbytes
            off += -(-nbytes // ALIGNMENT) * ALIGNMENT
        self.data_size = off
        self._next = 0
        self._data_start = 0

    def header_bytes(self) -> bytes:
        parts = [b"GGUF", struct.pack("<IQQ", 3, len(self.tensors), len(self.metadata) + 1)]
        parts.append(_str("general.alignment") + encode_value(ALIGNMENT, U32))
        for key, value in self.metadata.items():
            vt, et = self.value_types.get(key, (None, None))
            if isinstance(value, (list, tuple, np.ndarray)):
                parts.append(_str(key) + encode_value(value, elem_type=et))
            else:
                parts.append(_str(key) + encode_value(value, vt if vt not in (ARRAY, None) else None))
        for name, t, shape in self.tensors:
            dims = tuple(reversed(shape))  # ggml order: ne0 first
            parts.append(
                _str(name)
                + struct.pack("<I", len(dims))
                + struct.pack(f"<{len(dims)}Q", *dims)
                + struct.pack("<IQ", t, self.offsets[name])
            )
        head = b"".join(parts)
        return head + b"\0" * (-len(head) % ALIGNMENT)

    def write_header(self) -> None:
        head = self.header_bytes()
        self.fh.write(head)
        self._data_start = len(head)

    @property
    def total_size(self) -> int:
        """Size of the whole file (header + data)."""
        return len(self.header_bytes()) + self.data_size

    def write_tensor(self, name: str, raw: np.ndarray) -> None:
        """Write the next tensor's bytes (uint8, exactly its announced size)."""
        expected, t, _ = self.tensors[self._next]
        if name != expected:
            raise ValueError(f"tensor {name!r} written out of order (expected {expected!r})")
        data = memoryview(np.ascontiguousarray(raw)).cast("B")
        if data.nbytes != self.sizes[name]:
            raise ValueError(f"{name}: {data.nbytes} bytes given, {type_name(t)} needs {self.sizes[name]}")
        self.fh.write(data)
        pad = -data.nbytes % ALIGNMENT
        if pad:
            self.fh.write(b"\0" * pad)
        self._next += 1

    def finish(self) -> None:
        if self._next != len(self.tensors):
            raise ValueError(f"only {self._next} of {len(self.tensors)} tensors were written")
        self.fh.flush()
