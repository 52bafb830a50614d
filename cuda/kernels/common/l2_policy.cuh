// L2 eviction priority for loads whose bytes nothing later in the call reads again: the decode kernels' K and V
// (each key's row of a kv head is read once a call, by the one unit whose tile packs every query head that shares
// it). Marked evict-first, that stream no longer pushes out of L2 the lines that are read again: the kernel's code
// (fetched by every SM as it starts a unit), Q, the page table and the split partials the combine reads back. (A
// paged cache whose tables share pages between sequences reads those rows again; the policy does not know that.)
// createpolicy needs sm_80 (as cp.async does).
#pragma once

#include <cstdint>

namespace jax_flash::cuda {

// A cache policy (the operand of a load's .L2::cache_hint) that makes the lines it brings in the first to go.
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

}  // namespace jax_flash::cuda
