// A consumer warpgroup's rows of a bfloat16 operand tile in shared memory, multiplied by a scalar in place before
// the warpgroup's first wgmma reads them. The soft-capped forward folds the cap's pre = scale / c into Q, which stays
// in shared memory for a whole tile, so the S products give the tanh's argument pre * q.k and no score needs an FMUL
// for it. One bfloat16 rounding of pre * x; float16 is left out (its range is too short for x * pre).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/common/element_traits.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/utils_sm90.cuh"

namespace jax_flash::cuda::sm90 {

// x * s as a float for bfloat16 rounding; a finite x whose product passes bfloat16's range saturates (a finite
// operand never becomes inf, so no inf * 0 = nan appears where the float32 score s * q.k stayed finite); inf and nan
// stay as they are.
__device__ __forceinline__ float scaled_saturating(float x, float s) {
  constexpr float kMax = 3.38953139e38f;  // the largest finite bfloat16
  const float y = x * s;
  return fabsf(x) <= kMax ? fminf(fmaxf(y, -kMax), kMax) : y;
}

// Rows [row0, row0 + kWgmmaM) of a [kColBlocks][kTileRows][64] tile (128-byte swizzled rows; the product is
// elementwise, so the swizzle does not matter) times s, by the 128 threads of one warpgroup (wtid: the thread's index
// in it); then the writes are ordered before the async proxy's reads (wgmma) and the warpgroup meets on named
// barrier `barrier`. A reader outside the warpgroup needs a barrier of its own after this.
template <int kColBlocks, int kTileRows>
__device__ __forceinline__ void scale_warpgroup_rows(__nv_bfloat16* tile, int row0, float s, int wtid, int barrier) {
  using ET = ElemTraits<__nv_bfloat16>;
  constexpr int kChunks = kWgmmaM * kColBlock / 8;  // 16-byte chunks of the rows in one column block
#pragma unroll
  for (int cb = 0; cb < kColBlocks; ++cb) {
    uint4* rows = reinterpret_cast<uint4*>(tile + (cb * kTileRows + row0) * kColBlock);
#pragma unroll
    for (int c = wtid; c < kChunks; c += kWarpgroupThreads) {
      uint4 v = rows[c];
      uint32_t* pairs = &v.x;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 f = ET::unpack(pairs[e]);
        pairs[e] = ET::pack(scaled_saturating(f.x, s), scaled_saturating(f.y, s));
      }
      rows[c] = v;
    }
  }
  fence_proxy_async_smem();
  named_barrier_sync(barrier, kWarpgroupThreads);
}

}  // namespace jax_flash::cuda::sm90
