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

// One thread writes the 0 (static: each translation unit that launches it has its own copy).
static __global__ void zero_work_counter_kernel(int32_t* counter) { *counter = 0; }

// Zeroes the counter on the stream, before the kernel that takes units from it. A one-thread kernel rather than
// cudaMemsetAsync: on the H200 a 4-byte memset node between two kernels left ~4 us idle around it (the TMA decode
// kernel's timeline, NOTES session 77: memset 0.8 us, 1.4 + 2.8 us idle), where a kernel follows a kernel ~0.1 us
// later.
inline cudaError_t zero_work_counter(int32_t* counter, cudaStream_t stream) {
  if (counter == nullptr) return cudaErrorInvalidValue;
  zero_work_counter_kernel<<<1, 1, 0, stream>>>(counter);
  return cudaGetLastError();
}
#endif

}  // namespace jax_flash::cuda::sm90
