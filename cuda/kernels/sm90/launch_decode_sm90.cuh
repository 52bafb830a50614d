// Launchers of the sm_90a decode kernels, instantiated per (dtype, head-dim class 64 / 128) in
// flash_decode_sm90_hdim*.cu, each followed by the combine kernel when the key range is split:
//   launch_decode_wgmma: the cp.async wgmma kernel (flash_decode_wgmma_sm90.cuh), a block per split of one warpgroup
//     (up to 64 packed rows) or two (65-128);
//   launch_decode_tma: the TMA kernel (flash_decode_tma_sm90.cuh) for 65-128 rows (dense caches by TMA, paged ones
//     gathered by cp.async), a CTA per (split, kv head, batch element) unit, or a persistent grid of them for many
//     waves of units (DecodeTmaGrid).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "kernels/common/launch_utils.h"
#include "kernels/decode/launch_decode.cuh"
#include "kernels/flash_api.h"
#include "kernels/sm90/flash_decode_tma_sm90.cuh"
#include "kernels/sm90/flash_decode_wgmma_sm90.cuh"
#include "kernels/sm90/tensor_maps.h"
#include "kernels/sm90/work_counter.cuh"

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
          FlashParams kp = p;  // with rank_batch
          if (cudaError_t e = decode::set_rank_batch<kernel>(&kp, Traits::kThreads, kSmemBytes); e != cudaSuccess) {
            return e;
          }
          kernel<<<dim3(p.num_splits, p.heads_kv, p.batch), Traits::kThreads, kSmemBytes, stream>>>(kp);
          return cudaGetLastError();
        },
        p.page_table != nullptr, SoftCap(p).enabled());
  };
  const cudaError_t e = decode::WgmmaGroups(p.group_size() * p.seqlen_q) == 1 ? run(std::integral_constant<int, 1>{})
                                                                              : run(std::integral_constant<int, 2>{});
  if (e != cudaSuccess) return e;
  return p.num_splits > 1 ? launch_decode_combine<T>(p, stream) : cudaSuccess;  // one split writes O itself
}

// The dense K/V caches' tensor maps bring into L2 only what a load asks for: each key's row of a kv head is read
// once, in 128-byte box rows, and the 256-byte promotion the other maps use (a miss also fetching the row's other
// half, the next box's) cost the long streams 5-13 % (64/8 x 128 at Tq 16 on an H200: one sequence of 131072 keys
// 150.6 -> 133.2 µs, 64 x 8192 547.8 -> 500.2; 128- and 64-byte promotion within 2 % of none; NOTES, session 32).
inline constexpr CUtensorMapL2promotion kDecodeKVPromotion = CU_TENSOR_MAP_L2_PROMOTION_NONE;

template <typename T, int kD>
cudaError_t launch_decode_tma(const FlashParams& p, cudaStream_t stream) {
  using Traits = FwdKernelTraitsSm90<T, DecodeTmaTileTraits<kD>>;
  const bool paged = p.page_table != nullptr;
  CUtensorMap tm_q, tm_k, tm_v;
  if (cudaError_t e = make_decode_q_tensor_map<T>(&tm_q, p); e != cudaSuccess) return e;
  if (paged) {  // the producer warpgroup gathers the pages: the K/V maps are not read
    tm_k = tm_q;
    tm_v = tm_q;
  } else if (cudaError_t e = make_bthd_tensor_maps<T>(
                 p, {{&tm_k, p.k, p.seqlen_k, p.heads_kv, Traits::kBlockN, kDecodeKVPromotion},
                     {&tm_v, p.v, p.seqlen_k, p.heads_kv, Traits::kBlockN, kDecodeKVPromotion}});
             e != cudaSuccess) {
    return e;
  }
  const int64_t units = int64_t(p.num_splits) * p.heads_kv * p.batch;
  if (units > INT_MAX) return cudaErrorInvalidConfiguration;
  // The grid's form (DecodeTmaGrid): one split a sequence, no left window and no ranking, each unit's first key tile
  // is tile 0 of the sequence of its grid index whatever the lengths, and the kernel loads it before reading them
  // (kUnitEarly; dense caches); an unranked grid of more than decode::kRankMaxWaves waves (past the ranking's reach:
  // at a few waves the ranked order of a CTA per unit pays, and one wave has no next unit to overlap) runs
  // persistent, a CTA per resident slot taking units from the work counter; otherwise a CTA per unit. The ranking
  // (decode::RankBatch) is decided from the grid's waves of this kernel, which every form shares.
  const cudaError_t e = with_static_flags(
      [&](auto is_paged, auto soft_cap) -> cudaError_t {
        constexpr bool kPagedCall = decltype(is_paged)::value;
        constexpr bool kSoftCapCall = decltype(soft_cap)::value;
        constexpr auto per_unit = flash_decode_tma_kernel<T, Traits, kPagedCall, kSoftCapCall, DecodeTmaGrid::kUnit>;
        if (cudaError_t e = ensure_smem_limit<per_unit>(Traits::kSmemBytes); e != cudaSuccess) return e;
        FlashParams kp = p;  // with rank_batch
        int resident = 0;  // (at least one: resident_ctas fails otherwise)
        if (cudaError_t e = decode::set_rank_batch<per_unit>(&kp, Traits::kThreads, Traits::kSmemBytes, true,
                                                             &resident);
            e != cudaSuccess) {
          return e;
        }
        // (units + resident within INT_MAX: a persistent CTA's next unit index, gridDim.x + the counter, runs up to
        // units + resident - 1.)
        const bool persistent = !kp.rank_batch && units > int64_t(decode::kRankMaxWaves) * resident &&
                                units + resident <= INT_MAX;
        const bool early = !persistent && !kPagedCall && p.window_left < 0 && p.num_splits == 1 && !kp.rank_batch;
        if (persistent) {
          if (cudaError_t e = zero_work_counter(p.decode_counter, stream); e != cudaSuccess) return e;
        }
        auto launch = [&](auto grid) -> cudaError_t {
          constexpr DecodeTmaGrid kGrid = decltype(grid)::value;
          if constexpr (kPagedCall && kGrid == DecodeTmaGrid::kUnitEarly) {
            return cudaErrorInvalidValue;  // unreachable: early is dense only
          } else {
            constexpr auto kernel = flash_decode_tma_kernel<T, Traits, kPagedCall, kSoftCapCall, kGrid>;
            if (cudaError_t e = ensure_smem_limit<kernel>(Traits::kSmemBytes); e != cudaSuccess) return e;
            const int ctas = kGrid == DecodeTmaGrid::kPersistent ? resident : int(units);
            kernel<<<ctas, Traits::kThreads, Traits::kSmemBytes, stream>>>(kp, tm_q, tm_k, tm_v);
            return cudaGetLastError();
          }
        };
        using Grid = DecodeTmaGrid;
        if (persistent) return launch(std::integral_constant<Grid, Grid::kPersistent>{});
        if (early) return launch(std::integral_constant<Grid, Grid::kUnitEarly>{});
        return launch(std::integral_constant<Grid, Grid::kUnit>{});
      },
      paged, SoftCap(p).enabled());
  if (e != cudaSuccess) return e;
  return p.num_splits > 1 ? launch_decode_combine<T>(p, stream) : cudaSuccess;  // one split writes O itself
}

}  // namespace jax_flash::cuda::sm90

#define JAX_FLASH_INSTANTIATE_DECODE_SM90(T, D)                                                              \
  template cudaError_t jax_flash::cuda::sm90::launch_decode_wgmma<T, D>(const FlashParams&, cudaStream_t); \
  template cudaError_t jax_flash::cuda::sm90::launch_decode_tma<T, D>(const FlashParams&, cudaStream_t);
