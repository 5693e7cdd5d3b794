"""PyInstaller runtime hook, run before the entry point in every process of the bundle.

1. Bytecode of the modules shipped as .py files (the Numba kernels, see hearth.spec) is cached in
   the user cache dir (sys.pycache_prefix), never next to the sources in the install dir, which may
   be read-only and must stay as installed. The Numba JIT cache goes there too: engine/__init__
   sets NUMBA_CACHE_DIR to <user cache dir>/numba/<kernel source hash> on import.
2. The user's model library is seeded from a starter model inside the bundle.

Only the "with model" bundle variant has `_internal/starter/*.gguf`. On the first start the file is
copied (temp file, then rename) to where models.starter looks for it; models.starter then checks
its sha256 once, as for a downloaded copy. An existing copy is never touched; a failure (disk full,
read-only home) leaves nothing partial behind and the normal download path takes over.
"""


def _user_pycache() -> None:
    import sys

    from models.paths import cache_dir

    sys.pycache_prefix = str(cache_dir() / "pycache")
    sys.dont_write_bytecode = False  # the bootloader turns writing off; the prefix makes it safe


def _seed_starter() -> None:
    import os
    import shutil
    import sys
    import tempfile
    from pathlib import Path

    bundled = Path(getattr(sys, "_MEIPASS", "")) / "starter"
    if not bundled.is_dir():
        return
    from models.paths import models_dir

    for src in bundled.glob("*.gguf"):
        target = models_dir() / "starter" / src.name
        if target.exists():
            continue
        tmp = None
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{src.name}.", suffix=".partial", dir=target.parent)
            with os.fdopen(fd, "wb") as out, open(src, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
            os.replace(tmp, target)
            tmp = None
        except OSError as e:
            print(f"hearth: could not copy the bundled starter model ({e}); downloading it", file=sys.stderr)
        finally:
            if tmp:
                Path(tmp).unlink(missing_ok=True)


_user_pycache()
_seed_starter()
