// The work counter of the persistent sm_90a grids (the forward's, the backward's, the TMA decode kernel's): a CTA
// takes unit blockIdx.x first, then the next index that a global int32 counter hands out past the grid (gridDim.x,
// gridDim.x + 1, ...), so the units start in the order and with the dynamic balance of a CTA per unit. The counter
// is 0 when the kernel starts: zero_work_counter on the stream before it (the forward's and the decode launchers),
// or the backward's preprocess (common/bwd_pre_post.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_flash::cuda::sm90 {

#if defined(__CUDACC__)
// The CTA's k-th unit index (k = 0, 1, ...; one thread asks, once per k). Indices past the work mean none is left.
__device__ __forceinline__ int next_counted_unit(int k, int32_t* counter) {
  return k == 0 ? int(blockIdx.x) : int(gridDim.x) + atomicAdd(counter, 1);
}
#endif

// Zeroes the counter on the stream, before the kernel that takes units from it.
inline cudaError_t zero_work_counter(int32_t* counter, cudaStream_t stream) {
  if (counter == nullptr) return cudaErrorInvalidValue;
  return cudaMemsetAsync(counter, 0, sizeof(int32_t), stream);
}

}  // namespace jax_flash::cuda::sm90
