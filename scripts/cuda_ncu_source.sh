#!/usr/bin/env bash
# On the GPU machine (after scripts/cuda_device_prepare.sh here; carry .whl): Nsight Compute's
# per-instruction view (SASS, stall samples) of the decode step's first matvec_qb/attn_decode launches
# (scripts/cuda_profile_step.py --ncu-quick: the prefill's last-token LM head, then layer 0's q|k|v,
# attention, wo, gate|up, down), as CSV: $OUT/ncu_source_<i>.csv, the details page in $OUT/ncu_details.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hearth-cuda-out}
mkdir -p "$OUT"
source scripts/cuda_device_env.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
[ -n "$NCU" ] || exit 0
REP=/tmp/hearth-src
rm -f "$REP.ncu-rep"
timeout ${NCU_TIMEOUT:-90} "$NCU" --clock-control none -k regex:"matvec_qb|attn_decode" --launch-count ${NCU_LAUNCHES:-6} \
    --import-source no --section SourceCounters --section SpeedOfLight --section LaunchStats --section Occupancy \
    --section WarpStateStats -o "$REP" \
    "$PY" scripts/cuda_profile_step.py --ncu-quick --out /tmp/unused.json > "$OUT/ncu_run.log" 2>&1
echo "ncu rc=$?"
"$NCU" --import "$REP.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
for i in $(seq 0 $(( ${NCU_LAUNCHES:-6} - 1 ))); do
    "$NCU" --import "$REP.ncu-rep" --page source --print-source sass --csv --launch-skip "$i" --launch-count 1 \
        > "$OUT/ncu_source_$i.csv" 2>&1 || echo "source page $i failed"
done
ls -la "$OUT"
