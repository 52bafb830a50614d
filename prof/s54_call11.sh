#!/usr/bin/env bash
# Session 54, call 11: bwd-preprocess-tile (the backward preprocess in the tile shape): test_gpu.py's reference,
# non-finite and deterministic cases with its wheel, then the backward A/B against main (dist/bwd-staging-free: the landed kernels) on three d128 rows.
set -u
cd "$(dirname "$0")/.."
repo=$PWD
name=bwd-preprocess-tile
export WHEEL=$(ls dist/$name/*.whl)
OUT=$OUT CHECK_NAME=s54_call11 CHECK_ARGS="main $name" source tools/gpu_site.sh >/dev/null 2>&1
t0=$SECONDS
(cd /tmp && timeout ${TEST_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -n 8 "$repo/tests/test_gpu.py" \
  -k "matches_reference or nonfinite or nan or deterministic or poisoned" > "$OUT/pytest_gpu.log" 2>&1)
echo "test_gpu: rc=$? $(tail -1 $OUT/pytest_gpu.log) ($((SECONDS - t0)) s)"; grep -E "FAILED|Error" "$OUT/pytest_gpu.log" | head -5
shapes=16x1024x16x128c,4x4096x16x128c,1x16384x16x128
OUT=$OUT/bwdab RUN_LIMIT=60 timeout ${AB_LIMIT:-160} bash tools/ab_bench.sh "bwd-staging-free $name" "$shapes" 2 > "$OUT/bwdab.log" 2>&1
echo "ab_bench rc=$?"; cat "$OUT/bwdab/ab_summary.txt" 2>/dev/null | tail -8
