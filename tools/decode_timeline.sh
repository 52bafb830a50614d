#!/usr/bin/env bash
# On a GPU machine: tools/timeline_decode.py at several decode shapes (each "--impls ... shape args" one line of
# SHAPES, default below), then, unless BENCH=0, bench_decode's Tq-1 dense rows of the core preset for jax_flash and
# the peers. Installs the carried wheel and the peers (tools/gpu_site.sh); writes $OUT/summary.txt and the JSON.
#   OUT=... bash tools/decode_timeline.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/decode_timeline_out}
CHECK_NAME=decode_timeline CHECK_ARGS="${BENCH:-1}"
source tools/gpu_site.sh
repo=$PWD
SHAPES=${SHAPES:-"--impls jax_flash,cudnn,fa3_jax,xla --batch 8 --seqlen 32768 --tq 1
--impls jax_flash,cudnn,fa3_jax --batch 1 --seqlen 131072 --tq 1
--impls jax_flash,cudnn,fa3_jax,xla --batch 1 --seqlen 131072 --tq 1 --heads 8 --kv-heads 1
--impls jax_flash,cudnn,fa3_jax --batch 64 --seqlen 8192 --tq 1 --heads 64 --ragged
--impls jax_flash,fa3_jax --batch 64 --seqlen 8192 --tq 16 --heads 64"}
while IFS= read -r line; do
  [ -n "$line" ] || continue
  # shellcheck disable=SC2086
  (cd /tmp && timeout 240 python3 "$repo/tools/timeline_decode.py" $line --out "$OUT") 2>&1 \
    | grep -v "^WARNING\|^I0000\|^W0000" | tee -a "$SUMMARY"
done <<<"$SHAPES"
if [ "${BENCH:-1}" != 0 ]; then
  (cd /tmp && timeout 420 python3 "$repo/benchmarks/bench_decode.py" --preset core --tq 1 --layouts dense \
    --impls jax_flash,cudnn,fa3_jax,xla --out "$OUT" --name decode-tq1-dense) >"$OUT/bench.log" 2>&1
  tail -40 "$OUT/bench.log" | tee -a "$SUMMARY"
fi
