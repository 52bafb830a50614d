#!/usr/bin/env bash
# On a machine with several GPUs: install a carried wheel (dist/*/jax_flash-*-cp312-*.whl) or build, run the
# multi-GPU tests (tests/test_sharding.py and tests/test_ring.py in bfloat16 on 2 GPUs, the ring's transfer/kernel
# overlap in the scheduled HLO), then examples/llama_block.py --mode multi; everything under $OUT, summary last.
#   bash tools/multi_gpu_check.sh [tests|bench|all] [extra llama_block.py arguments]
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
shift || true
OUT=${OUT:-$PWD/multi_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

note "multi_gpu_check $(date -u +%Y-%m-%dT%H:%MZ) mode=$MODE"
nvidia-smi -L | tee -a "$SUMMARY"
nvidia-smi topo -m >"$OUT/topology.txt" 2>&1
wheel=$(ls dist/*/jax_flash-*-cp312-*.whl dist/jax_flash-*-cp312-*.whl 2>/dev/null | head -1)
if [ -n "$wheel" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/jf_site "$wheel" || exit 1
  export PYTHONPATH=/tmp/jf_site${PYTHONPATH:+:$PYTHONPATH}
  note "installed $wheel"
else
  JAX_FLASH_CUDA=ON python3 -m pip install -q --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1 || {
    tail -40 "$OUT/build.log"; exit 1; }
  note "built from source"
fi
(cd /tmp && python3 -c 'import jax, jax_flash; print("jax", jax.__version__, "jax_flash", jax_flash.__version__, "cuda:", jax_flash.cuda_available(), jax.devices())') | tee -a "$SUMMARY"

status=0
if [ "$MODE" != bench ]; then
  t0=$SECONDS
  mkdir -p "$OUT/hlo-default" "$OUT/hlo-lhs"
  JAX_FLASH_CHECK_DUMP="$OUT/hlo-default" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${PYTEST_LIMIT:-400}" \
    pytest -q -p no:cacheprovider -p no:xdist -rfs tests/test_sharding.py tests/test_ring.py -k gpu 2>&1 |
    tee "$OUT/pytest-multi.log" | tail -15
  rc=${PIPESTATUS[0]}
  note "pytest (2-GPU cases of test_sharding, test_ring): rc=$rc $(tail -1 "$OUT/pytest-multi.log") ($((SECONDS - t0)) s)"
  [ $rc -eq 0 ] || status=1
  # The ring's transfer/kernel overlap again with XLA's latency-hiding scheduler (what llama_block --mode multi runs).
  out=$(cd /tmp && JAX_FLASH_CHECK_DUMP="$OUT/hlo-lhs" JAX_FLASH_CHECK_MESH=1x2 JAX_FLASH_CHECK_DTYPE=bfloat16 \
    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true \
    python3 -P "$OLDPWD/tests/ring_check.py" overlap-contiguous overlap-zigzag 2>&1 | tail -1)
  note "ring overlap with the latency-hiding scheduler: ${out:0:3000}"
fi
if [ "$MODE" != tests ]; then
  t0=$SECONDS
  # With XLA's latency-hiding scheduler (the example's default), then without it (XLA's default).
  for lhs in latency-hiding no-latency-hiding; do
    t0=$SECONDS
    timeout "${BENCH_LIMIT:-240}" python3 examples/llama_block.py --mode multi --out "$OUT" --$lhs \
      --dump-hlo "$OUT/hlo-bench-$lhs" "$@" 2>&1 | tee "$OUT/llama_multi-$lhs.log" | tail -40
    rc=${PIPESTATUS[0]}
    note "llama_block --mode multi --$lhs: rc=$rc ($((SECONDS - t0)) s)"
    mv "$OUT"/llama_multi-*-x*-????-??-??.json "$OUT/llama_multi-$lhs.json" 2>/dev/null
    mv "$OUT"/llama_multi-*-x*-????-??-??.md "$OUT/llama_multi-$lhs.md" 2>/dev/null
  done
fi
gzip -rq "$OUT"/hlo-* 2>/dev/null
note "multi_gpu_check done: status=$status"
cat "$SUMMARY"
exit $status
