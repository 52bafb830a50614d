// Backward FlashAttention kernel for sm_90a, key/value stationary (see BwdKernelTraitsSm90 for the CTA's roles).
// The row-statistics preprocess and the dQ conversion around it are shared with every backward
// (common/bwd_pre_post.cuh). Per thread of a consumer warpgroup (warp w, lane = 4 g + t): keys 16 w + g and
// 16 w + g + 8 of the warpgroup's 64, queries 8 j + 2 t (+1) of every 8-wide column tile j of S^T and dP^T.
//
// Persistent: each CTA takes (key block, kv head, batch) units one after another (tile_scheduler_bwd.cuh). The
// producer thread publishes each unit in unit_ring for the other roles; every role walks the same units and
// skips the same empty ones. The rings' states (unit, K/V, Q/dO) run on across units. K and V have one-stage rings
// of their own, freed at a unit's end (V after its last dP^T, K after its last dQ: inside the last query tile, or at
// head dim 128, whose dQ lags a tile, after the loop), and dK/dV leave through the dS^T and dQ buffers, so the next
// unit's K and V load under the last products and the epilogue.
#pragma once

#include <cmath>

#include "flash_params.h"
#include "kernels/common/block_ranges.cuh"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/sm90/common_bwd_sm90.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/named_barriers.h"
#include "kernels/sm90/pipeline.cuh"
#include "kernels/sm90/smem_layout.h"
#include "kernels/sm90/tile_scheduler_bwd.cuh"
#include "kernels/sm90/utils_sm90.cuh"
#include "kernels/sm90/wgmma_sm90.cuh"
#include "mask.h"

namespace jax_flash::cuda::sm90 {

inline constexpr int kDqWriterWarp = 1;  // producer warp that issues the dQ reductions

// kDeterministic: the key blocks add into each dQ tile in ascending order (FlashParams::deterministic).
// kSegments: the call has segment ids (false: their tests are compiled out; true: each batch element takes them as
// runs or as ids, see with_segment_mode and kernel_mask_for_batch).
// kSoftCap: the call has a logit soft cap (FlashParams::softcap_pre != 0).
template <typename T, typename Traits, bool kDeterministic, bool kSegments, bool kSoftCap>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_bwd_sm90_kernel(const __grid_constant__ FlashParams p, const __grid_constant__ CUtensorMap tm_q,
                          const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                          const __grid_constant__ CUtensorMap tm_do, const __grid_constant__ CUtensorMap tm_dk,
                          const __grid_constant__ CUtensorMap tm_dv) {
#if defined(JAX_FLASH_SM90A)
  constexpr int kD = Traits::kHeadDim;
  constexpr int kBM = Traits::kBlockM;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kSTiles = kBM / 8;      // 8-wide column tiles of S^T (queries)
  constexpr int kDTiles = kD / 8;       // 8-wide column tiles of dK, dV
  constexpr int kDqRows = Traits::kDqRows;
  constexpr int kDqCols = Traits::kDqCols;
  constexpr int kDqTiles = kDqCols / 8;
  constexpr int kDqWgThreads = kWarpgroupThreads + kWarpSize;  // a consumer warpgroup and the dQ writer warp
  using ET = ElemTraits<T>;
  using Storage = typename Traits::SharedStorage;

  Storage& smem = shared_storage<Storage>();
  const int tid = threadIdx.x;
  // Deterministic dQ keeps one CTA per unit and the key-block-fastest order (tile_scheduler_bwd.cuh).
  constexpr bool kPersistent = !kDeterministic;
  const BwdTileScheduler sched(p, kBM, kBN, kPersistent ? int(gridDim.x) : 0);
  constexpr int kConsumerThreads = Traits::kConsumerWarpgroups * kWarpgroupThreads;

  // Every ring's state counts its uses since the kernel began (pipeline.h): units, K/V loads, Q/dO tiles.
  using UnitState = PipelineState<2>;
  using KvState = PipelineState<1>;
  using QdOState = PipelineState<kStages>;
  if (tid == 0) {
    smem.unit_ring.init(kConsumerThreads + kWarpSize);  // each consumer thread and the writer warp read a unit
    smem.k_ring.init(Traits::kConsumerWarpgroups);  // a thread of each consumer warpgroup frees K after its last dQ,
    smem.v_ring.init(Traits::kConsumerWarpgroups);  // and V after its last dP^T
    smem.qdo_ring.init(kConsumerThreads);  // every consumer thread releases a stage after its last read of it
    mbar_init_fence();
  }
  __syncthreads();

  // The unit of `us` as the producer published it: the unit (none, sched.done(), once the work is done) and its
  // walk over query tiles. Read by whole warps, as warp-uniform values: the walk sets every stage and buffer offset,
  // and only provably uniform values keep the wgmma descriptors' arithmetic on the uniform datapath (loaded from
  // shared memory they would not be: ~160 more instructions per query tile).
  auto unit_of = [&](UnitState us) -> const BwdUnitSlot& { return smem.unit[us.slot()]; };
  auto uniform_unit = [&](UnitState us) { return warp_uniform(unit_of(us).unit); };
  auto walk_of = [&](UnitState us, int hk) {
    const BwdUnitSlot& slot = unit_of(us);
    return QueryTileWalk<kBM>{warp_uniform(slot.first), warp_uniform(slot.count), p.group_size(), hk};
  };
  // The walk's iterations this unit or part takes, [lo, lo + n), and where the first stands.
  auto iters_of = [&](UnitState us) { return warp_uniform(unit_of(us).n); };
  auto start_of = [&](UnitState us, const QueryTileWalk<kBM>& walk) {
    const int lo = warp_uniform(unit_of(us).lo);
    return typename QueryTileWalk<kBM>::Position{warp_uniform(walk.row0(lo)), warp_uniform(walk.head(lo))};
  };

  const int warpgroup = tid / kWarpgroupThreads;
  if (warpgroup == 0) {
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (tid / kWarpSize == kDqWriterWarp) {
      // ---- dQ writer warp: adds each query tile's dQ, one bulk reduction per consumer warpgroup ------------------
      const int lane = tid % kWarpSize;
      const bool lane0 = lane == 0;
      for (UnitState us{};; us.advance()) {
        smem.unit_ring.consumer_wait(us);
        const int u = uniform_unit(us);
        if (sched.done(u)) break;
        const BwdTile tile = sched.tile(u);
        const auto walk = walk_of(us, tile.hk);
        const int iters = iters_of(us);
        auto pos = start_of(us, walk);
        smem.unit_ring.consumer_release(us);
        // Deterministic dQ: the key blocks that see query tile m_block add into it in ascending order; this block's
        // turn comes when the tile's semaphore equals the number of such key blocks before it.
        auto key_blocks_before = [&](int m_block) {
          int count = 0;
          with_segment_mode<kSegments>(p, tile.b, [&](auto segment_mode) {
            const AttentionMask mask = kernel_mask_for_batch<decltype(segment_mode)::value>(p, tile.b);
            for (int base = 0; base < tile.n_block; base += kWarpSize) {
              const int n = base + lane;
              bool sees = false;
              if (n < tile.n_block) {
                int mf, mc;
                query_tiles_for_keys<kBN, kBM>(mask, p, n * kBN, &mf, &mc);
                sees = mf <= m_block && m_block < mf + mc;
              }
              count += __popc(__ballot_sync(0xffffffffu, sees));
            }
          });
          return count;
        };
        {
          // Each warpgroup's buffer: free at the unit's start (its last reader was the previous unit's epilogue,
          // which the consumers order themselves), then after each reduction has read it; after the unit's last
          // one the consumers' epilogue waits on kDqDrainedBarrier instead.
          if (iters > 0) {
#pragma unroll
            for (int wg = 0; wg < Traits::kConsumerWarpgroups; ++wg) {
              named_barrier_arrive(kDqEmptyBarrier + wg, kDqWgThreads);
            }
          }
          // The warpgroups' dQ buffers are free again: kDqEmptyBarrier + wg, or after a unit's last query tile
          // kDqDrainedBarrier + wg (named barrier ids stay compile-time constants: named_barriers.h).
          auto release = [&](int wg, bool last) {
            if (last) {
              named_barrier_arrive(kDqDrainedBarrier + wg, kDqWgThreads);
            } else {
              named_barrier_arrive(kDqEmptyBarrier + wg, kDqWgThreads);
            }
          };
          for (int it = 0; it < iters; ++it, walk.advance(pos)) {
            const bool last = it + 1 == iters;
            [[maybe_unused]] int32_t* semaphore = nullptr;
            if constexpr (kDeterministic) {
              const int m_block = pos.row0 / kBM;
              const int turn = key_blocks_before(m_block);
              semaphore = p.dq_semaphore + (int64_t(tile.b) * p.heads_q + pos.head) * p.seqlen_q + m_block;
              if (lane0) {
                while (ld_acquire_gpu(semaphore) != turn) {
                }
              }
              __syncwarp();
            }
            // The query tile's dQ in dq_accum (DqFragmentOrder: warpgroup wg's part starts wg * kDqWgBytes in).
            float* dq_tile = p.dq_accum_of(tile.b, pos.head) + int64_t(pos.row0) * kD;
#pragma unroll
            for (int wg = 0; wg < Traits::kConsumerWarpgroups; ++wg) {
              named_barrier_sync(kDqFullBarrier + wg, kDqWgThreads);
              if (lane0) {
                bulk_reduce_add_f32(dq_tile + wg * kDqRows * kDqCols, smem.dq[wg], Traits::kDqWgBytes);
                bulk_commit_group();
              }
            }
            if constexpr (kDeterministic) {  // the adds have landed before the next key block's turn
              if (lane0) {
                bulk_wait_group<0>();
                fence_proxy_async_global();
                red_release_gpu_add(semaphore, 1);
              }
              __syncwarp();
#pragma unroll
              for (int wg = 0; wg < Traits::kConsumerWarpgroups; ++wg) release(wg, last);
            } else {  // each warpgroup's buffer is free as soon as its own reduction has read it
              static_assert(Traits::kConsumerWarpgroups == 2, "one pending group after the first warpgroup's");
              if (lane0) bulk_wait_group_read<1>();
              __syncwarp();
              release(0, last);
              if (lane0) bulk_wait_group_read<0>();
              __syncwarp();
              release(1, last);
            }
          }
        }
      }
      if (lane0) bulk_wait_group<0>();  // the reductions are complete before the CTA exits
    } else if (tid == 0) {
      // ---- producer thread: takes the units, loads K/V once per unit and Q, dO and statistics per query tile ----
      prefetch_tensor_map(&tm_q);
      prefetch_tensor_map(&tm_k);
      prefetch_tensor_map(&tm_v);
      prefetch_tensor_map(&tm_do);
      KvState kvs{};
      QdOState qdo{};
      for (UnitState us{};; us.advance()) {
        smem.unit_ring.producer_wait_empty(us);  // then take the unit: a CTA holds one only when it can publish it
        const int u = sched.next_unit<kPersistent>(p, us.count);
        auto publish = [&](int first, int count, int lo, int n) {
          smem.unit[us.slot()] = BwdUnitSlot{u, first, count, lo, n, sched.part_of(u), sched.flags_of(u)};
          mbar_arrive(smem.unit_ring.full_barrier(us));  // (release: the other roles read it after their wait)
        };
        if (sched.done(u)) {
          publish(0, 0, 0, 0);
          break;
        }
        const BwdTile tile = sched.tile(u);
        const int n0 = tile.n_block * kBN;
        QueryTileWalk<kBM> walk;
        with_segment_mode<kSegments>(p, tile.b, [&](auto segment_mode) {
          walk = query_tile_walk<kBN, kBM>(kernel_mask_for_batch<decltype(segment_mode)::value>(p, tile.b), p, n0,
                                           tile.hk);
        });
        int lo, iters;
        BwdTileScheduler::part_range(walk.iters(), sched.part_of(u), sched.parts_of(u), &lo, &iters);
        publish(walk.first, walk.count, lo, iters);
        {
          // V once the consumers' last dP^T of the previous unit is done, K once its last dQ is, then the query tiles
          // as their stages free up.
          if (iters > 0) {
            constexpr uint32_t kTileBytes = kBN * kD * sizeof(T);  // K or V
            smem.v_ring.producer_acquire(kvs, kTileBytes);
            load_key_block_rows<kBN, Traits::kColBlocks>(smem.v, &tm_v, smem.v_ring.full_barrier(kvs), n0, tile.hk,
                                                         tile.b);
            smem.k_ring.producer_acquire(kvs, kTileBytes);
            load_key_block_rows<kBN, Traits::kColBlocks>(smem.k, &tm_k, smem.k_ring.full_barrier(kvs), n0, tile.hk,
                                                         tile.b);
            kvs.advance();
          }
          auto pos = typename QueryTileWalk<kBM>::Position{walk.row0(lo), walk.head(lo)};
#pragma unroll 1  // one thread issuing loads: unrolling only costs its 24 registers
          for (int it = 0; it < iters; ++it, walk.advance(pos), qdo.advance()) {
            const int s = qdo.slot();
            const int h = pos.head;
            const int m0 = pos.row0;
            smem.qdo_ring.producer_acquire(qdo, Traits::kQdOBytes);
            uint64_t* full = smem.qdo_ring.full_barrier(qdo);
#pragma unroll
            for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
              tma_load_4d(smem.q[s] + cb * kBM * kColBlock, &tm_q, full, cb * kColBlock, m0, h, tile.b);
              tma_load_4d(smem.dout[s] + cb * kBM * kColBlock, &tm_do, full, cb * kColBlock, m0, h, tile.b);
            }
            // Row statistics of the tile's rows (padded to whole tiles: rows past seqlen_q hold 0, which makes
            // their dS^T and dV terms 0 since their Q and dO load as zeros).
            bulk_load_1d(smem.stats[s], p.lse_log2_of(tile.b, h) + m0, Traits::kStatsBytes, full);
            bulk_load_1d(smem.stats[s] + kBM, p.dsum_of(tile.b, h) + m0, Traits::kStatsBytes, full);
          }
        }
      }
    }
    return;
  }

  // ---- consumers ---------------------------------------------------------------------------------------------------
  setmaxnreg_inc<Traits::kConsumerRegs>();
  KvState kvs{};
  QdOState qdo{};
  for (UnitState us{};; us.advance()) {
    smem.unit_ring.consumer_wait(us);
    const int u = uniform_unit(us);
    if (sched.done(u)) break;
    const BwdTile tile = sched.tile(u);

    // A batch element whose segment ids are contiguous runs takes them as per-row key intervals (RunPolicy), the
    // others as ids: one copy of the body per policy (with_segment_mode).
    with_segment_mode<kSegments>(p, tile.b, [&](auto segment_mode) {
      const AttentionMask mask = kernel_mask_for_batch<decltype(segment_mode)::value>(p, tile.b);
      const SoftCap cap(p);

      const auto [n0, keys_valid, kv_stride, kv_off, gdK, gdV] = key_block<kBN, T>(p, tile.n_block, tile.hk, tile.b);

      const auto walk = walk_of(us, tile.hk);
      const int iters = iters_of(us);
      if (iters == 0) {  // no query sees these keys: zero gradients (a part with no share of a walk: nothing)
        if (walk.count == 0) {
          zero_kv_grads<kConsumerThreads>(gdK, gdV, kv_stride, keys_valid, p.head_dim, tid - kWarpgroupThreads);
        }
        return;
      }

      const int cw = warp_uniform(warpgroup - 1);  // keys [64 cw, 64 cw + 64) of the block
      const int wg_tid = tid % kWarpgroupThreads;
      const int warp = wg_tid / kWarpSize;
      const int lane = tid % kWarpSize;
      const int g = lane / 4;
      const int t = lane % 4;
      const int key_row0 = cw * kWgmmaM + warp * kWarpRows;  // first of this warp's 16 keys inside the block

      float acc_dk[kDTiles * 4];
      float acc_dv[kDTiles * 4];
#pragma unroll
      for (int i = 0; i < kDTiles * 4; ++i) acc_dk[i] = acc_dv[i] = 0.f;

      // Shared-memory descriptors, built once and advanced by compile-time offsets (k-steps) and stage strides.
      // K-major operands step 32 bytes inside a 128-byte row per k-step and one column block (kKVColBlockBytes,
      // kQColBlockBytes) per 64 elements; N-major ones step 16 rows (kNMajorStep) per k-step, their 64-wide blocks
      // the leading offset apart.
      constexpr uint32_t kKVColBlockBytes = kBN * kSwizzleBytes;
      constexpr uint32_t kQColBlockBytes = kBM * kSwizzleBytes;
      constexpr uint32_t kQdOStageBytes = sizeof(smem.q[0]);
      constexpr uint32_t kDsBufferBytes = sizeof(smem.ds[0]);
      constexpr uint32_t kNMajorStep = kWgmmaK * kSwizzleBytes;
      constexpr int kKStepsPerColBlock = kColBlock / kWgmmaK;
      static_assert(sizeof(smem.dout[0]) == kQdOStageBytes, "Q and dO stages have one size");
      const uint32_t k_rows = smem_addr(smem.k) + cw * kWgmmaM * kSwizzleBytes;  // this warpgroup's 64 keys
      const uint32_t v_rows = smem_addr(smem.v) + cw * kWgmmaM * kSwizzleBytes;
      // dQ = dS K, B = K read N-major: columns [dq_col0, +kDqCols), their 64-wide block, then bytes into the row.
      const int dq_col0 = Traits::kDqSplitRows ? 0 : cw * kDqCols;
      const uint32_t k_cols = smem_addr(smem.k) + (dq_col0 / kColBlock) * kKVColBlockBytes +
                              (dq_col0 % kColBlock) * sizeof(T);
      const uint64_t desc_k_rows = make_desc_sw128(k_rows, kKMajorLeadingBytes);          // A of S^T
      const uint64_t desc_v_rows = make_desc_sw128(v_rows, kKMajorLeadingBytes);          // A of dP^T
      const uint64_t desc_k_cols = make_desc_sw128(k_cols, kKVColBlockBytes);             // B of dQ
      const uint64_t desc_q_k = make_desc_sw128(smem_addr(smem.q[0]), kKMajorLeadingBytes);      // B of S^T
      const uint64_t desc_do_k = make_desc_sw128(smem_addr(smem.dout[0]), kKMajorLeadingBytes);  // B of dP^T
      const uint64_t desc_q_n = make_desc_sw128(smem_addr(smem.q[0]), kQColBlockBytes);          // B of dK
      const uint64_t desc_do_n = make_desc_sw128(smem_addr(smem.dout[0]), kQColBlockBytes);      // B of dV
      // A of dQ (M-major): dS^T's 64-query column block of this warpgroup's dQ rows (the only one with 64 queries).
      constexpr uint32_t kDsColBlockBytes = kBN * kSwizzleBytes;
      const uint64_t desc_ds = make_desc_sw128(
          smem_addr(smem.ds[0]) + (Traits::kDqSplitRows ? cw * kDsColBlockBytes : 0), kDsColBlockBytes);
      // dS^T stores with stmatrix: 16 queries (two 8-column tiles) per step, step kk at pair kk % 4 of its 64-query
      // column block (smem_layout.h gives the lane addresses).
      const uint32_t ds_lane = stmatrix_x4_lane_offset(key_row0, lane);
      // dQ stores (DqFragmentOrder): column tile j of this thread's accumulator is float4 j * 128 + wg_tid.
      const uint32_t dq_thread = smem_addr(smem.dq[cw]) + wg_tid * sizeof(float4);
      // Runs: when every key of the block lies in one run (its first and last keys have the same rows), a query
      // tile inside that run's rows sees the whole block as far as the runs go, and takes the mask without them: no
      // bound loads for its masking (Nsight Compute: those loads held ~6 % of the packed backward's stall samples).
      constexpr bool kRunsBody = decltype(segment_mode)::value == SegmentMode::kRuns;
      int run_rows_lo = 0, run_rows_hi = 0;  // empty: every tile takes the runs
      if constexpr (kRunsBody) {
        int lo0, hi0, lo1, hi1;
        mask.runs.rows_of_key(n0, mask.length.kv_len, &lo0, &hi0);
        mask.runs.rows_of_key(n0 + kBN - 1, mask.length.kv_len, &lo1, &hi1);
        if (lo0 == lo1 && hi0 == hi1) {
          run_rows_lo = lo0;
          run_rows_hi = hi0;
        }
      }
      smem.k_ring.consumer_wait(kvs);
      smem.v_ring.consumer_wait(kvs);

      // dQ (kDqRows x kDqCols of this warpgroup) = dS K over all kBN keys from dS^T buffer `buffer`: A = dS read
      // M-major from dS^T, B = K read N-major.
      auto issue_dq = [&](float (&acc_dq)[kDqTiles * 4], int buffer) {
        const uint64_t desc_ds_cur = desc_advance(desc_ds, buffer * kDsBufferBytes);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kBN / kWgmmaK; ++kk) {
          Wgmma<kDqCols, T, 1>::template ss<1>(acc_dq, desc_advance(desc_ds_cur, kk * kNMajorStep),
                                               desc_advance(desc_k_cols, kk * kNMajorStep), kk > 0);
        }
        wgmma_commit();
      };
      // dQ -> shared memory (float32, DqFragmentOrder) once the writer warp has read the previous one; the writer
      // adds it to the accumulator.
      auto stage_dq = [&](const float (&acc_dq)[kDqTiles * 4]) {
        named_barrier_sync(kDqEmptyBarrier + cw, kDqWgThreads);
#pragma unroll
        for (int j = 0; j < kDqTiles; ++j) {
          st_shared_f32x4(dq_thread + j * kWarpgroupThreads * sizeof(float4), acc_dq[4 * j], acc_dq[4 * j + 1],
                          acc_dq[4 * j + 2], acc_dq[4 * j + 3]);
        }
        fence_proxy_async_smem();
        named_barrier_arrive(kDqFullBarrier + cw, kDqWgThreads);
      };
      // kDqLags (64-query tiles): a warpgroup's dQ needs both warpgroups' dS^T of the tile, so it computes query tile
      // i's dQ in tile i + 1 (the unit's last after the loop), and the warpgroups take turns instead of meeting:
      // warpgroup 1 issues tile i's S^T and dP^T once warpgroup 0 has announced tile i, so that each one's
      // exponentials run under the other's GEMMs, and warpgroup 0 stores tile i's dS^T once 1 has announced tile
      // i - 1. A warpgroup announces tile i (ds_ready) after storing its dS^T(i) and finishing its dQ(i - 1), which
      // read the buffer that dS^T(i + 1) overwrites (two buffers, by tile parity). Each wait on the other
      // warpgroup's announcement of a parity comes before this one's next announcement of that parity, so the
      // one-sided barriers (the announcing warpgroup's 128 threads arrive, the other's wait) never overrun.
      constexpr bool kDqLags = Traits::kDqLags;
      const bool follower = cw == 1;
      const int other = 1 - cw;
      auto ds_ready = [](int wg, int it) { return kDsReadyBarrier + 2 * wg + (it & 1); };
      // The previous unit's epilogue (if this CTA had one) staged dK in the dS^T buffers and dV in the dQ buffers for
      // TMA stores that it did not wait for: each warpgroup's storing thread waits for its store's reads before the
      // unit's first dS^T store, the follower's announced to the leader on kStagingFreeBarrier (the follower arrives
      // before its first wait for the leader; the follower's own stores come after the leader's first announcement).
      const bool staging_pending = kDqLags && kvs.count > 0;
      auto staging_read = [&] {
        if (wg_tid == 0) bulk_wait_group_read<0>();
      };

      auto pos = start_of(us, walk);
      for (int it = 0; it < iters; ++it, walk.advance(pos), qdo.advance()) {
        const int m0 = pos.row0;
        const uint32_t stage_off = qdo.slot() * kQdOStageBytes;

        // S^T = K Q^T and dP^T = V dO^T (64 keys x kBM queries), both operands K-major in shared memory; two groups
        // so the exponentials of S^T run under the dP^T GEMM.
        float acc_s[kSTiles * 4];
        float acc_dp[kSTiles * 4];
        smem.qdo_ring.consumer_wait(qdo);
        // acc (64 x kBM) = A B^T over the head dim: A = 64 rows of K or V, B = the Q or dO tile.
        auto issue_rows_times_tile = [&](float (&acc)[kSTiles * 4], uint64_t a_desc, uint64_t b_desc) {
#pragma unroll
          for (int kk = 0; kk < kD / kWgmmaK; ++kk) {
            const uint32_t off = (kk % kKStepsPerColBlock) * (kWgmmaK * sizeof(T));
            const uint32_t cb = kk / kKStepsPerColBlock;
            Wgmma<kBM, T, 0>::ss(acc, desc_advance(a_desc, cb * kKVColBlockBytes + off),
                                 desc_advance(b_desc, cb * kQColBlockBytes + off), kk > 0);
          }
          wgmma_commit();
        };
        // This thread's queries 8 j + 2 t, +1: lse * log2(e) as pairs (dsum is read later, to keep registers free).
        // Loaded before the GEMMs are issued: behind them in the MIO queue these loads return only as the dP^T
        // GEMM's instructions are accepted, after S^T is done (Nsight Compute: ~10 % of the stall samples).
        const uint32_t stats = smem_addr(smem.stats[qdo.slot()]);
        float2 lse_log2[kSTiles];
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) lse_log2[j] = ld_shared_f32x2(stats + (8 * j + 2 * t) * sizeof(float));
        if (kDqLags && follower) {
          if (it == 0 && staging_pending) {
            staging_read();
            named_barrier_arrive(kStagingFreeBarrier, kConsumerThreads);
          }
          named_barrier_sync(ds_ready(0, it), kConsumerThreads);
        }
        wgmma_fence();
        issue_rows_times_tile(acc_s, desc_k_rows, desc_advance(desc_q_k, stage_off));
        issue_rows_times_tile(acc_dp, desc_v_rows, desc_advance(desc_do_k, stage_off));

        // P^T = exp2(S^T * scale_log2 - lse * log2(e)), masked; element e of column tile j is key g + 8 (e / 2),
        // query 8 j + 2 t + e % 2.
        wgmma_wait<1>();
        fence_regs(acc_s);
        uint32_t dcap[kSTiles * 2];  // with a soft cap: 1 - tanh^2 of the pairs (as T pairs)
        const bool inside_run = kRunsBody && m0 >= run_rows_lo && m0 + kBM <= run_rows_hi;
        AttentionMask tile_mask = mask;
        if (inside_run) tile_mask.runs = RunPolicy{};
        // Whether the warp's part of the tile needs masking. Inside the run the question goes to a mask whose
        // RunPolicy is empty on this path alone, so its bound loads and their arithmetic are compiled out of it (the
        // runtime choice above keeps them as predicated code: ~20 instructions a warp and tile; NOTES, session 48).
        auto masking = [&] {
          auto ask = [&](const AttentionMask& m) {
            return m.tile_masking_warp(m0, m0 + kBM, n0 + key_row0, n0 + key_row0 + kWarpRows, p.seqlen_q);
          };
          if (inside_run) {
            AttentionMask without_runs = mask;
            without_runs.runs = RunPolicy{};
            return ask(without_runs);
          }
          return ask(mask);
        };
        const TileMasking how = probs_from_scores<T, kSTiles, kSoftCap, kSoftCap ? Traits::kCapExpOnFmaEvery : 0>(
            acc_s, dcap, lse_log2, p.scale_log2, cap, tile_mask, masking, m0, n0 + key_row0, g, t);
        // dS^T = P^T * (dP^T - dsum) (times 1 - tanh^2 with a cap).
        float2 dsum[kSTiles];
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) dsum[j] = ld_shared_f32x2(stats + (kBM + 8 * j + 2 * t) * sizeof(float));
        wgmma_wait<0>();
        fence_regs(acc_dp);
        if (it + 1 == iters && wg_tid == 0) smem.v_ring.consumer_release(kvs);  // the unit's last read of V
        dscores_from_probs<T, kSTiles, kSoftCap>(acc_dp, acc_s, dsum, dcap, how, tile_mask, m0, n0 + key_row0, g, t);
        // As wgmma A fragments (16 queries per step = column tiles 2 kk, 2 kk + 1).
        uint32_t a_p[kBM / kWgmmaK][4], a_ds[kBM / kWgmmaK][4];
#pragma unroll
        for (int kk = 0; kk < kBM / kWgmmaK; ++kk) {
#pragma unroll
          for (int q4 = 0; q4 < 4; ++q4) {
            a_p[kk][q4] = ET::pack(acc_s[8 * kk + 2 * q4], acc_s[8 * kk + 2 * q4 + 1]);
            a_ds[kk][q4] = pack_dscores<T, kSoftCap>(acc_dp[8 * kk + 2 * q4], acc_dp[8 * kk + 2 * q4 + 1],
                                                     dcap[4 * kk + q4]);
          }
        }

        // dS^T -> shared memory ([64-query column block][key][64 queries], 128-byte swizzled rows) for dQ; fragment
        // q4 holds key row g + 8 (q4 % 2), queries 16 kk + 8 (q4 / 2) + 2 t (+1).
        auto store_ds = [&](int buffer) {
          const uint32_t ds_base = smem_addr(smem.ds[buffer]);
#pragma unroll
          for (int kk = 0; kk < kBM / kWgmmaK; ++kk) {
            constexpr int kStepsPerColBlock = kColBlock / kWgmmaK;  // 16-query steps in a 64-query column block
            const uint32_t addr = ds_base + (kk / kStepsPerColBlock) * kDsColBlockBytes +
                                  stmatrix_x4_pair_offset(ds_lane, kk % kStepsPerColBlock);
            stmatrix_x4(addr, a_ds[kk][0], a_ds[kk][1], a_ds[kk][2], a_ds[kk][3]);
          }
        };
        // dV += P^T dO (B read N-major); dK += dS^T Q (B = Q read N-major).
        auto issue_dv = [&] {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < kBM / kWgmmaK; ++kk) {
            Wgmma<kD, T, 1>::rs(acc_dv, a_p[kk], desc_advance(desc_do_n, stage_off + kk * kNMajorStep), 1);
          }
          wgmma_commit();
        };
        auto issue_dk = [&] {
#pragma unroll
          for (int kk = 0; kk < kBM / kWgmmaK; ++kk) {
            Wgmma<kD, T, 1>::rs(acc_dk, a_ds[kk], desc_advance(desc_q_n, stage_off + kk * kNMajorStep), 1);
          }
          wgmma_commit();
        };

        if constexpr (kDqLags) {
          // dS^T(it), then dQ(it - 1), dV(it), dK(it); dQ is staged while dV and dK run. (dQ's issue and its wait
          // sit in one branch: a runtime test around the issue alone, with the wait after the join, made ptxas
          // serialise every wgmma, C7514.)
          if (it > 0) {
            if (!follower) named_barrier_sync(ds_ready(other, it - 1), kConsumerThreads);
            store_ds(it & 1);
            fence_proxy_async_smem();
            float acc_dq[kDqTiles * 4];
            issue_dq(acc_dq, (it - 1) & 1);
            issue_dv();
            issue_dk();
            wgmma_wait<2>();
            named_barrier_arrive(ds_ready(cw, it), kConsumerThreads);
            fence_regs(acc_dq);
            stage_dq(acc_dq);
          } else {
            if (!follower && staging_pending) {
              staging_read();
              named_barrier_sync(kStagingFreeBarrier, kConsumerThreads);
            }
            store_ds(it & 1);
            fence_proxy_async_smem();
            named_barrier_arrive(ds_ready(cw, it), kConsumerThreads);
            issue_dv();
            issue_dk();
          }
          wgmma_wait<0>();
          fence_regs(acc_dv);
          fence_regs(a_p);
        } else {
          // Stored before dV is issued: behind the dV GEMM's instructions in the MIO queue the stores would complete
          // only as those are accepted, and the proxy fence below waits for them.
          store_ds(it & 1);
          // dV runs while the warpgroups meet.
          issue_dv();
          fence_proxy_async_smem();
          named_barrier_sync(kDsBarrier, kConsumerThreads);
          // dQ (kDqRows x kDqCols of this warpgroup) over all kBN keys, then dK.
          float acc_dq[kDqTiles * 4];
          issue_dq(acc_dq, it & 1);
          issue_dk();
          // dQ -> shared memory while dK runs.
          wgmma_wait<1>();
          fence_regs(acc_dv);
          fence_regs(a_p);
          fence_regs(acc_dq);
          if (it + 1 == iters && wg_tid == 0) smem.k_ring.consumer_release(kvs);  // the unit's last read of K
          stage_dq(acc_dq);
          wgmma_wait<0>();
        }
        fence_regs(acc_dk);
        fence_regs(a_ds);
        smem.qdo_ring.consumer_release(qdo);  // its wgmma reads and statistics loads are done
      }
      if constexpr (kDqLags) {  // the unit's last query tile's dQ
        // The leader waits for the follower's last dS^T. The follower has the leader's (its wait at the tile's
        // start), and its own warps' stores are ordered before this wgmma by the last tile's dQ staging barrier,
        // or, in a unit of one query tile, which has none, by a barrier of its own warps.
        if (!follower) {
          named_barrier_sync(ds_ready(other, iters - 1), kConsumerThreads);
        } else if (iters == 1) {
          named_barrier_sync(kKvStoreBarrier + cw, kWarpgroupThreads);
        }
        float acc_dq[kDqTiles * 4];
        issue_dq(acc_dq, (iters - 1) & 1);
        wgmma_wait<0>();
        fence_regs(acc_dq);
        if (wg_tid == 0) smem.k_ring.consumer_release(kvs);  // the unit's last read of K
        stage_dq(acc_dq);
      }

      // Epilogue: dK = scale * dS^T Q and dV = P^T dO leave through shared memory (K and V already went to the next
      // unit's loads). Once both warpgroups' last products are done (dS^T is free), each warpgroup writes its 64
      // keys' dK into dS^T buffer [warpgroup] and (once the writer has read its last dQ tile) dV into its dQ buffer
      // with stmatrix, in 128-byte-swizzled TMA boxes of 64 columns, which one of its threads stores with TMA (rows
      // past seqlen_k and columns past head_dim are clipped by the tensor maps).
      // (Indices re-read from threadIdx and the unit ring here: keeping them live through the loop costs registers.)
      named_barrier_sync(kDsBarrier, kConsumerThreads);
      kvs.advance();
      const int e_cw = warp_uniform(int(threadIdx.x) / kWarpgroupThreads - 1);
      const int e_warp = (threadIdx.x / kWarpSize) % 4;
      const uint32_t lane_offset = stmatrix_x4_lane_offset(e_warp * kWarpRows, threadIdx.x % kWarpSize);
      constexpr uint32_t kBoxBytes = kWgmmaM * kSwizzleBytes;  // 64 keys x 64 columns
      T* dk_boxes = smem.ds[e_cw];
      T* dv_boxes = reinterpret_cast<T*>(smem.dq[e_cw]);
      const float scale = p.scale;
      stmatrix_acc_to_boxes<ET, kDTiles>(smem_addr(dk_boxes) + lane_offset, kBoxBytes, acc_dk,
                                         [scale](float x, int) { return x * scale; });
      named_barrier_sync(kDqDrainedBarrier + e_cw, kDqWgThreads);
      stmatrix_acc_to_boxes<ET, kDTiles>(smem_addr(dv_boxes) + lane_offset, kBoxBytes, acc_dv,
                                         [](float x, int) { return x; });
      fence_proxy_async_smem();
      named_barrier_sync(kKvStoreBarrier + e_cw, kWarpgroupThreads);
      // A split unit's parts (the last round): part 0 stores and then raises its flag once the stores have landed;
      // the others wait for the flag (every thread of the warpgroup: a one-thread spin here cost the main loop its
      // uniform descriptors, ptxas) and add theirs. Part 0 was handed out first, so it never waits on them.
      const int part = warp_uniform(unit_of(us).part);
      const int flags = warp_uniform(unit_of(us).flags);
      int32_t* flag = flags >= 0 ? p.dq_semaphore + flags + e_cw : nullptr;
      if (part > 0) {
        while (warp_uniform(ld_acquire_gpu(flag)) == 0) {
        }
      }
      if (threadIdx.x % kWarpgroupThreads == 0) {
        const BwdUnitSlot& slot = unit_of(us);
        const BwdTile e_tile = sched.tile(slot.unit);
        const int row0 = e_tile.n_block * kBN + e_cw * kWgmmaM;
        if (part > 0) fence_proxy_async_global();
#pragma unroll
        for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
          const T* dk_box = dk_boxes + cb * kWgmmaM * kColBlock;
          const T* dv_box = dv_boxes + cb * kWgmmaM * kColBlock;
          if (part > 0) {
            tma_reduce_add_4d(&tm_dk, dk_box, cb * kColBlock, row0, e_tile.hk, e_tile.b);
            tma_reduce_add_4d(&tm_dv, dv_box, cb * kColBlock, row0, e_tile.hk, e_tile.b);
          } else {
            tma_store_4d(&tm_dk, dk_box, cb * kColBlock, row0, e_tile.hk, e_tile.b);
            tma_store_4d(&tm_dv, dv_box, cb * kColBlock, row0, e_tile.hk, e_tile.b);
          }
        }
        bulk_commit_group();
        if (part == 0 && flag != nullptr) {
          bulk_wait_group<0>();
          fence_proxy_async_global();
          red_release_gpu_add(flag, 1);
        }
        // The buffers are free once read (the writes complete in the background); with a lagging dQ the next unit
        // waits for that (staging_pending).
        if constexpr (!kDqLags) bulk_wait_group_read<0>();
      }
      if constexpr (!kDqLags) named_barrier_sync(kDsBarrier, kConsumerThreads);  // both buffers free: next unit
    });
    smem.unit_ring.consumer_release(us);
  }
  if (threadIdx.x % kWarpgroupThreads == 0) bulk_wait_group<0>();  // the last dK/dV stores complete before exit
#else
  __trap();  // built for a target without wgmma; the dispatcher only launches this on compute capability 9.0
#endif
}

}  // namespace jax_flash::cuda::sm90
