#!/usr/bin/env bash
# On the GPU machine, after scripts/cuda_device_prepare.sh here (carry .whl): where the decode step's time
# goes. scripts/cuda_profile_step.py op by op (Q4_K 1B shape), the SM clock every second meanwhile, and
# Nsight Compute's view of the first step's kernels where ncu can read the counters.
# Results in $OUT: profile_Q4_K.json, profile.log, clocks.log, ncu.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hearth-cuda-out}
mkdir -p "$OUT"
source scripts/cuda_device_env.sh
(while sleep 1; do nvidia-smi --query-gpu=clocks.sm,clocks.mem,utilization.gpu,power.draw --format=csv,noheader; done \
    > "$OUT/clocks.log" 2>&1 &)
timeout 100 "$PY" scripts/cuda_profile_step.py --out "$OUT/profile_Q4_K.json" 2>&1 | tee "$OUT/profile.log"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
STALLS=$(for r in long_scoreboard short_scoreboard mio_throttle lg_throttle barrier wait math_pipe_throttle \
    not_selected selected no_instruction membar drain dispatch_stall branch_resolving imc_miss tex_throttle; do
    printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$r"; done)
[ -n "$NCU" ] && timeout 90 "$NCU" --clock-control none -k regex:"matvec_qb|attn_decode|argmax" --launch-count 7 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    --section LaunchStats --metrics "${STALLS%,}" \
    "$PY" scripts/cuda_profile_step.py --ncu-quick --out /tmp/unused.json > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
tail -5 "$OUT/clocks.log"
