#!/usr/bin/env bash
# Run here (with network) before scripts/cuda_device_check.sh: the pure-Python wheels the GPU
# machine's python3 lacks (gguf, platformdirs; starlette and uvicorn for the server's tests) go to .whl/
# (ignored through .git/info/exclude), to be carried there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PIP=${PIP:-.venv/bin/pip}
mkdir -p .whl
"$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
    "gguf==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
    "platformdirs==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("platformdirs"))')" \
    "starlette==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("starlette"))')" \
    "uvicorn==$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("uvicorn"))')"
ls -la .whl
