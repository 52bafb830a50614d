#!/usr/bin/env bash
# Build (or install a carried wheel), run the whole test suite on the GPU, compute-sanitizer on small shapes, and
# a short benchmark; write everything under $OUT (default ./gpu_check_out) and print a summary last.
#   bash tools/gpu_check.sh [quick|full|tests|bench|dev]
# quick: all tests + sanitizers + a short benchmark; full: the same with the whole benchmark matrix; tests, bench:
# one half; dev (kernel work): tests/test_gpu.py without the slow tests, sanitizers and the short benchmark.
# On compute capability 9.0 the GPU tests also rerun on the sm_80-class kernels (JAX_FLASH_FORCE_SM80), unless
# SKIP_SM80=1.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-quick}
OUT=${OUT:-$PWD/gpu_check_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

note "gpu_check $(date -u +%Y-%m-%dT%H:%MZ) mode=$MODE"
note "$(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>/dev/null | head -1)"
note "$(python3 -c 'import jax, sys; print("python", sys.version.split()[0], "jax", jax.__version__, jax.devices())')"

# 1. Install: a carried cp312 wheel from dist/ if present (built off the GPU clock), else build here.
wheel=$(ls dist/jax_flash-*-cp312-*.whl dist/*/jax_flash-*-cp312-*.whl 2>/dev/null | head -1)
if [ -n "$wheel" ]; then
  rm -rf /tmp/jf_site  # pip --target keeps an existing package (a warm machine)
  python3 -m pip install -q --no-index --no-deps --target /tmp/jf_site "$wheel" || exit 1
  export PYTHONPATH=/tmp/jf_site${PYTHONPATH:+:$PYTHONPATH}
  note "installed $wheel"
else
  t0=$SECONDS
  JAX_FLASH_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 || {
    tail -40 "$OUT/build.log"; exit 1; }
  note "built from source in $((SECONDS - t0)) s"
fi
(cd /tmp && python3 -c 'import jax_flash; print("jax_flash", jax_flash.__version__, "cuda:", jax_flash.cuda_available())') | tee -a "$SUMMARY"

status=0
# 2. Tests (plain pytest so the source tree does not shadow the installed package). Where pytest-xdist is installed
# (the GPU image has it) PYTEST_WORKERS processes share the GPU: compilation and the references are CPU-bound, so
# the suite finishes in a fraction of the time. Where pytest-timeout is installed a test that runs past
# TEST_TIMEOUT seconds (a kernel that hangs) fails alone instead of holding the whole run; PYTEST_LIMIT bounds
# the whole suite.
# -v, each line stamped with its second: a run cut by PYTEST_LIMIT still names every test that failed (-q's dots do
# not). The whole not-slow suite takes more than one 600 s device call with 8 workers (session 78): TESTS="..." runs
# a part of it (module paths), e.g. TESTS="tests/test_decode.py tests/test_gpu.py" in one call and the rest in
# the next.
pytest_args=(-v -x -p no:cacheprovider)
if python3 -c "import xdist" 2>/dev/null; then pytest_args+=(-n "${PYTEST_WORKERS:-4}"); fi
if python3 -c "import pytest_timeout" 2>/dev/null; then
  pytest_args+=(--timeout "${TEST_TIMEOUT:-150}" --timeout-method thread)
fi
if [ "$MODE" != bench ]; then
  note "pytest ${pytest_args[*]}"
  t0=$SECONDS
  if [ "$MODE" = dev ]; then
    read -r -a tests <<<"${TESTS:-tests/test_gpu.py}"
    selection=(-m "not slow")
  else
    read -r -a tests <<<"${TESTS:-tests}"
    selection=()
  fi
  timeout "${PYTEST_LIMIT:-540}" pytest "${pytest_args[@]}" "${selection[@]}" "${tests[@]}" 2>&1 |
    while IFS= read -r line; do echo "$((SECONDS - t0)) $line"; done >"$OUT/pytest.log"
  rc=${PIPESTATUS[0]}
  grep -E " (FAILED|ERROR) " "$OUT/pytest.log" | head -20
  note "pytest: rc=$rc $(grep -c ' PASSED ' "$OUT/pytest.log") passed, $(grep -c ' SKIPPED ' "$OUT/pytest.log") skipped,"\
" $(grep -c -E ' (FAILED|ERROR) ' "$OUT/pytest.log") failed ($((SECONDS - t0)) s); last: $(tail -1 "$OUT/pytest.log")"
  [ $rc -eq 0 ] || status=1
  # On Hopper the forward runs the sm_90a kernel; check the sm_80-class kernels there too.
  # SKIP_SM80=1 skips this when a change cannot reach those kernels (device time is scarce).
  if [ "$MODE" != dev ] && [ "${SKIP_SM80:-0}" != 1 ] &&
     [ "$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1)" = "9.0" ]; then
    for force in 1 small-smem; do
      t0=$SECONDS
      JAX_FLASH_FORCE_SM80=$force timeout "${PYTEST_LIMIT:-540}" pytest "${pytest_args[@]}" tests/test_gpu.py \
        -m "not slow" 2>&1 |
        tee "$OUT/pytest-sm80-$force.log" | tail -5
      rc=${PIPESTATUS[0]}
      note "pytest (JAX_FLASH_FORCE_SM80=$force, tests/test_gpu.py): rc=$rc $(tail -1 "$OUT/pytest-sm80-$force.log") ($((SECONDS - t0)) s)"
      [ $rc -eq 0 ] || status=1
    done
  fi
  # memcheck instruments every kernel of the run; racecheck (slow) only ours.
  for tool in memcheck racecheck; do
    t0=$SECONDS
    filter=()
    [ $tool = racecheck ] && filter=(--kernel-name kns=flash_)
    (cd /tmp && compute-sanitizer --tool $tool "${filter[@]}" --error-exitcode 9 \
        python3 "$OLDPWD/tools/sanitize_small.py") >"$OUT/sanitizer-$tool.log" 2>&1
    rc=$?
    note "compute-sanitizer $tool: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitizer-$tool.log" | tail -1) ($((SECONDS - t0)) s)"
    [ $rc -eq 0 ] || { status=1; tail -30 "$OUT/sanitizer-$tool.log"; }
  done
fi

# 3. Benchmark.
if [ "$MODE" != tests ]; then
  flag=--quick
  [ "$MODE" = full ] && flag=
  (cd /tmp && python3 "$OLDPWD/benchmarks/bench_attention.py" $flag --out "$OUT") 2>&1 | tee "$OUT/bench.log" | tail -30
fi
note "gpu_check done: status=$status"
cat "$SUMMARY"
exit $status
