// Launchers of the sm_80-class kernels, instantiated per (dtype, head-dim class) in flash_*_sm80_hdim*.cu.
#pragma once

#include "kernels/common/bwd_pre_post.cuh"
#include "kernels/common/launch_utils.h"
#include "kernels/flash_api.h"
#include "kernels/sm80/flash_bwd_sm80_mma_cpasync.cuh"
#include "kernels/sm80/flash_bwd_sm80_mma_cpasync_cta.cuh"
#include "kernels/sm80/flash_fwd_sm80_mma_cpasync.cuh"

namespace jax_flash::cuda {

template <typename T, int kD>
cudaError_t launch_fwd_sm80(const FlashParams& p, cudaStream_t stream) {
  using Traits = FwdKernelTraits<FwdTraitsSm80<kD>>;
  constexpr int kSmemBytes = Traits::kSmemElems * int(sizeof(T));
  constexpr auto kernel = flash_fwd_sm80_kernel<T, Traits>;
  if (cudaError_t e = ensure_smem_limit<kernel>(kSmemBytes); e != cudaSuccess) return e;
  const dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch);
  kernel<<<grid, Traits::kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// The sm_80-class main backward kernel with the given traits (the tile sweep passes its own).
template <typename T, typename Traits>
cudaError_t launch_bwd_sm80_main(const FlashParams& p, cudaStream_t stream) {
  constexpr auto kernel = flash_bwd_sm80_kernel<T, Traits>;
  if (cudaError_t e = ensure_smem_limit<kernel>(Traits::kSmemBytes); e != cudaSuccess) return e;
  const dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.heads_kv, p.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// The CTA-wide main backward kernel with the given traits.
template <typename T, typename Traits>
cudaError_t launch_bwd_sm80_cta_main(const FlashParams& p, cudaStream_t stream) {
  constexpr auto kernel = flash_bwd_sm80_cta_kernel<T, Traits>;
  constexpr int kSmemBytes = int(sizeof(BwdCtaSharedStorage<T, Traits>));
  if (cudaError_t e = ensure_smem_limit<kernel>(kSmemBytes); e != cudaSuccess) return e;
  const dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.heads_kv, p.batch);
  kernel<<<grid, Traits::kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// The CTA-wide kernel where a block may have the shared memory it needs (smem_optin_bytes: the device's opt-in
// limit, 163 / 227 KB on sm_80 / sm_90), the per-warp kernel elsewhere (sm_86, sm_89: 99 KB, above head dim 64).
// At head dim 256 the CTA-wide kernel needs 209 KB and the per-warp one 201 KB: only sm_90's 227 KB holds either
// (sm80_smem_bytes; elsewhere the handler refuses the call and the Python side runs its XLA path).
template <int kD>
using BwdCtaTraitsFor = BwdCtaKernelTraits<BwdCtaTraitsSm80<kD>>;
template <int kD>
constexpr int kBwdCtaSmemBytes = int(sizeof(BwdCtaSharedStorage<__nv_bfloat16, BwdCtaTraitsFor<kD>>));
static_assert(sizeof(__half) == sizeof(__nv_bfloat16), "one shared-memory size for both 16-bit types");

template <int kD>
int sm80_smem_bytes(bool backward, int smem_optin_bytes) {
  if (!backward) return FwdKernelTraits<FwdTraitsSm80<kD>>::kSmemElems * int(sizeof(__nv_bfloat16));
  return smem_optin_bytes >= kBwdCtaSmemBytes<kD> ? kBwdCtaSmemBytes<kD>
                                                  : BwdKernelTraits<BwdTraitsSm80<kD>>::kSmemBytes;
}

template <typename T, int kD>
cudaError_t launch_bwd_sm80(const FlashParams& p, cudaStream_t stream, int smem_optin_bytes) {
  using CtaTraits = BwdCtaTraitsFor<kD>;
  if (smem_optin_bytes >= kBwdCtaSmemBytes<kD>) {
    return launch_bwd_sequence<T, DqRowMajor>(p, stream,
                                              [&] { return launch_bwd_sm80_cta_main<T, CtaTraits>(p, stream); });
  }
  using Traits = BwdKernelTraits<BwdTraitsSm80<kD>>;
  return launch_bwd_sequence<T, DqRowMajor>(p, stream, [&] { return launch_bwd_sm80_main<T, Traits>(p, stream); });
}

}  // namespace jax_flash::cuda

// Explicit instantiation for one (dtype, head-dim class).
#define JAX_FLASH_INSTANTIATE_SM80(T, D)                                                              \
  template cudaError_t jax_flash::cuda::launch_fwd_sm80<T, D>(const FlashParams&, cudaStream_t);      \
  template cudaError_t jax_flash::cuda::launch_bwd_sm80<T, D>(const FlashParams&, cudaStream_t, int);
// The shared-memory sizes of one head-dim class (once per class, not per dtype).
#define JAX_FLASH_INSTANTIATE_SM80_SMEM(D) template int jax_flash::cuda::sm80_smem_bytes<D>(bool, int);
