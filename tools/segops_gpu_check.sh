#!/usr/bin/env bash
# The segment-operands target on one GPU in one call: GPU tests that touch segment ids, compute-sanitizer on the
# target alone, its per-call time, and the packed step against main (A/B, main with its own Python).
#   OUT=... bash tools/segops_gpu_check.sh NAME   (NAME: the build in dist/NAME/)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
NAME=$1
OUT=${OUT:-$PWD/segops_out}
CHECK_NAME=segops_gpu_check CHECK_ARGS="build=$NAME"
WHEEL=$(ls dist/"$NAME"/jax_flash-*-cp312-*.whl) source tools/gpu_site.sh
cd /tmp
t0=$SECONDS
timeout 240 python3 -m pytest -q -x -p no:cacheprovider -n 4 "$REPO/tests/test_segments_sinks_softcap.py" \
  "$REPO/tests/test_kernel_choice.py" >"$OUT/pytest.log" 2>&1
rc=$?; note "pytest (segments, kernel choice): rc=$rc $(tail -1 "$OUT/pytest.log") ($((SECONDS - t0)) s)"
[ $rc -eq 0 ] || { status=1; tail -40 "$OUT/pytest.log"; }
for tool in memcheck racecheck; do
  t0=$SECONDS
  timeout 120 compute-sanitizer --tool $tool --kernel-name kns=segment_ --error-exitcode 9 python3 \
    "$REPO/tools/sanitize_small.py" --segment-ops-only >"$OUT/sanitizer-$tool.log" 2>&1
  rc=$?; note "compute-sanitizer $tool (segment_operands): rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1) ($((SECONDS - t0)) s)"
  [ $rc -eq 0 ] || { status=1; tail -30 "$OUT/sanitizer-$tool.log"; }
done
timeout 120 python3 "$REPO/tools/bench_segment_ops.py" 2>&1 | grep -v "^WARNING" | tee "$OUT/bench_segment_ops.txt"
cd "$REPO"
OUT=$OUT/ab WHEEL_PYTHON=main RUN_LIMIT=200 bash tools/packed_ab.sh "main $NAME" 2 --impls jax_flash 2>&1 | tail -12
note "segops_gpu_check done: status=$status"
cat "$SUMMARY"
