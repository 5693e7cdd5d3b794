"""The ggml tensor type table: block size, bytes per block and name of every type id we accept.

The `gguf` package is the executable spec of these layouts (GGML_QUANT_SIZES); this module only turns
it into plain-int lookups so the container reader never trusts a number it has not checked.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# type id -> (elements per block, bytes per block); Q4_1 is (32, 20), F32 is (1, 4)
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    int(t): (int(bs), int(ts)) for t, (bs, ts) in GGML_QUANT_SIZES.items()
}

# type id -> name as ggml spells it ("Q4_1", "BF16", ...)
TYPE_NAMES: dict[int, str] = {int(t): t.name for t in GGMLQuantizationType}

# Types whose elements are plain machine numbers: a tensor of these can be viewed as a typed array.
# BF16 has no numpy dtype, so it is exposed as its raw 16-bit pattern.
PLAIN_DTYPES: dict[int, np.dtype] = {
    int(GGMLQuantizationType.F32): np.dtype("<f4"),
    int(GGMLQuantizationType.F16): np.dtype("<f2"),
    int(GGMLQuantizationType.BF16): np.dtype("<u2"),
    int(GGMLQuantizationType.F64): np.dtype("<f8"),
    int(GGMLQuantizationType.I8): np.dtype("i1"),
    int(GGMLQuantizationType.I16): np.dtype("<i2"),
    int(GGMLQuantizationType.I32): np.dtype("<i4"),
    int(GGMLQuantizationType.I64): np.dtype("<i8"),
}


def type_name(ggml_type: int) -> str:
    """Name of a ggml type id, or "type <id>" when the id is unknown (for error messages)."""
    return TYPE_NAMES.get(ggml_type, f"type {ggml_type}")


def is_known(ggml_type: int) -> bool:
    """True when the id is a ggml type whose block layout we know."""
    return ggml_type in BLOCK_SIZES and ggml_type in TYPE_NAMES


def row_nbytes(ggml_type: int, ne0: int) -> int:
    """Bytes of one row of `ne0` elements; ne0 must be a multiple of the type's block size."""
    block, size = BLOCK_SIZES[ggml_type]
    if ne0 % block:
        raise ValueError(f"{type_name(ggml_type)} rows need a multiple of {block} elements, got {ne0}")
    return ne0 // block * size
