#!/usr/bin/env bash
# The CUDA backend's GPU check, in one call on the GPU machine (at most ~6.5 minutes, usually less):
#   1. scripts/cuda_bench_1b.py, one process per type: a random Llama-3.2-1B-shaped model in Q4_K and Q8_0,
#      decode tok/s and fraction of peak memory bandwidth for the graph path and the fused persistent step
#      (the fused one checked against the graph one, plus two of its knobs), prefill at 512 tokens against
#      cuBLAS float16 GEMMs with a breakdown (linears vs attention);
#   2. the fast GPU tests (-m "cuda and not slow": kernel parity with the CPU kernels, decoder and
#      partial-offload parity on tiny llama/qwen2/gemma3 files, the chat runner and the server engine on
#      the GPU, bench, fallback), then the fused step's GPU tests in a process of their own;
#   3. the slow ones (the starter models, when they are cached there: decoder and partial-offload parity).
# Results: $OUT/cuda_results.json (bench figures + test summary), $OUT/cuda_check.log (everything
# printed), $OUT/cuda_tests.xml, cuda_tests_fused.xml and cuda_tests_slow.xml (JUnit).
#
# The GPU machine's python3 has CuPy, numba, numpy, tokenizers, jinja2, pytest but not gguf,
# platformdirs, starlette, uvicorn or llguidance: run scripts/cuda_device_prepare.sh here first (wheels into .whl/),
# then e.g.
#   run(command="bash scripts/cuda_device_check.sh", carry=[".whl"], timeout_s=420)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hearth-cuda-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/cuda_check.log") 2>&1
source scripts/cuda_device_env.sh
date
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
"$PY" -c "import cupy, numba, numpy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount(), 'numba', numba.__version__, 'numpy', numpy.__version__)"

# the benchmark first (the Must-reach figures), then the fast GPU tests, then the slow ones: a run cut
# short by the device budget still has the figures
echo "== 1B-shape benchmark"
# one process per type: a fault in one (the fused kernel's, say) cannot take the other's figures along
BENCH_RC=0
for t in Q4_K Q8_0; do
    timeout 100 "$PY" scripts/cuda_bench_1b.py --types "$t" --out "$OUT/bench_$t.json" --workdir /tmp/hearth-1b
    rc=$?
    echo "bench $t rc=$rc"
    [ "$rc" -eq 0 ] || BENCH_RC=$rc
done

echo "== CUDA tests (fast; the fused step's come next, in a process of their own)"
# four processes when pytest-xdist is there: most of this part's time is Numba compiling the CPU references
XDIST=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 4")
timeout 180 "$PY" -m pytest -q -p no:cacheprovider $XDIST -m "cuda and not slow" -k "not fused" tests/engine/cuda -rs \
    --durations=10 --junitxml="$OUT/cuda_tests.xml"
TEST_RC=$?
echo "fast tests rc=$TEST_RC"

echo "== CUDA tests (the fused decode step)"
timeout 90 "$PY" -m pytest -q -p no:cacheprovider -m "cuda" -k "fused" tests/engine/cuda -rs --durations=10 \
    --junitxml="$OUT/cuda_tests_fused.xml"
FUSED_RC=$?
echo "fused tests rc=$FUSED_RC"

echo "== CUDA tests (slow: starter models, when cached here)"
timeout 45 "$PY" -m pytest -q -p no:cacheprovider -m "cuda and slow" -k "not fused" tests/engine/cuda -rs \
    --durations=10 --junitxml="$OUT/cuda_tests_slow.xml"
SLOW_RC=$?
echo "slow tests rc=$SLOW_RC"

"$PY" - "$OUT" "$TEST_RC" "$BENCH_RC" "$SLOW_RC" "$FUSED_RC" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
out, test_rc, bench_rc, slow_rc = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
fused_rc = int(sys.argv[5])
res_path = out / "cuda_results.json"
res = {"models": {}}
for part in sorted(out.glob("bench_*.json")):
    got = json.loads(part.read_text())
    res["models"].update(got.pop("models", {}))
    res.update(got)


def junit(name: str, rc: int) -> dict:
    summary = {"rc": rc}
    try:
        suite = ET.parse(out / name).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        summary.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        summary["failed"] = [
            f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
            if c.find("failure") is not None or c.find("error") is not None
        ]
    except Exception as e:  # noqa: BLE001
        summary["junit_error"] = repr(e)
    return summary


res["tests"] = junit("cuda_tests.xml", test_rc)
res["slow_tests"] = junit("cuda_tests_slow.xml", slow_rc)
res["fused_tests"] = junit("cuda_tests_fused.xml", fused_rc)
res["bench_rc"] = bench_rc
res_path.write_text(json.dumps(res, indent=2))
print(json.dumps(res, indent=2))
PYEOF
date
exit $(( TEST_RC != 0 || BENCH_RC != 0 || SLOW_RC != 0 || FUSED_RC != 0 ))
