#!/usr/bin/env bash
# On a GPU machine: every kernel of one call and its device time (Nsight Compute, duration only, clocks as found),
# for each implementation named, at one shape: where a call's time goes beside the main kernel (small kernels, the
# combine, the backward's pre/post passes), and, against the benchmark's time per call, how much is launch gaps
# (Nsight Compute serialises kernels, so the sum is device time without gaps). The program is
# tools/profile_decode.py (a decode call), or SCRIPT's (tools/profile_packed.py: a packed training step); each takes
# --impl and --runs, and the other arguments pass through.
#   OUT=... bash tools/kernel_list.sh "jax_flash fa3_jax xla" --batch 1 --seqlen 131072 --tq 1 --heads 8 --kv-heads 1
#   OUT=... SCRIPT=tools/profile_packed.py bash tools/kernel_list.sh "packed rows unpacked" --batch 4 --tokens 8192
# Installs the carried wheel (dist/*/, WHEEL to choose) and the peers (.whl/) as the other GPU scripts do
# (tools/gpu_site.sh). Writes $OUT/kernels-<impl>.csv (ncu's raw list) and prints the last run's kernels per
# implementation (also into $OUT/summary.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/kernel_list_out}
read -r -a IMPLS <<<"$1"
shift
SCRIPT=${SCRIPT:-tools/profile_decode.py}
CHECK_NAME=kernel_list CHECK_ARGS="$SCRIPT ${IMPLS[*]} $*"
source tools/gpu_site.sh  # $OUT, note(), the wheel, the peers, PYTHONPATH
repo=$PWD
for impl in "${IMPLS[@]}"; do
  (cd /tmp && timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    python3 "$repo/$SCRIPT" --impl "$impl" --runs 3 "$@") >"$OUT/kernels-$impl.csv" 2>"$OUT/kernels-$impl.log" \
    || { echo "$impl: ncu failed"; tail -5 "$OUT/kernels-$impl.log"; continue; }
  python3 "$repo/tools/kernel_list.py" "$OUT/kernels-$impl.csv" --name "$impl $*" | tee -a "$SUMMARY"
done
