"""Compute on weights: kernels, architectures, KV cache, sampling, generation, CLI.

Importing this package points Numba's on-disk JIT cache at the user cache dir (not the
install dir, which may be read-only), or at HEARTH_KERNEL_CACHE, in a folder named after the
kernel sources' hash; unless NUMBA_CACHE_DIR is already set.
"""

import os as _os


def kernel_source_hash() -> str:
    """Hash of the CPU backend's sources.

    Numba's cache checks only the kernel's own file, not the LLVM helper modules it calls into, so
    the cache folder is keyed by all of them: a change anywhere can never run stale machine code.
    """
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    for path in sorted((Path(__file__).parent / "backends" / "cpu").glob("*.py")):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


if "NUMBA_CACHE_DIR" not in _os.environ:
    from models.paths import cache_dir as _cache_dir

    _root = _os.environ.get("HEARTH_KERNEL_CACHE") or str(_cache_dir() / "numba")
    _os.environ["NUMBA_CACHE_DIR"] = _os.path.join(_root, kernel_source_hash())
