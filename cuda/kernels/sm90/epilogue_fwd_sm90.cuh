// The sm_90a forward's epilogue role: a consumer warpgroup normalises its O tile and stores it (rows < seqlen_q,
// columns < head_dim) with the natural-log LSE. With Traits::kStoreOSmem O goes through shared memory (stmatrix into
// 128-byte-swizzled TMA boxes) and one thread per warpgroup stores it with TMA while the next tile starts (waited on
// only before the warpgroup's next epilogue); otherwise each thread stores its pairs from registers.
#pragma once

#include <cmath>

#include "flash_params.h"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/row_finish.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/named_barriers.h"
#include "kernels/sm90/smem_layout.h"
#include "kernels/sm90/tile_scheduler_fwd.cuh"
#include "kernels/sm90/utils_sm90.cuh"
#include "mask.h"

namespace jax_flash::cuda::sm90 {

template <typename T, typename Traits>
struct FwdEpilogue {
  static constexpr int kD = Traits::kHeadDim;
  static constexpr int kBM = Traits::kBlockM;
  static constexpr int kOTiles = kD / 8;
  static constexpr int kConsumerThreads = Traits::kConsumerWarpgroups * kWarpgroupThreads;
  using ET = ElemTraits<T>;
  using Storage = typename Traits::SharedStorage;

  const FlashParams& p;
  Storage& smem;
  const CUtensorMap* tm_o;

  // Rows [m0, m0 + rows_valid) of tile `tile` from a consumer thread's accumulators (warpgroup cw, warp `warp` of
  // it, lane `lane`, thread wg_tid of the warpgroup); `mask` tells rows that see no key (finish_row).
  template <typename Accumulators>
  __device__ __forceinline__ void store(const FwdTile& tile, const AttentionMask& mask, int m0, int rows_valid,
                                        const Accumulators& acc, int cw, int warp, int lane, int wg_tid) const {
    const int g = lane / 4;
    const int t = lane % 4;
    const int warp_row0 = cw * kWgmmaM + warp * kWarpRows;
    RowFinish fin[2];
    auto in_interval = [&](int r, int i) {  // row i (this thread's row g + 8 r) has keys in its interval
      if constexpr (Accumulators::kHasRowBounds) {  // (the main loop kept them)
        return acc.row_lo[r] < acc.row_hi[r];
      } else {
        return mask.lo(i) < mask.hi(i);
      }
    };
    float* gLse = p.lse + (int64_t(tile.b) * p.heads_q + tile.h) * p.seqlen_q + m0;
    const float sink = p.sinks != nullptr ? p.sinks[int64_t(tile.b) * p.heads_q + tile.h] : -INFINITY;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + g + 8 * r;
      // With segment ids a row may see no key inside its interval: the quad's lanes pool what they saw.
      const bool seen = !mask.segments.enabled() || quad_any(acc.seen[r]);
      fin[r] = finish_row(acc.row_max[r], quad_sum(acc.row_sum[r]), p.scale, in_interval(r, m0 + row) && seen, sink);
      if (t == 0 && row < rows_valid) gLse[row] = fin[r].lse;
    }
    if constexpr (Traits::kStoreOSmem) {
      // This warpgroup's O: kColBlocks boxes of 64 rows x 128 bytes, 128-byte swizzled as TMA expects, written
      // with stmatrix (smem_layout.h gives the lane addresses).
      constexpr int kBoxBytes = kWgmmaM * kSwizzleBytes;
      T* o_tile = smem.o + cw * kWgmmaM * kD;  // [kColBlocks][64][64]
      const uint32_t o_base = smem_addr(o_tile);
      const int barrier = kEpilogueBarrier + cw;
      if (wg_tid == 0) bulk_wait_group_read<0>();  // the previous tile's store has read the buffer
      named_barrier_sync(barrier, kWarpgroupThreads);
      stmatrix_acc_to_boxes<ET, kOTiles>(o_base + stmatrix_x4_lane_offset(warp * kWarpRows, lane), kBoxBytes, acc.o,
                                         [&](float x, int r) { return fin[r].scaled(x); });
      fence_proxy_async_smem();
      named_barrier_sync(barrier, kWarpgroupThreads);
      if (wg_tid == 0) {
#pragma unroll
        for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
          tma_store_4d(tm_o, o_tile + cb * kWgmmaM * kColBlock, cb * kColBlock, m0 + cw * kWgmmaM, tile.h, tile.b);
        }
        bulk_commit_group();
      }
    } else {
      const int64_t q_stride = p.q_row_stride();
      T* gO = static_cast<T*>(p.o) + tile.b * p.q_batch_stride() + m0 * q_stride + int64_t(tile.h) * p.head_dim;
      for_each_acc_pair<kOTiles>(warp_row0, rows_valid, 0, p.head_dim, g, t, [&](int row, int col, int i, int r) {
        *reinterpret_cast<uint32_t*>(gO + row * q_stride + col) =
            ET::pack(fin[r].scaled(acc.o[i]), fin[r].scaled(acc.o[i + 1]));
      });
    }
  }

  // A block none of whose rows sees a key: O = 0 and lse = +inf for rows [m0, m0 + rows_valid), spread over the
  // consumer threads (consumer_tid in [0, kConsumerThreads)).
  __device__ __forceinline__ void store_unattended(const FwdTile& tile, int m0, int rows_valid,
                                                   int consumer_tid) const {
    const int64_t q_stride = p.q_row_stride();
    T* gO = static_cast<T*>(p.o) + tile.b * p.q_batch_stride() + m0 * q_stride + int64_t(tile.h) * p.head_dim;
    float* gLse = p.lse + (int64_t(tile.b) * p.heads_q + tile.h) * p.seqlen_q + m0;
    for (int c = consumer_tid; c < rows_valid * (p.head_dim / 8); c += kConsumerThreads) {
      const int row = c / (p.head_dim / 8);
      const int col = (c % (p.head_dim / 8)) * 8;
      *reinterpret_cast<uint4*>(gO + row * q_stride + col) = make_uint4(0, 0, 0, 0);
    }
    for (int r = consumer_tid; r < rows_valid; r += kConsumerThreads) gLse[r] = INFINITY;
  }

  // After a warpgroup's last tile: shared memory must outlive its last store's reads.
  __device__ __forceinline__ void finish(int wg_tid) const {
    if constexpr (Traits::kStoreOSmem) {
      if (wg_tid == 0) bulk_wait_group<0>();
    }
  }
};

}  // namespace jax_flash::cuda::sm90
