#!/usr/bin/env bash
# The segment-operands target on one GPU in one call: GPU tests that touch segment ids, compute-sanitizer on the
# target alone and on the attention calls with segment ids, the target's per-call time, and the packed step against
# main (A/B, main with its own Python).
#   OUT=... bash tools/segops_gpu_check.sh NAME   (NAME: the build in dist/NAME/)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
NAME=$1
OUT=${OUT:-$PWD/segops_out}
CHECK_NAME=segops_gpu_check CHECK_ARGS="build=$NAME"
WHEEL=$(ls dist/"$NAME"/jax_flash-*-cp312-*.whl) source tools/gpu_site.sh
# compute-sanitizer memcheck and racecheck over sanitize_small.py ARGS, on the kernels whose names hold KERNELS.
sanitize() {
  local kernels=$1; shift
  for tool in memcheck racecheck; do
    t0=$SECONDS
    log="$OUT/sanitizer-$tool-${kernels%_}.log"
    timeout 200 compute-sanitizer --tool $tool --kernel-name kns="$kernels" --error-exitcode 9 python3 \
      "$REPO/tools/sanitize_small.py" "$@" >"$log" 2>&1
    rc=$?; note "compute-sanitizer $tool ($*): rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1) ($((SECONDS - t0)) s)"
    [ $rc -eq 0 ] || { status=1; tail -30 "$log"; }
  done
}
cd /tmp
t0=$SECONDS
timeout 240 python3 -m pytest -q -x -p no:cacheprovider -n 4 "$REPO/tests/test_segments_sinks_softcap.py" \
  "$REPO/tests/test_kernel_choice.py" >"$OUT/pytest.log" 2>&1
rc=$?; note "pytest (segments, kernel choice): rc=$rc $(tail -1 "$OUT/pytest.log") ($((SECONDS - t0)) s)"
[ $rc -eq 0 ] || { status=1; tail -40 "$OUT/pytest.log"; }
sanitize segment_ --segment-ops-only  # the target alone
timeout 120 python3 "$REPO/tools/bench_segment_ops.py" 2>&1 | grep -v "^WARNING" | tee "$OUT/bench_segment_ops.txt"
cd "$REPO"
OUT=$OUT/ab WHEEL_PYTHON=main RUN_LIMIT=200 bash tools/packed_ab.sh "main $NAME" 2 --impls jax_flash 2>&1 | tail -12
# The attention calls with segment ids (sanitize_small.py's cases 7-9 on the default kernels), last: the longest.
cd /tmp; sanitize flash_ --cases 7:10 --decode-cases 0:0; cd "$REPO"
note "segops_gpu_check done: status=$status"
cat "$SUMMARY"
