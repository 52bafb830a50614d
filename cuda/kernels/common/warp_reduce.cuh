// Warp-level constants and reductions shared by every CUDA kernel. An MMA accumulator row (mma.sync m16n8 and
// wgmma alike) is spread over the 4 lanes of a quad (lane = 4 g + t: row g, columns 2 t, 2 t + 1 of each tile).
#pragma once

#include <cuda_runtime.h>

namespace jax_flash::cuda {

inline constexpr int kWarpSize = 32;

// Max / sum / any over the 4 lanes that share a row of an MMA fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}
__device__ __forceinline__ bool quad_any(bool x) {
  int v = x;
  v |= __shfl_xor_sync(0xffffffff, v, 1);
  return (v | __shfl_xor_sync(0xffffffff, v, 2)) != 0;
}

// Max / sum over the 32 lanes of a warp (every lane gets the result).
__device__ __forceinline__ float warp_max(float x) {
  for (int d = kWarpSize / 2; d > 0; d /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, d));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int d = kWarpSize / 2; d > 0; d /= 2) x += __shfl_xor_sync(0xffffffff, x, d);
  return x;
}
__device__ __forceinline__ int warp_max(int x) {
  for (int d = kWarpSize / 2; d > 0; d /= 2) x = max(x, __shfl_xor_sync(0xffffffff, x, d));
  return x;
}

}  // namespace jax_flash::cuda
