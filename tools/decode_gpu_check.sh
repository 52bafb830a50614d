#!/usr/bin/env bash
# Issue 19 on one GPU in one call: install the carried wheel (dist/*/) and peers (.whl/), run the decode tests and
# the attention tests the decode routing touches, compute-sanitizer (memcheck, racecheck) on small decode calls,
# then the decode benchmark with the given arguments. Summary in $OUT/summary.txt.
#   bash tools/decode_gpu_check.sh [tests|bench|all] [bench_decode.py arguments...]
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
MODE=${1:-all}
shift || true
OUT=${OUT:-$PWD/decode_out}
CHECK_NAME=decode_gpu_check CHECK_ARGS="mode=$MODE"
source tools/gpu_site.sh  # $OUT, note(), status; the wheel from dist/, the working tree's Python, the peers
if [ "$MODE" != bench ]; then
  cd /tmp
  t0=$SECONDS
  timeout 300 python3 -m pytest -q -p no:cacheprovider -n 4 "$REPO/tests/test_decode.py" \
    "$REPO/tests/test_attention.py" "$REPO/tests/test_bench_decode.py" >"$OUT/pytest.log" 2>&1
  rc=$?; note "pytest (decode, attention): rc=$rc $(tail -1 "$OUT/pytest.log") ($((SECONDS - t0)) s)"; [ $rc -eq 0 ] || { status=1; grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20; }
  for tool in memcheck racecheck; do
    t0=$SECONDS
    filter=()
    timeout 200 compute-sanitizer --tool $tool "${filter[@]}" --error-exitcode 9 python3 "$REPO/tools/sanitize_small.py" \
      --decode-only >"$OUT/sanitizer-$tool.log" 2>&1
    rc=$?; note "compute-sanitizer $tool (decode): rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1) ($((SECONDS - t0)) s)"
    [ $rc -eq 0 ] || { status=1; tail -30 "$OUT/sanitizer-$tool.log"; }
  done
  cd "$REPO"
fi
if [ "$MODE" != tests ]; then
  t0=$SECONDS
  (cd /tmp && python3 "$REPO/benchmarks/bench_decode.py" --out "$OUT" "$@") >"$OUT/bench_decode.log" 2>&1
  rc=$?; note "bench_decode $*: rc=$rc ($((SECONDS - t0)) s)"
  grep -A200 "^# Decode benchmark" "$OUT/bench_decode.log" | head -120
fi
note "decode_gpu_check done: status=$status"
cat "$SUMMARY"
exit $status
