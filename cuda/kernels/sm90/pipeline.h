// The one idiom for every shared-memory ring of the sm_90a kernels: a ring of kStages slots, each guarded by a
// "full" mbarrier (completed by the producer's arrival plus the bytes of its TMA loads, by st.async bytes, or by the
// arrivals of a cp.async gather's threads once their copies land) and an
// "empty" mbarrier (completed by the consumers' arrivals when they are done with the slot).
//
// PipelineState counts the ring's uses since the kernel began (a persistent CTA's count runs on across tiles):
// use `count` takes slot count % kStages, and its full barrier completes the phase of parity (count / kStages) & 1.
// The producer waits on the slot's empty barrier with the other parity, which a freshly initialised barrier passes
// at once (the phase before its first counts as complete), so the first kStages uses need no special case.
//
// This header holds the types (host-compilable: the kernels' shared-storage structs embed PipelineBarriers);
// pipeline.cuh defines the barrier operations.
#pragma once

#include <cstdint>

#include "flash_params.h"  // JF_HD

#if defined(__CUDACC__)
#define JF_DEVICE __device__ __forceinline__
#else
#define JF_DEVICE inline
#endif

namespace jax_flash::cuda::sm90 {

template <int kStages>
struct PipelineState {
  static_assert(kStages >= 1);
  int count = 0;

  JF_HD int slot() const { return count % kStages; }
  JF_HD uint32_t phase() const { return uint32_t(count / kStages) & 1; }
  JF_HD void advance(int uses = 1) { count += uses; }
  // The state `uses` uses later (earlier for a negative count).
  JF_HD PipelineState ahead(int uses) const { return {count + uses}; }
};

// The barriers of one ring, a member of the kernel's shared storage (so every barrier address is the storage base
// plus a constant, with nothing held in registers): full[kStages], empty[kStages]. Several rings may share one
// PipelineState when their slots advance together (the forward's K and V rings).
template <int kStages>
struct PipelineBarriers {
  using State = PipelineState<kStages>;
  uint64_t full[kStages];
  uint64_t empty[kStages];

  // One thread, before the CTA's first barrier: `producer_arrivals` arrivals fill a slot (one TMA producer's, with
  // its transaction bytes; or one per thread of a cp.async gather, each when its copies have landed),
  // `consumer_arrivals` arrivals release it.
  JF_DEVICE void init(int consumer_arrivals, int producer_arrivals = 1);
  // Producer: waits until the consumers released the slot's previous use, then expects `bytes` of loads on its
  // full barrier (the loads name full_barrier(state) as their completion barrier).
  JF_DEVICE void producer_acquire(State s, uint32_t bytes);
  // Producer: waits until the consumers released the slot's previous use (for writers that count their bytes on
  // the full barrier themselves).
  JF_DEVICE void producer_wait_empty(State s);
  JF_DEVICE uint64_t* full_barrier(State s) { return &full[s.slot()]; }
  // Consumer: waits until the slot's data has landed.
  JF_DEVICE void consumer_wait(State s);
  // Consumer: one of the `consumer_arrivals` arrivals that release the slot.
  JF_DEVICE void consumer_release(State s);
};

}  // namespace jax_flash::cuda::sm90
