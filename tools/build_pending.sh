#!/usr/bin/env bash
# Wheels of kernel changes that wait for a GPU: tools/pending/series lists patches (written on a machine without a
# GPU, compiled and CPU-tested there, not yet run on a GPU), each applying on top of main and the ones before it.
# For each NAME (a patch's name without .patch, or "main"), builds main with the series applied up to and including
# that patch into dist/NAME/ (what tools/decode_ab.sh, ab_bench.sh and the GPU check scripts carry and install).
# All builds share one source checkout and one build directory, so each wheel recompiles only the translation
# units whose files differ from the previous build's (a first build on two cores takes most of an hour, later ones
# minutes).
# PENDING_ARCHS=90a builds only the sm_90a code (the wheels A/B'd on an H100 or H200 run no other; about half the
# compile time on two cores and a smaller carry).
#   bash tools/build_pending.sh main issue19-dec12 issue19-dec13-2wg
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
src=${PENDING_SRC:-/tmp/jax_flash_pending_src}
build=${PENDING_BUILD:-/tmp/jax_flash_pending_build}
[ -d "$src/.git" ] || [ -f "$src/.git" ] || git worktree add -q --detach "$src" HEAD
[ $# -gt 0 ] || { echo "usage: build_pending.sh NAME... (main or a patch of tools/pending/series)" >&2; exit 2; }
for name in "$@"; do
  [ -n "$name" ] || { echo "build_pending: empty name" >&2; exit 2; }
  git -C "$src" checkout -q -f --detach "$(git rev-parse HEAD)"
  git -C "$src" clean -q -fd
  if [ "$name" != main ]; then
    patches=$(bash tools/pending_series.sh "$name") || exit 2
    for patch in $patches; do
      git -C "$src" apply --index "$repo/tools/pending/$patch"
    done
  fi
  rm -rf "dist/$name"
  echo "== $name ($(date -u +%H:%M:%S))"
  archs=(); [ -z "${PENDING_ARCHS:-}" ] || archs=(-C "cmake.define.JAX_FLASH_CUDA_ARCHS=$PENDING_ARCHS")
  (cd "$src" && pip wheel -q --no-build-isolation --no-deps -w "$repo/dist/$name" -C build-dir="$build" "${archs[@]}" .)
  ls -l "dist/$name"
done
