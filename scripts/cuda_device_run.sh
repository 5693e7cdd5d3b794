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
source scripts/cuda_device_env.sh
date
bash -c "$*"
rc=$?
date
exit $rc
