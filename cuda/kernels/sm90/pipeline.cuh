// The barrier operations of PipelineBarriers (pipeline.h): mbarrier waits and arrivals, device code only.
#pragma once

#include "kernels/sm90/pipeline.h"
#include "kernels/sm90/utils_sm90.cuh"

namespace jax_flash::cuda::sm90 {

template <int kStages>
__device__ __forceinline__ void PipelineBarriers<kStages>::init(int consumer_arrivals, int producer_arrivals) {
#pragma unroll
  for (int s = 0; s < kStages; ++s) {
    mbar_init(&full[s], producer_arrivals);
    mbar_init(&empty[s], consumer_arrivals);
  }
}

template <int kStages>
__device__ __forceinline__ void PipelineBarriers<kStages>::producer_acquire(State s, uint32_t bytes) {
  producer_wait_empty(s);
  mbar_arrive_expect_tx(&full[s.slot()], bytes);
}

template <int kStages>
__device__ __forceinline__ void PipelineBarriers<kStages>::producer_wait_empty(State s) {
  mbar_wait(&empty[s.slot()], s.phase() ^ 1);
}

template <int kStages>
__device__ __forceinline__ void PipelineBarriers<kStages>::consumer_wait(State s) {
  mbar_wait(&full[s.slot()], s.phase());
}

template <int kStages>
__device__ __forceinline__ void PipelineBarriers<kStages>::consumer_release(State s) {
  mbar_arrive(&empty[s.slot()]);
}

}  // namespace jax_flash::cuda::sm90
