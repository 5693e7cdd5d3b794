#!/usr/bin/env bash
# Run here (with network) before scripts/cuda_device_check.sh: the pure-Python wheels the GPU
# machine's python3 lacks (gguf, platformdirs; starlette, uvicorn and llguidance for the
# server's tests) go to .whl/
# (ignored through .git/info/exclude), to be carried there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PIP=${PIP:-.venv/bin/pip}
mkdir -p .whl
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
PLATFORMS=(--platform manylinux2014_x86_64)
for n in 17 24 27 28 31 34 35 38 39; do PLATFORMS+=(--platform "manylinux_2_${n}_x86_64"); done
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" -d .whl \
    "gguf==$(version gguf)" "platformdirs==$(version platformdirs)" "starlette==$(version starlette)" \
    "uvicorn==$(version uvicorn)" "llguidance==$(version llguidance)"
ls -la .whl
