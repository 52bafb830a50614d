#!/usr/bin/env bash
# A/B of decode builds in one device call: for each round, each carried wheel dist/<name>/ in turn (the first build
# changes each round) runs bench_decode.py with the given arguments (jax_flash only, or the one jax_flash implementation
# a later --impls names, e.g. jax_flash_1len: decode_ab.py --impl); results under $OUT/<name>-r<round>/; each build runs
# with its own Python (WHEEL_PYTHON=1: builds of tools/build_pending.sh may differ there; AB_WHEEL_PYTHON=0: the working
# tree's over each, but for the files a pending build's patches change, tools/python_overlay.sh, so that an older
# dist/main runs main's Python; a build whose dist/<name>/env exists runs with its lines, NAME=value, in the
# environment). Summaries:
# python3 tools/decode_ab.py $OUT [--table] [--impl NAME] (NAME: the jax_flash implementation run, default jax_flash).
#   bash tools/decode_ab.sh "a b" ROUNDS [bench_decode.py arguments...]
set -uo pipefail
cd "$(dirname "$0")/.."
read -r -a NAMES <<<"$1"
ROUNDS=$2
shift 2
BASE_OUT=${OUT:-$PWD/decode_ab_out}
mkdir -p "$BASE_OUT"
echo "${NAMES[@]}" >"$BASE_OUT/builds"  # decode_ab.py's order: speeds relative to the first
for ((r = 1; r <= ROUNDS; r++)); do
  for ((i = 0; i < ${#NAMES[@]}; i++)); do
    n=${NAMES[$(((i + r - 1) % ${#NAMES[@]}))]}
    envs=(); [ -f "dist/$n/env" ] && mapfile -t envs <"dist/$n/env"
    env "${envs[@]}" WHEEL=$(ls dist/"$n"/*.whl) WHEEL_PYTHON=${AB_WHEEL_PYTHON:-1} OUT="$BASE_OUT/$n-r$r" bash tools/decode_gpu_check.sh bench --impls jax_flash \
      --name "ab-$n-r$r" "$@" >"$BASE_OUT/$n-r$r.log" 2>&1 || echo "$n round $r failed"
  done
done
