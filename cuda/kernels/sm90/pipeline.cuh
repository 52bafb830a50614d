// The one idiom for every shared-memory ring of the sm_90a kernels: a ring of kStages slots, each guarded by a
// "full" mbarrier (completed by the producer's arrival plus the bytes of its TMA loads, or by st.async bytes) and an
// "empty" mbarrier (completed by the consumers' arrivals when they are done with the slot).
//
// PipelineState counts the ring's uses since the kernel began (a persistent CTA's count runs on across tiles):
// use `count` takes slot count % kStages, and its full barrier completes the phase of parity (count / kStages) & 1.
// The producer waits on the slot's empty barrier with the other parity, which a freshly initialised barrier passes
// at once (the phase before its first counts as complete), so the first kStages uses need no special case.
#pragma once

#include <cstdint>

#include "kernels/sm90/utils_sm90.cuh"

namespace jax_flash::cuda::sm90 {

template <int kStages>
struct PipelineState {
  static_assert(kStages >= 1);
  int count = 0;

  __device__ __forceinline__ int slot() const { return count % kStages; }
  __device__ __forceinline__ uint32_t phase() const { return uint32_t(count / kStages) & 1; }
  __device__ __forceinline__ void advance(int uses = 1) { count += uses; }
  // The state `uses` uses later (earlier for a negative count).
  __device__ __forceinline__ PipelineState ahead(int uses) const { return {count + uses}; }
};

// The barriers of one ring, a member of the kernel's shared storage (so every barrier address is the storage base
// plus a constant, with nothing held in registers): full[kStages], empty[kStages]. Several rings may share one
// PipelineState when their slots advance together (the forward's K and V rings).
template <int kStages>
struct PipelineBarriers {
  using State = PipelineState<kStages>;
  uint64_t full[kStages];
  uint64_t empty[kStages];

  // One thread, before the CTA's first barrier: the producer arrives once per use (with its transaction bytes),
  // `consumer_arrivals` arrivals release a slot.
  __device__ __forceinline__ void init(int consumer_arrivals) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], consumer_arrivals);
    }
  }
  // Producer: waits until the consumers released the slot's previous use, then expects `bytes` of loads on its
  // full barrier (the loads name full_barrier(state) as their completion barrier).
  __device__ __forceinline__ void producer_acquire(State s, uint32_t bytes) {
    producer_wait_empty(s);
    mbar_arrive_expect_tx(&full[s.slot()], bytes);
  }
  // Producer: waits until the consumers released the slot's previous use (for writers that count their bytes on
  // the full barrier themselves).
  __device__ __forceinline__ void producer_wait_empty(State s) { mbar_wait(&empty[s.slot()], s.phase() ^ 1); }
  __device__ __forceinline__ uint64_t* full_barrier(State s) { return &full[s.slot()]; }
  __device__ __forceinline__ uint64_t* empty_barrier(State s) { return &empty[s.slot()]; }
  // Consumer: waits until the slot's data has landed.
  __device__ __forceinline__ void consumer_wait(State s) { mbar_wait(&full[s.slot()], s.phase()); }
  // Consumer: one of the `consumer_arrivals` arrivals that release the slot.
  __device__ __forceinline__ void consumer_release(State s) { mbar_arrive(&empty[s.slot()]); }
};

}  // namespace jax_flash::cuda::sm90
