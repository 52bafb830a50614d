// Forward FlashAttention kernel for sm_90a: warp specialisation over three roles (see FwdKernelTraitsSm90 for the
// tile choices): a producer warpgroup whose one thread issues every TMA load (FwdMainloop::load), and consumer
// warpgroups that each compute 64 query rows of a tile (FwdMainloop::mma: wgmma and the online softmax) and store
// them (FwdEpilogue::store).
//
// Tiles come from FwdTileScheduler (tile_scheduler_fwd.cuh). Persistent (Traits::kPersistent): at most one CTA per
// SM, CTA c works through the units c, c + gridDim.x, ... (PersistentWalk, with Traits::kSkewedRounds one place on a
// round); with a work counter (Traits::kWorkCounter) as many CTAs, each taking its first unit blockIdx.x and then the
// next unit not yet taken (gridDim.x + a count of FlashParams::fwd_counter), in the order of a CTA per unit;
// otherwise a CTA per unit. The K/V rings and their mbarrier phases run on across a CTA's tiles, and the next tile's
// Q loads once every S of the current tile is done, so the next tile's loads overlap the last PV product and the
// epilogue.
//
// TMA tensor maps view q and o as (head_dim, seqlen_q, heads_q, batch) in boxes of kColBlock columns x tile rows, and
// k, v likewise with heads_kv; out-of-range rows and columns load as zeros (and are masked) and are not stored, so
// no length needs to divide a tile.
#pragma once

#include <type_traits>

#include "flash_params.h"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/sm90/epilogue_fwd_sm90.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/mainloop_fwd_sm90.cuh"
#include "kernels/sm90/tile_scheduler_fwd.cuh"
#include "kernels/sm90/utils_sm90.cuh"
#include "kernels/sm90/work_counter.cuh"
#include "mask.h"

namespace jax_flash::cuda::sm90 {

// kSegments: how the tiles' masks take the call's segment ids (SegmentMode: kNone, the call has none and their tests
// are compiled out; kRuns or kIds, the kernel takes only the tiles of batch elements whose ids are runs, or are not,
// segment_mode_takes: a call with ids runs one grid of each).
// kSoftCap: the call has a logit soft cap (FlashParams::softcap_pre != 0); kFixedReference: its exponentials are taken
// against a fixed reference (FwdMainloop; SoftCap::fixed_reference_holds).
template <typename T, typename Traits, SegmentMode kSegments, bool kSoftCap, bool kFixedReference>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ FlashParams p, const __grid_constant__ CUtensorMap tm_q,
                          const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                          const __grid_constant__ CUtensorMap tm_o) {
#if defined(JAX_FLASH_SM90A)
  using Mainloop = FwdMainloop<T, Traits, kSoftCap, kFixedReference, kSegments == SegmentMode::kRuns>;
  using Epilogue = FwdEpilogue<T, Traits>;
  using Storage = typename Traits::SharedStorage;

  Storage& smem = shared_storage<Storage>();
  const FwdTileScheduler sched(p, Traits::kBlockM, Traits::kPersistent);
  const Mainloop mainloop{p, smem};
  const int tid = threadIdx.x;

  // Calls fn(tile) for each tile of this CTA in order: its PersistentWalk's units when persistent; with a work
  // counter the units the producer thread takes (it publishes each unit's tile in smem.unit for the consumer
  // threads, m_block -1 when none is left); else the one unit blockIdx.x (the grid then has a CTA per unit). Tiles of
  // batch elements that take the other segment policy are the other grid's: a persistent CTA asks once per batch
  // element and steps over the rest of one it does not take (walked unit by unit, the index arithmetic of every tile
  // cost the grid that takes none ~18 us at 4 x 8192 x 16 x 128 on an H200); the other grids ask per tile.
  // `producer`: std::true_type for the producer thread's walk, std::false_type for the consumers' (a work counter's
  // two sides). One walk for both, split by a runtime test of the thread index, kept the producer's scheduler values
  // live in the consumers' loop: 116 B spilled against 84 B (from none before the counter; all outside the key-tile
  // loop); its first form, the consumers also computing the tile from the unit, spilled 132 B and lost 9-11 %.
  auto walk_tiles = [&](auto producer, auto&& fn) {
    if constexpr (Traits::kWorkCounter) {
      for (typename Traits::UnitState us{};; us.advance()) {
        FwdTile tile;
        if constexpr (decltype(producer)::value) {  // a unit is taken only once its slot is free to publish it
          smem.unit_ring.producer_wait_empty(us);
          const int u = next_counted_unit(us.count, p.fwd_counter);
          tile = u < sched.units ? sched.tile(u, 0) : FwdTile{-1, 0, 0};
          smem.unit[us.slot()] = tile;
          mbar_arrive(smem.unit_ring.full_barrier(us));  // (release: the consumers read it after their wait)
        } else {  // the consumers read the tile, not the unit: the scheduler's order stays out of their registers
          smem.unit_ring.consumer_wait(us);
          const FwdTile& published = smem.unit[us.slot()];
          tile = FwdTile{warp_uniform(published.m_block), warp_uniform(published.h), warp_uniform(published.b)};
          smem.unit_ring.consumer_release(us);
        }
        if (tile.m_block < 0) return;
        if (segment_mode_takes<kSegments>(p, tile.b)) fn(tile);
      }
    } else if constexpr (Traits::kPersistent) {
      [[maybe_unused]] int asked_b = -1;
      [[maybe_unused]] bool takes = true;
      PersistentWalk<Traits::kSkewedRounds> walk(int(blockIdx.x), int(gridDim.x));
      while (walk.u < sched.units) {
        const int u = walk.u;
        if constexpr (kSegments != SegmentMode::kNone) {
          const int b = sched.batch_of(u);
          if (b != asked_b) {
            asked_b = b;
            takes = segment_mode_takes<kSegments>(p, b);
          }
          if (!takes) {  // on to this CTA's first unit of batch element b + 1 (or past the end)
            walk.skip_to(int64_t(b + 1) * sched.units_per_batch(), sched.units);
            continue;
          }
        }
        for (int k = 0; k < sched.tiles(u); ++k) fn(sched.tile(u, k));
        walk.advance();
      }
    } else {
      for (int k = 0; k < sched.tiles(blockIdx.x); ++k) {
        const FwdTile tile = sched.tile(blockIdx.x, k);
        if (segment_mode_takes<kSegments>(p, tile.b)) fn(tile);
      }
    }
  };
  auto producer_tiles = [&](auto&& fn) { walk_tiles(std::true_type{}, fn); };
  auto for_each_tile = [&](auto&& fn) { walk_tiles(std::false_type{}, fn); };

  // A grid of one segment policy whose policy no batch element takes (every batch element's ids are runs, or none
  // are) ends at its first barrier: thread b asks for batch element b, the load under the barriers' set-up; a batch
  // of more elements than threads never ends there (a loop over them here spilled the runs kernel's registers).
  [[maybe_unused]] bool takes_any = false;
  if constexpr (kSegments != SegmentMode::kNone) {
    takes_any = (tid < p.batch && segment_mode_takes<kSegments>(p, tid)) || p.batch > Traits::kThreads;
  }
  if (tid == 0) {
    mainloop.init_barriers();
    if constexpr (Traits::kWorkCounter) smem.unit_ring.init(Traits::kConsumerWarpgroups * kWarpgroupThreads);
    mbar_init_fence();
  }
  if constexpr (kSegments == SegmentMode::kNone) {
    __syncthreads();
  } else if (!__syncthreads_or(takes_any)) {
    return;
  }

  // The warpgroup and each tile's key-tile range pass through warp_uniform: then ptxas can tell that every wgmma
  // descriptor (Q's slice, the ring slots) is warp-uniform and builds them on the uniform datapath; computed in
  // vector registers, each was moved over with R2UR per wgmma (d128 step 542 -> 453 instructions, the d64 wide
  // kernel's 494 -> 425 and its spills 184 -> 0 B, d256's 445 -> 419: NOTES, session 50).
  const int warpgroup = warp_uniform(tid / kWarpgroupThreads);
  if (warpgroup == 0) {  // producer
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (tid == 0) mainloop.template load<kSegments>(&tm_q, &tm_k, &tm_v, producer_tiles);
    return;
  }

  // consumers: the main loop, then the epilogue, tile after tile
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int cw = warpgroup - 1;  // consumer warpgroup: query rows [64 cw, 64 cw + 64) of the block
  const int wg_tid = tid % kWarpgroupThreads;
  const int warp = (tid / kWarpSize) % 4;  // warp inside the warpgroup
  const int lane = tid % kWarpSize;
  const Epilogue epilogue{p, smem, &tm_o};
  const typename Mainloop::PingPongT pingpong(cw);
  pingpong.open();

  typename Mainloop::Accumulators acc;
  typename Mainloop::KVState kv;  // ring position of the next key tile
  typename Mainloop::QState q;
  for_each_tile([&](const FwdTile& tile) {
    const AttentionMask mask = kernel_mask_for_batch<kSegments>(p, tile.b);
    const int m0 = tile.m_block * Traits::kBlockM;
    const int rows_valid = imin(Traits::kBlockM, p.seqlen_q - m0);
    int n_begin;
    const int n_tiles = warp_uniform(mainloop.key_tiles(mask, m0, &n_begin));
    n_begin = warp_uniform(n_begin);
    if (n_tiles == 0) {  // no row of this block sees a key: zeros and lse = +inf
      epilogue.store_unattended(tile, m0, rows_valid, tid - kWarpgroupThreads);
      return;
    }
    // With Traits::kWarpgroupKeyRange each warpgroup computes only the key tiles up to the last one its own 64 rows
    // may see (by the interval masks: a causal diagonal's later tiles go, all of them for rows past seqlen_q), taking
    // an empty turn for the others.
    int n_mine = n_tiles;
    if constexpr (Traits::kWarpgroupKeyRange) {
      const int wm0 = m0 + cw * kWgmmaM;
      const int key_end = imin(mask.interval_key_end(wm0, imin(wm0 + kWgmmaM, p.seqlen_q)), p.seqlen_k);
      n_mine = warp_uniform(imin(imax((key_end + Traits::kBlockN - 1) / Traits::kBlockN - n_begin, 0), n_tiles));
    }
    mainloop.mma(mask, m0, n_begin, n_tiles, n_mine, cw, warp, lane, pingpong, kv, q, acc, [] {}, [](int, int) {});
    epilogue.store(tile, mask, m0, rows_valid, acc, cw, warp, lane, wg_tid);
  });
  epilogue.finish(wg_tid);
  pingpong.close();
#else
  __trap();  // built for a target without wgmma; the dispatcher only launches this on compute capability 9.0
#endif
}

}  // namespace jax_flash::cuda::sm90
