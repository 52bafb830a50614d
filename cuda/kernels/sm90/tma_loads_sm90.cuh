// The TMA box loops the sm_90a kernels share: a tile of 128-byte swizzled rows loaded as one box per 64-column
// block. Device code only (the boxes are utils_sm90.cuh's tma_load_4d).
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "kernels/sm90/kernel_traits_sm90.h"  // kColBlock
#include "kernels/sm90/utils_sm90.cuh"

namespace jax_flash::cuda::sm90 {

// Producer thread: one of the key block's tensors (K or V: kBlockN rows from key n0 of kv head hk, batch b) into
// shared memory at dst, as kColBlocks TMA boxes of 64 columns counted on `full` (the caller sets its byte count).
template <int kBlockN, int kColBlocks, typename T>
__device__ __forceinline__ void load_key_block_rows(T* dst, const CUtensorMap* tm, uint64_t* full, int n0, int hk,
                                                    int b) {
#pragma unroll
  for (int cb = 0; cb < kColBlocks; ++cb) tma_load_4d(dst + cb * kBlockN * kColBlock, tm, full, cb * kColBlock, n0, hk, b);
}

}  // namespace jax_flash::cuda::sm90
