"""Helpers shared by the container-reader tests."""

from __future__ import annotations

import mmap

import numpy as np


def ends_in_mmap(arr: np.ndarray) -> bool:
    """True when the array's base chain ends in a memory map (numpy wraps it in a memoryview)."""
    base = arr
    while isinstance(base, np.ndarray):
        if base.flags.owndata:
            return False
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return isinstance(base, mmap.mmap)
