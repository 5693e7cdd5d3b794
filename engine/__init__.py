"""Compute on weights: kernels, architectures, KV cache, sampling, generation, CLI.

Importing this package points Numba's on-disk JIT cache at the user cache dir (not the
install dir, which may be read-only), unless NUMBA_CACHE_DIR is already set.
"""

import os as _os

if "NUMBA_CACHE_DIR" not in _os.environ:
    from models.paths import cache_dir as _cache_dir

    _os.environ["NUMBA_CACHE_DIR"] = str(_cache_dir() / "numba")
