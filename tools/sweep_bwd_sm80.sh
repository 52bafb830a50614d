#!/usr/bin/env bash
# Builds the backward tile sweep (tools/sweep_bwd_sm80.cu) into build/sweep_bwd_sm80 when the binary is
# missing or older than its sources, then runs it non-causal and causal. Extra arguments go to both runs
# (e.g. --seq 8192 --batch 2). Output is teed to $OUT/sweep_bwd_sm80.txt when OUT is set.
#   bash tools/sweep_bwd_sm80.sh [harness options]
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=build/sweep_bwd_sm80
PTXAS_LOG=build/sweep_bwd_sm80.ptxas.log
# The harness and every header it includes (kernels/sm80/launch_sm80.cuh and what that includes).
SRCS=(tools/sweep_bwd_sm80.cu tools/cuda_check.h cuda/flash_params.h cuda/mask.h cuda/kernels/flash_api.h cuda/kernels/common/*
      cuda/kernels/sm80/*.h cuda/kernels/sm80/*.cuh)
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}

stale=0
if [ ! -x "$BIN" ]; then
  stale=1
else
  for src in "${SRCS[@]}"; do [ "$src" -nt "$BIN" ] && stale=1; done
fi
if [ $stale = 1 ]; then
  if [ -x "$NVCC" ]; then
    mkdir -p build
    echo "building $BIN with $NVCC"
    "$NVCC" -O3 -std=c++17 --use_fast_math -lineinfo -I cuda \
      -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=sm_80 -Xptxas=-v \
      -o "$BIN" tools/sweep_bwd_sm80.cu >"$PTXAS_LOG" 2>&1 || { cat "$PTXAS_LOG"; exit 1; }
  elif [ -x "$BIN" ]; then
    echo "warning: $BIN is older than its sources and no nvcc was found; running it as is" >&2
  else
    echo "error: $BIN is missing and no nvcc was found" >&2
    exit 1
  fi
fi

LOG=/dev/null
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  LOG="$OUT/sweep_bwd_sm80.txt"
fi

# Registers and spills of each backward instantiation, per architecture, from the ptxas -v log.
ptxas_summary() {
  [ -f "$PTXAS_LOG" ] || return 0
  echo "ptxas (-v) for flash_bwd_sm80_kernel / flash_bwd_sm80_cta_kernel instantiations:"
  awk '
    /Compiling entry function/ { split($0, a, "\x27"); fn = a[2]; arch = a[4]; next }
    /bytes stack frame/ { frame = $0; sub(/^ +/, "", frame); next }
    /Used [0-9]+ registers/ {
      if (fn ~ /flash_bwd_sm80_(cta_)?kernel/) {
        regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
        print "  " arch ": " regs " registers, " frame "  " fn
      }
      fn = ""
    }' "$PTXAS_LOG" | { c++filt 2>/dev/null || cat; } |
    sed -e 's/(anonymous namespace):://g; s/jax_flash::cuda:://g' \
        -e 's/void flash_bwd_sm80_kernel<__nv_bfloat16, BwdKernelTraits<\(.*\) > >(jax_flash::FlashParams)$/\1/' \
        -e 's/void flash_bwd_sm80_cta_kernel<__nv_bfloat16, BwdCtaKernelTraits<\(.*\) > >(jax_flash::FlashParams)$/cta \1/'
  echo
}

status=0
{
  ptxas_summary
  "$BIN" "$@" || status=1
  echo
  "$BIN" --causal "$@" || status=1
  exit $status
} 2>&1 | tee "$LOG"
