# Sourced (from the repository root) by the GPU machine's scripts: the wheels carried in .whl/
# (scripts/cuda_device_prepare.sh) installed to /tmp/hearth-site, and the environment they run in.
export PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hearth-site \
        .whl/*.whl || echo "wheel install failed"
    export PYTHONPATH=/tmp/hearth-site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export PYTHONUNBUFFERED=1 HEARTH_CUDA_OFFLINE=1 NUMBA_CACHE_DIR=/tmp/hearth-numba
export HEARTH_TEST_MODELS=${HEARTH_TEST_MODELS:-/tmp/hearth-test-models}
