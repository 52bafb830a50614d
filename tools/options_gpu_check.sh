#!/usr/bin/env bash
# Issue 18 on one GPU in one call: install the carried wheel (dist/*/) and peers (.whl/), run the GPU tests that
# touch segment ids / sinks / soft cap (default kernels and sm_80-class), compute-sanitizer on the small shapes,
# then (bench) the packed / modifiers benchmark. Summary in $OUT/summary.txt.
#   bash tools/options_gpu_check.sh [tests|bench|all]
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODE=${1:-all}
OUT=${OUT:-$PWD/options_out}
CHECK_NAME=options_gpu_check CHECK_ARGS="mode=$MODE"
source tools/gpu_site.sh  # $OUT, note(), status; the wheel from dist/, the working tree's Python, the peers
if [ "$MODE" != bench ]; then
  cd /tmp
  t0=$SECONDS
  timeout 330 python3 -m pytest -q -x -p no:cacheprovider -n 4 "$REPO/tests/test_segments_sinks_softcap.py" \
    "$REPO/tests/test_kernel_choice.py" "$REPO/tests/test_offsets.py" "$REPO/tests/test_nonfinite.py" \
    "$REPO/tests/test_gpu.py" -m "not slow" >"$OUT/pytest.log" 2>&1
  rc=$?; note "pytest (default kernels): rc=$rc $(tail -1 "$OUT/pytest.log") ($((SECONDS - t0)) s)"; [ $rc -eq 0 ] || { status=1; tail -40 "$OUT/pytest.log"; }
  t0=$SECONDS
  JAX_FLASH_FORCE_SM80=1 timeout 150 python3 -m pytest -q -x -p no:cacheprovider -n 4 \
    "$REPO/tests/test_segments_sinks_softcap.py" >"$OUT/pytest-sm80.log" 2>&1
  rc=$?; note "pytest (sm80 forced, options): rc=$rc $(tail -1 "$OUT/pytest-sm80.log") ($((SECONDS - t0)) s)"; [ $rc -eq 0 ] || { status=1; tail -40 "$OUT/pytest-sm80.log"; }
  for tool in memcheck racecheck; do
    t0=$SECONDS
    filter=(); [ $tool = racecheck ] && filter=(--kernel-name kns=flash_)
    timeout 240 compute-sanitizer --tool $tool "${filter[@]}" --error-exitcode 9 python3 "$REPO/tools/sanitize_small.py" \
      >"$OUT/sanitizer-$tool.log" 2>&1
    rc=$?; note "compute-sanitizer $tool: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1) ($((SECONDS - t0)) s)"
    [ $rc -eq 0 ] || { status=1; tail -30 "$OUT/sanitizer-$tool.log"; }
  done
  cd "$REPO"
fi
if [ "$MODE" != tests ]; then
  (cd /tmp && timeout 420 python3 "$REPO/benchmarks/bench_packed.py" --out "$OUT") 2>&1 | tee "$OUT/bench_packed.log" | tail -40
  note "bench_packed: rc=${PIPESTATUS[0]}"
fi
note "options_gpu_check done: status=$status"
cat "$SUMMARY"
exit $status
