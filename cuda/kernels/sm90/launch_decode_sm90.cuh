// Launcher of the sm_90a wgmma decode kernel (flash_decode_wgmma_sm90.cuh), instantiated per (dtype, head-dim class
// 64 / 128) in flash_decode_sm90_hdim*.cu: a block per split of one warpgroup (up to 64 packed rows) or two (65-128),
// then the combine kernel when the key range is split.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/common/launch_utils.h"
#include "kernels/decode/launch_decode.cuh"
#include "kernels/flash_api.h"
#include "kernels/sm90/flash_decode_wgmma_sm90.cuh"

namespace jax_flash::cuda::sm90 {

template <typename T, int kD>
cudaError_t launch_decode_wgmma(const FlashParams& p, cudaStream_t stream) {
  auto run = [&](auto groups) -> cudaError_t {
    using Traits = DecodeWgmmaTraits<kD, decltype(groups)::value>;
    constexpr int kSmemBytes = decode::SplitSmem<T, Traits>::kBytes;
    static_assert(kSmemBytes == decode::WgmmaSmemBytes(kD, decltype(groups)::value));
    return with_static_flags(
        [&](auto paged, auto soft_cap) {
          constexpr auto kernel =
              flash_decode_wgmma_kernel<T, Traits, decltype(paged)::value, decltype(soft_cap)::value>;
          if (cudaError_t e = ensure_smem_limit<kernel>(kSmemBytes); e != cudaSuccess) return e;
          kernel<<<dim3(p.num_splits, p.heads_kv, p.batch), Traits::kThreads, kSmemBytes, stream>>>(p);
          return cudaGetLastError();
        },
        p.page_table != nullptr, SoftCap(p).enabled());
  };
  const cudaError_t e = decode::WgmmaGroups(p.group_size() * p.seqlen_q) == 1 ? run(std::integral_constant<int, 1>{})
                                                                              : run(std::integral_constant<int, 2>{});
  if (e != cudaSuccess) return e;
  return p.num_splits > 1 ? launch_decode_combine<T>(p, stream) : cudaSuccess;  // one split writes O itself
}

}  // namespace jax_flash::cuda::sm90

#define JAX_FLASH_INSTANTIATE_DECODE_SM90(T, D) \
  template cudaError_t jax_flash::cuda::sm90::launch_decode_wgmma<T, D>(const FlashParams&, cudaStream_t);
