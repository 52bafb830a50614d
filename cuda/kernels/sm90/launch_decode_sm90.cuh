// Launcher of the sm_90a wgmma decode kernel (flash_decode_wgmma_sm90.cuh), instantiated per (dtype, head-dim class
// 64 / 128) in flash_decode_sm90_hdim*.cu: one or two consumer warpgroups by the packed rows, then the combine
// kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "kernels/common/launch_utils.h"
#include "kernels/decode/launch_decode.cuh"
#include "kernels/flash_api.h"
#include "kernels/sm90/flash_decode_wgmma_sm90.cuh"

namespace jax_flash::cuda::sm90 {

template <typename T, int kD>
cudaError_t launch_decode_wgmma(const FlashParams& p, cudaStream_t stream) {
  auto run = [&](auto warpgroups) -> cudaError_t {
    constexpr int kWarpgroups = decltype(warpgroups)::value;
    using Traits = DecodeWgmmaTraits<kD, kWarpgroups>;
    constexpr auto kernel = flash_decode_wgmma_kernel<T, Traits>;
    constexpr int kSmemBytes = decode::SplitSmem<T, Traits>::kBytes;
    static_assert(kSmemBytes == decode::WgmmaSmemBytes(kD, kWarpgroups));
    if (cudaError_t e = ensure_smem_limit<kernel>(kSmemBytes); e != cudaSuccess) return e;
    kernel<<<dim3(p.num_splits, p.heads_kv, p.batch), Traits::kThreads, kSmemBytes, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    return p.num_splits > 1 ? launch_decode_combine<T>(p, stream) : cudaSuccess;  // one split writes O itself
  };
  if (decode::WgmmaWarpgroups(p.group_size() * p.seqlen_q) == 1) return run(std::integral_constant<int, 1>{});
  return run(std::integral_constant<int, 2>{});
}

}  // namespace jax_flash::cuda::sm90

#define JAX_FLASH_INSTANTIATE_DECODE_SM90(T, D) \
  template cudaError_t jax_flash::cuda::sm90::launch_decode_wgmma<T, D>(const FlashParams&, cudaStream_t);
