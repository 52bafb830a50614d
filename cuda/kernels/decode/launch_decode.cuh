// Launcher of the decode kernels (flash_decode.cuh), instantiated per (dtype, head-dim class) in
// flash_decode_hdim*.cu: the split-KV kernel with as many 16-row tiles as the packed query rows need, then the
// combine kernel when the key range is split (one split writes O and lse itself).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/common/launch_utils.h"
#include "kernels/decode/combine.cuh"
#include "kernels/decode/flash_decode.cuh"
#include "kernels/flash_api.h"

namespace jax_flash::cuda {

namespace decode {
// FlashParams::rank_batch for a launch of `kernel` over (split, kv head, batch element) units (RankBatch; tma: the TMA
// kernel's launch), from the blocks of it the device holds at once (queried once per kernel and device, and passed
// back in *resident when asked for; call after ensure_smem_limit).
template <auto kernel>
cudaError_t set_rank_batch(FlashParams* p, int threads, int smem_bytes, bool tma = false, int* resident = nullptr) {
  int ctas = 0;
  if (cudaError_t e = resident_ctas<kernel>(threads, smem_bytes, &ctas); e != cudaSuccess) return e;
  p->rank_batch = !p->equal_lengths &&
                  RankBatch(p->num_splits, p->batch, int64_t(p->num_splits) * p->heads_kv * p->batch, ctas, tma);
  if (resident != nullptr) *resident = ctas;
  return cudaSuccess;
}
}  // namespace decode

// The combine kernel that merges the split kernel's partial results: a warp per (batch, step, query head) row for
// many rows of few splits, a block per row and column chunk otherwise (combine.cuh).
template <typename T>
cudaError_t launch_decode_combine(const FlashParams& p, cudaStream_t stream) {
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads_q;
  if (p.num_splits <= decode::kCombineWarpSplits && rows >= decode::kCombineWarpMinRows) {
    constexpr int kRowsPerBlock = decode::kCombineWarpsPerBlock;
    decode::flash_decode_combine_warp_kernel<T>
        <<<unsigned((rows + kRowsPerBlock - 1) / kRowsPerBlock), kRowsPerBlock * kWarpSize, 0, stream>>>(p);
  } else {
    const dim3 grid(unsigned(rows), unsigned(decode::CombineChunks(rows, p.head_dim, p.num_splits)));
    decode::flash_decode_combine_kernel<T><<<grid, decode::kCombineThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

template <typename T, int kD>
cudaError_t launch_decode(const FlashParams& p, cudaStream_t stream) {
  const int rows = p.group_size() * p.seqlen_q;
  auto run = [&](auto row_tiles) -> cudaError_t {
    using Traits = decode::DecodeTraits<kD, decltype(row_tiles)::value>;
    constexpr int kSmemBytes = decode::SplitSmem<T, Traits>::kBytes;
    const cudaError_t e = with_static_flags(
        [&](auto paged, auto soft_cap) {
          constexpr auto kernel =
              decode::flash_decode_split_kernel<T, Traits, decltype(paged)::value, decltype(soft_cap)::value>;
          if (cudaError_t e = ensure_smem_limit<kernel>(kSmemBytes); e != cudaSuccess) return e;
          FlashParams kp = p;  // with rank_batch
          if (cudaError_t e = decode::set_rank_batch<kernel>(&kp, Traits::kThreads, kSmemBytes); e != cudaSuccess) {
            return e;
          }
          kernel<<<dim3(p.num_splits, p.heads_kv, p.batch), Traits::kThreads, kSmemBytes, stream>>>(kp);
          return cudaGetLastError();
        },
        p.page_table != nullptr, SoftCap(p).enabled());
    if (e != cudaSuccess) return e;
    return p.num_splits > 1 ? launch_decode_combine<T>(p, stream) : cudaSuccess;
  };
  switch (decode::RowTiles(rows)) {
    case 1: return run(std::integral_constant<int, 1>{});
    case 2: return run(std::integral_constant<int, 2>{});
    case 4: return run(std::integral_constant<int, 4>{});
    case 8: return run(std::integral_constant<int, 8>{});
    default: break;
  }
  return cudaErrorInvalidValue;  // the handler refuses such calls first
}

}  // namespace jax_flash::cuda

#define JAX_FLASH_INSTANTIATE_DECODE(T, D) \
  template cudaError_t jax_flash::cuda::launch_decode<T, D>(const FlashParams&, cudaStream_t);
