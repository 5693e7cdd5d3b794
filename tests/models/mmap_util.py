"""Helpers shared by the container-reader tests."""

from __future__ import annotations

import mmap

import numpy as np


def header_corruptions(blob: bytes, header_end: int, count: int = 400, seed: int = 7):
    """Yield `count` seeded copies of `blob` with 1-3 random bytes of its header overwritten."""
    rnd = np.random.default_rng(seed)
    for _ in range(count):
        b = bytearray(blob)
        for pos in rnd.integers(0, header_end, rnd.integers(1, 4)):
            b[pos] = rnd.integers(0, 256)
        yield bytes(b)


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
