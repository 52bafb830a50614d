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
// limit, 163 / 227 KB on sm_80 / sm_90), the per-warp kernel elsewhere (sm_86, sm_89: 99 KB, above head dim 64)
// and for head dim 256 on sm_80 (the CTA-wide tiles need 209 KB there).
template <typename T, int kD>
cudaError_t launch_bwd_sm80(const FlashParams& p, cudaStream_t stream, int smem_optin_bytes) {
  using CtaTraits = BwdCtaKernelTraits<BwdCtaTraitsSm80<kD>>;
  if (smem_optin_bytes >= int(sizeof(BwdCtaSharedStorage<T, CtaTraits>))) {
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
