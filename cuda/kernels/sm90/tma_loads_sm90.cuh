// The TMA box loops the sm_90a kernels share: a tile of 128-byte swizzled rows loaded as one box per 64-column
// block. Device code only (the boxes are utils_sm90.cuh's tma_load_4d).
#pragma once

#include <cuda.h>  // CUtensorMap

#include <cstdint>

#include "kernels/common/l2_policy.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"  // kColBlock
#include "kernels/sm90/utils_sm90.cuh"

namespace jax_flash::cuda::sm90 {

// Producer thread: one of the key block's tensors (K or V: kBlockN rows from key n0 of kv head hk, batch b) into
// shared memory at dst, as kColBlocks TMA boxes of 64 columns counted on `full` (the caller sets its byte count).
// kReadOnce: no later load of the call reads these rows (the decode kernel's K/V stream), so their lines are the
// first L2 evicts (l2_policy.cuh).
template <int kBlockN, int kColBlocks, bool kReadOnce = false, typename T>
__device__ __forceinline__ void load_key_block_rows(T* dst, const CUtensorMap* tm, uint64_t* full, int n0, int hk,
                                                    int b) {
#pragma unroll
  for (int cb = 0; cb < kColBlocks; ++cb) {
    if constexpr (kReadOnce) {
      tma_load_4d(dst + cb * kBlockN * kColBlock, tm, full, cb * kColBlock, n0, hk, b, l2_evict_first_policy());
    } else {
      tma_load_4d(dst + cb * kBlockN * kColBlock, tm, full, cb * kColBlock, n0, hk, b);
    }
  }
}

}  // namespace jax_flash::cuda::sm90
