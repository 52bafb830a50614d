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
  rm -rf /tmp/jf_site  # pip --target keeps an existing package (a warm machine)
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
  mkdir -p "$OUT/hlo-default"
  JAX_FLASH_CHECK_DUMP="$OUT/hlo-default" XLA_PYTHON_CLIENT_PREALLOCATE=false timeout "${PYTEST_LIMIT:-400}" \
    pytest -q -p no:cacheprovider -p no:xdist -rfs tests/test_sharding.py tests/test_ring.py -k gpu 2>&1 |
    tee "$OUT/pytest-multi.log" | tail -15
  rc=${PIPESTATUS[0]}
  note "pytest (2-GPU cases of test_sharding, test_ring): rc=$rc $(tail -1 "$OUT/pytest-multi.log") ($((SECONDS - t0)) s)"
  [ $rc -eq 0 ] || status=1
  # The ring's transfer/kernel overlap again under XLA flag sets (the latency-hiding scheduler is what
  # llama_block --mode multi runs; the collective-permute combiner may merge transfers).
  for flags in "--xla_gpu_enable_latency_hiding_scheduler=true"; do
    tag=$(echo "$flags" | md5sum | cut -c1-6)
    mkdir -p "$OUT/hlo-$tag"
    out=$(cd /tmp && JAX_FLASH_CHECK_DUMP="$OUT/hlo-$tag" JAX_FLASH_CHECK_MESH=1x2 JAX_FLASH_CHECK_DTYPE=bfloat16 \
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="$flags" \
      python3 -P "$OLDPWD/tests/ring_check.py" overlap-contiguous overlap-zigzag 2>&1 | tail -1)
    note "ring overlap with XLA_FLAGS=$flags (hlo-$tag): ${out:0:2500}"
  done
fi
if [ "$MODE" != tests ]; then
  t0=$SECONDS
  # The example's default (XLA's latency-hiding scheduler).
  for flags in ""; do
    name=llama_multi-default
    t0=$SECONDS
    XLA_FLAGS="$flags" timeout "${BENCH_LIMIT:-240}" python3 examples/llama_block.py --mode multi --out "$OUT" \
      --name "$name" "$@" 2>&1 | tee "$OUT/$name.log" | tail -40
    note "llama_block --mode multi (XLA_FLAGS=$flags): rc=${PIPESTATUS[0]} ($((SECONDS - t0)) s)"
  done
fi
(cd "$OUT" && tar czf hlo.tgz hlo-* && rm -rf hlo-*) 2>/dev/null
note "multi_gpu_check done: status=$status"
cat "$SUMMARY"
exit $status
