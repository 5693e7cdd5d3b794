#!/usr/bin/env bash
# One command on the GPU machine with the environment of scripts/cuda_device_check.sh (the carried
# .whl/ wheels installed, PYTHONPATH, offline, the Numba cache), everything it prints also in
# $OUT/run.log. For a targeted measurement between full checks, e.g.
#   run(command="bash scripts/cuda_device_run.sh python3 scripts/cuda_bench_1b.py --types Q4_K --out \$OUT/b.json",
#       carry=[".whl"])
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hearth-cuda-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
PY=${PYTHON:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hearth-site \
        .whl/*.whl || echo "wheel install failed"
    export PYTHONPATH=/tmp/hearth-site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
export PYTHONUNBUFFERED=1 HEARTH_CUDA_OFFLINE=1 NUMBA_CACHE_DIR=/tmp/hearth-numba
export HEARTH_TEST_MODELS=${HEARTH_TEST_MODELS:-/tmp/hearth-test-models}
date
bash -c "$*"
rc=$?
date
exit $rc
