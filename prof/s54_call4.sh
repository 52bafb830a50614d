#!/usr/bin/env bash
# Session 54, call 4: bwd-staging-free (the d128 backward's unit-end wait for the dK/dV stores moved to the next unit):
# its backward GPU tests, the backward A/B against main on the d128 rows, then (PACKED=1) the packed step's A/B.
set -u
cd "$(dirname "$0")/.."
repo=$PWD
name=${NAME:-bwd-staging-free}
export WHEEL=$(ls dist/$name/*.whl)
OUT=$OUT CHECK_NAME=s54_call4 CHECK_ARGS="main $name" source tools/gpu_site.sh >/dev/null 2>&1
if [ "${TESTS:-1}" = 1 ]; then
  t0=$SECONDS
  (cd /tmp && timeout ${TEST_LIMIT:-170} python3 -m pytest -q -x -p no:cacheprovider -n 8 "$repo/tests/test_gpu.py" \
    -k "backward or grad or deterministic or reference" > "$OUT/pytest_gpu.log" 2>&1)
  echo "test_gpu: rc=$? $(tail -1 $OUT/pytest_gpu.log) ($((SECONDS - t0)) s)"
fi
if [ "${AB:-1}" = 1 ]; then
  shapes=${SHAPES:-16x1024x16x128c,16x1024x16x128,4x4096x16x128c,1x16384x16x128,2x8192x32/8x128c}
  OUT=$OUT/bwdab RUN_LIMIT=100 timeout ${AB_LIMIT:-260} bash tools/ab_bench.sh "main $name" "$shapes" ${ROUNDS:-2} \
    > "$OUT/bwdab.log" 2>&1
  echo "ab_bench rc=$?"; cat "$OUT/bwdab/ab_summary.txt" 2>/dev/null | tail -12
fi
if [ "${PACKED:-0}" = 1 ]; then
  OUT=/tmp/packedab timeout ${PACKED_LIMIT:-250} bash tools/packed_ab.sh "main $name" 2 > "$OUT/packedab.log" 2>&1
  echo "packed_ab rc=$?"; cp /tmp/packedab/packed_ab.txt "$OUT/" 2>/dev/null; tail -12 /tmp/packedab/packed_ab.txt
fi
