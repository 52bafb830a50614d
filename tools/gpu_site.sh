# Sourced by the one-GPU check scripts (options_gpu_check.sh, decode_gpu_check.sh, bwd_gpu_check.sh), from the
# repository root, with OUT (results directory), CHECK_NAME and CHECK_ARGS (the summary's first line) set: creates
# $OUT and $OUT/summary.txt (SUMMARY), defines note() (echo and append to the summary) and status=0, installs the
# wheel carried in dist/*/ into /tmp/jf_site with the working tree's Python over it (not with WHEEL_PYTHON=1), the
# peers' wheels in .whl/
# (FA3-jax, tokamax and theirs) into /tmp/peer_site, and exports the PYTHONPATH and memory settings the tests and
# benchmarks run with.
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
note() { echo "$*" | tee -a "$SUMMARY"; }
note "$CHECK_NAME $(date -u +%Y-%m-%dT%H:%MZ) $CHECK_ARGS $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
status=0
wheel=${WHEEL:-$(ls dist/*/jax_flash-*-cp312-*.whl | head -1)}  # WHEEL: which carried wheel
note "wheel: $wheel"  # (without WHEEL, the first of dist/*/ in name order: session 50's call 9 got dist/base)
rm -rf /tmp/jf_site  # pip --target keeps an existing package: a warm machine would run the previous call's wheel
python3 -m pip install -q --no-index --no-deps --target /tmp/jf_site "$wheel" || exit 1
# The working tree's Python over the wheel's (Python edits after the wheel was built; tools/python_overlay.sh keeps
# the files a pending build's patches change), unless WHEEL_PYTHON=1: the wheel's own (A/B of builds whose Python
# differs, tools/decode_ab.sh).
[ "${WHEEL_PYTHON:-0}" = 1 ] || bash tools/python_overlay.sh "$(basename "$(dirname "$wheel")")" /tmp/jf_site/jax_flash
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peer_site .whl/*.whl || note "peer install failed"
fi
export PYTHONPATH=/tmp/jf_site:/tmp/peer_site:$PWD/.whl/stubs PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
