// Named hardware barriers of the sm_90a kernels: 16 per CTA, id 0 is __syncthreads'. Ids are compile-time
// constants plus a warpgroup index (runtime ids make ptxas reserve all 16; the backward's kDsReadyBarrier adds a
// tile parity, and that kernel uses all 16). The forward and the backward kernels
// are separate launches and number theirs independently; a per-warpgroup barrier takes id + warpgroup index, so
// the next id leaves room for every warpgroup.
#pragma once

#include "kernels/sm90/kernel_traits_sm90.h"  // kMaxConsumerWarpgroups

namespace jax_flash::cuda::sm90 {

enum NamedBarrier : int {
  // Forward (flash_fwd_sm90_tma_wgmma_ws.cuh).
  kPingPongBarrier = 1,                                       // 1..3: a consumer warpgroup's turn to issue wgmma
  kEpilogueBarrier = kPingPongBarrier + kMaxConsumerWarpgroups,  // 4..6: a consumer warpgroup's O tile in smem
  kFwdBarrierEnd = kEpilogueBarrier + kMaxConsumerWarpgroups,
  // The TMA decode kernel (flash_decode_tma_sm90.cuh, the forward's main loop): both consumer warpgroups zeroed the
  // keys outside the range in a V tile (256 threads).
  kDecodeTailBarrier = kFwdBarrierEnd,
  // The forward's main loop with a bfloat16 soft cap on the tiles that take it (FwdMainloop::kScaledQ): a consumer
  // warpgroup's rows of Q are scaled in shared memory (scale_warpgroup_rows; 128 threads).
  kQScaledBarrier = kDecodeTailBarrier + 1,  // 8..10

  // Backward (flash_bwd_sm90_tma_wgmma_ws.cuh; the head-dim-256 kernel uses the first).
  kDsBarrier = 1,       // both consumer warpgroups wrote dS^T (each tile at head dim 64); after a unit's loop,
                        // dS^T is free; at head dim 64, after its dK/dV stores have read the staging buffers, those
                        // are free (256)
  kStagingFreeBarrier = 2,  // with a lagging dQ, the previous unit's dK/dV stores have read the staging buffers
                            // (dS^T and dQ): the follower's 128 threads arrive, the leader's 128 wait (256)
  kDqFullBarrier = 4,   // 4..5: a consumer warpgroup's dQ tile is in shared memory (128 + the dQ writer warp)
  kDqEmptyBarrier = 6,  // 6..7: the writer has read that tile (128 + the dQ writer warp)
  kKvStoreBarrier = 8,  // 8..9: a consumer warpgroup's dK and dV are in shared memory (128 threads); with a
                        // lagging dQ also its dS^T before the last dQ of a unit of one query tile
  kDqDrainedBarrier = 10,  // 10..11: the writer has read a unit's last dQ tile of that warpgroup (128 + the writer)
  kDsReadyBarrier = 12,    // 12..15: with a lagging dQ, warpgroup w stored the dS^T of a query tile of parity p
                           // and finished the tile before's dQ (id 12 + 2 w + p; w's 128 threads arrive, the
                           // other warpgroup's 128 wait)
  kBwdBarrierEnd = 16,
};
static_assert(kQScaledBarrier + kMaxConsumerWarpgroups <= 16 && kBwdBarrierEnd <= 16, "16 named barriers per CTA");

}  // namespace jax_flash::cuda::sm90
