// Backward FlashAttention kernel for sm_90a at head dim 256: key/value stationary, the two consumer warpgroups
// splitting the queries of S^T/dP^T and the head-dim columns of dV/dK/dQ (see BwdSplitDKernelTraitsSm90). The
// row-statistics preprocess and the dQ conversion (DqRowMajor) around it are shared with every backward
// (common/bwd_pre_post.cuh).
// Per thread of a consumer warpgroup cw (warp w, lane = 4 g + t):
//   S^T, dP^T : keys 16 w + g (+8), queries 32 cw + 8 j + 2 t (+1), j < 4
//   dK, dV    : keys 16 w + g (+8), columns 128 cw + 8 j + 2 t (+1), j < 16
//   dQ        : queries 16 w + g (+8), columns 128 cw + 8 j + 2 t (+1), j < 16
// CTAs come in clusters of two neighbouring key blocks that walk the same query tiles (the union of the two
// blocks' ranges); in CTA r, warpgroup r adds the peer's dQ tile (same thread layout, through distributed shared
// memory) to its own and reduces the sum into dq_accum, warpgroup 1 - r sends its tile to the peer.
#pragma once

#include <cmath>

#include "flash_params.h"
#include "kernels/common/atomics.cuh"
#include "kernels/common/block_ranges.cuh"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/sm90/common_bwd_sm90.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/named_barriers.h"
#include "kernels/sm90/pipeline.cuh"
#include "kernels/sm90/smem_layout.h"
#include "kernels/sm90/utils_sm90.cuh"
#include "kernels/sm90/wgmma_sm90.cuh"
#include "mask.h"

namespace jax_flash::cuda::sm90 {

// kSegments: the call has segment ids (false: their tests are compiled out; true: each batch element takes them as
// runs or as ids, see with_segment_mode and kernel_mask_for_batch).
// kSoftCap: the call has a logit soft cap (FlashParams::softcap_pre != 0).
template <typename T, typename Traits, bool kSegments, bool kSoftCap>
__global__ void __launch_bounds__(Traits::kThreads, 1) __cluster_dims__(Traits::kClusterSize, 1, 1)
    flash_bwd_sm90_splitd_kernel(const __grid_constant__ FlashParams p, const __grid_constant__ CUtensorMap tm_q,
                                 const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                                 const __grid_constant__ CUtensorMap tm_do) {
#if defined(JAX_FLASH_SM90A)
  constexpr int kD = Traits::kHeadDim;
  constexpr int kBM = Traits::kBlockM;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kQStages = Traits::kQStages;
  constexpr int kDoStages = Traits::kDoStages;
  constexpr int kQueries = Traits::kWgQueries;  // S^T columns of a warpgroup
  constexpr int kCols = Traits::kWgCols;        // dK, dV, dQ columns of a warpgroup
  constexpr int kSTiles = kQueries / 8;         // 8-wide column tiles of S^T
  constexpr int kCTiles = kCols / 8;            // 8-wide column tiles of dK, dV, dQ
  using ET = ElemTraits<T>;
  using Storage = typename Traits::SharedStorage;

  Storage& smem = shared_storage<Storage>();

  const int n_block = blockIdx.x;
  const int hk = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;

  // A batch element whose segment ids are contiguous runs takes them as per-row key intervals (RunPolicy), the
  // others as ids: one copy of the body per policy (with_segment_mode).
  with_segment_mode<kSegments>(p, b, [&](auto segment_mode) {
    const AttentionMask mask = kernel_mask_for_batch<decltype(segment_mode)::value>(p, b);
    const SoftCap cap(p);

    const auto [n0, keys_valid, kv_stride, kv_off, gdK, gdV] = key_block<kBN, T>(p, n_block, hk, b);

    // The query tiles that see either key block of the pair: both CTAs of a cluster take the same iterations.
    const auto walk =
        query_tile_walk<Traits::kClusterSize * kBN, kBM>(mask, p, (n_block & ~(Traits::kClusterSize - 1)) * kBN, hk);
    const int iters = walk.iters();
    if (iters == 0) {  // no query sees these keys (nor the peer's): zero gradients
      zero_kv_grads<Traits::kThreads>(gdK, gdV, kv_stride, keys_valid, p.head_dim, tid);
      return;
    }

    constexpr int kConsumerWarps = Traits::kConsumerWarpgroups * 4;
    // Query tile `it` is use `it` of every ring (PipelineState{it}): Q, dO, and the dQ tile the peer CTA sends into
    // dq_peer.
    using QState = PipelineState<kQStages>;
    using DoState = PipelineState<kDoStages>;
    using PeerState = PipelineState<1>;
    if (tid == 0) {
      mbar_init(&smem.kv_full, 1);
      smem.q_ring.init(kConsumerWarps);
      smem.do_ring.init(kConsumerWarps);
      smem.peer_ring.init(kWarpgroupThreads);
      mbar_init_fence();
    }
    cluster_sync();  // the peer's barriers are initialised before anything arrives on them

    const int warpgroup = tid / kWarpgroupThreads;
    if (warpgroup == 0) {
      // ---- producer: thread 0 issues the TMA loads (K, V once; rings of Q and dO tiles) ----------------------
      setmaxnreg_dec<Traits::kProducerRegs>();
      if (tid == 0) {
        prefetch_tensor_map(&tm_q);
        prefetch_tensor_map(&tm_k);
        prefetch_tensor_map(&tm_v);
        prefetch_tensor_map(&tm_do);
        load_kv_block<kBN, Traits::kColBlocks>(smem.k, smem.v, &smem.kv_full, &tm_k, &tm_v, n0, hk, b);
#pragma unroll 1  // one thread issuing loads: unrolling only costs its 24 registers
        for (int it = 0; it < iters; ++it) {
          const int h = walk.head(it);
          const int m0 = walk.row0(it);
          const QState qs{it};
          smem.q_ring.producer_acquire(qs, Traits::kTileBytes);
#pragma unroll
          for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
            tma_load_4d(smem.q[qs.slot()] + cb * kBM * kColBlock, &tm_q, smem.q_ring.full_barrier(qs), cb * kColBlock,
                        m0, h, b);
          }
          const DoState ds{it};
          smem.do_ring.producer_acquire(ds, Traits::kTileBytes);
#pragma unroll
          for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
            tma_load_4d(smem.dout[ds.slot()] + cb * kBM * kColBlock, &tm_do, smem.do_ring.full_barrier(ds),
                        cb * kColBlock, m0, h, b);
          }
        }
      }
      cluster_sync();  // matches the consumers' final cluster_sync
      return;
    }

    // ---- consumers -----------------------------------------------------------------------------------------------
    setmaxnreg_inc<Traits::kConsumerRegs>();
    const int cw = warp_uniform(warpgroup - 1);
    const int wg_tid = tid % kWarpgroupThreads;
    const int warp = wg_tid / kWarpSize;
    const int lane = tid % kWarpSize;
    const bool lane0 = lane == 0;
    const int g = lane / 4;
    const int t = lane % 4;
    const int row0 = warp * kWarpRows;  // first of this warp's 16 accumulator rows (keys; queries for dQ)
    const int q_col0 = cw * kQueries;   // this warpgroup's S^T columns inside the query tile
    const int d_col0 = cw * kCols;      // this warpgroup's dK, dV, dQ columns

    float acc_dk[kCTiles * 4];
    float acc_dv[kCTiles * 4];
#pragma unroll
    for (int i = 0; i < kCTiles * 4; ++i) acc_dk[i] = acc_dv[i] = 0.f;

    // Shared-memory descriptors, built once and advanced by compile-time offsets (k-steps, stage and parity
    // strides). K-major operands step 32 bytes inside a 128-byte row per k-step and one column block per 64
    // elements; N-major ones step 16 rows (kNMajorStep) per k-step, their 64-wide blocks the leading offset apart.
    constexpr uint32_t kKVColBlockBytes = kBN * kSwizzleBytes;
    constexpr uint32_t kQColBlockBytes = kBM * kSwizzleBytes;
    constexpr uint32_t kTileBytes = sizeof(smem.q[0]);  // one Q or dO stage
    constexpr uint32_t kPdsBufferBytes = sizeof(smem.pt[0]);
    constexpr uint32_t kNMajorStep = kWgmmaK * kSwizzleBytes;
    constexpr uint32_t kKMajorStep = kWgmmaK * sizeof(T);
    constexpr int kKStepsPerColBlock = kColBlock / kWgmmaK;
    static_assert(sizeof(smem.dout[0]) == kTileBytes && sizeof(smem.dst[0]) == kPdsBufferBytes, "equal buffers");
    const uint32_t q_rows = smem_addr(smem.q[0]) + q_col0 * kSwizzleBytes;  // this warpgroup's queries
    const uint32_t do_rows = smem_addr(smem.dout[0]) + q_col0 * kSwizzleBytes;
    const uint32_t col_block = d_col0 / kColBlock;  // this warpgroup's first 64-wide column block
    const uint64_t desc_k_rows = make_desc_sw128(smem_addr(smem.k), kKMajorLeadingBytes);  // A of S^T
    const uint64_t desc_v_rows = make_desc_sw128(smem_addr(smem.v), kKMajorLeadingBytes);  // A of dP^T
    const uint64_t desc_q_k = make_desc_sw128(q_rows, kKMajorLeadingBytes);                // B of S^T
    const uint64_t desc_do_k = make_desc_sw128(do_rows, kKMajorLeadingBytes);              // B of dP^T
    const uint64_t desc_pt = make_desc_sw128(smem_addr(smem.pt[0]), kKMajorLeadingBytes);  // A of dV
    const uint64_t desc_dst = make_desc_sw128(smem_addr(smem.dst[0]), kKMajorLeadingBytes);  // A of dK
    const uint64_t desc_ds = make_desc_sw128(smem_addr(smem.dst[0]), kPdsBufferBytes);      // A of dQ (M-major)
    const uint64_t desc_do_n =
        make_desc_sw128(smem_addr(smem.dout[0]) + col_block * kQColBlockBytes, kQColBlockBytes);  // B of dV
    const uint64_t desc_q_n =
        make_desc_sw128(smem_addr(smem.q[0]) + col_block * kQColBlockBytes, kQColBlockBytes);  // B of dK
    const uint64_t desc_k_cols =
        make_desc_sw128(smem_addr(smem.k) + col_block * kKVColBlockBytes, kKVColBlockBytes);  // B of dQ
    // P^T, dS^T stores: key rows row0 + g (+8), 16-byte chunk (query chunk) XOR g (the row modulo 8), 4-byte word t.
    const uint32_t pds_thread = (row0 + g) * kSwizzleBytes + 4 * t;
    static_assert(kWarpRows % kSwizzleRows == 0 && kSwizzleRows == 8, "row g + 8 r of a warp's slice is g modulo 8");

    // dQ exchange with the peer CTA: thread i's float4 k at byte (k * 128 + i) * 16 of dq_peer (conflict-free).
    constexpr uint32_t kPeerRowBytes = kWarpgroupThreads * sizeof(float4);
    static_assert(sizeof(smem.dq_peer) == kCTiles * kPeerRowBytes, "dq_peer holds one warpgroup's dQ tile");
    const int rank = int(cluster_ctarank());
    const uint32_t peer = uint32_t(rank ^ 1);
    const uint32_t own_slot = smem_addr(smem.dq_peer) + wg_tid * sizeof(float4);
    const uint32_t peer_slot = map_to_cta(own_slot, peer);
    const uint32_t peer_full_remote = map_to_cta(smem_addr(smem.peer_ring.full), peer);
    const uint32_t peer_empty_remote = map_to_cta(smem_addr(smem.peer_ring.empty), peer);

    // Row statistics of this warpgroup's queries of tile `it`, one value per thread of the first 2 kQueries: lse *
    // log2(e) of query wg_tid, then dsum of query wg_tid - kQueries. Queries past seqlen_q (their Q and dO load as
    // zeros) have 0 (the padding rows of row_stats), which makes dS^T and the dV term 0. Loaded one iteration ahead.
    const bool stat_thread = wg_tid < 2 * kQueries;
    auto load_stat = [&](int it) {
      const int row = walk.row0(it) + q_col0 + wg_tid % kQueries;
      const float* stats = wg_tid < kQueries ? p.lse_log2_of(b, walk.head(it)) : p.dsum_of(b, walk.head(it));
      return stat_thread ? stats[row] : 0.f;
    };

    float stat_next = load_stat(0);
    mbar_wait(&smem.kv_full, 0);

    for (int it = 0; it < iters; ++it) {
      const QState qs{it};
      const DoState ds{it};
      const PeerState peer_use{it};
      const int sq = qs.slot();
      const int sd = ds.slot();
      const int par = it & 1;
      const int m0 = walk.row0(it);
      const uint32_t q_off = sq * kTileBytes;
      const uint32_t do_off = sd * kTileBytes;
      const uint32_t pds_off = par * kPdsBufferBytes;

      // S^T = K Q^T and dP^T = V dO^T (64 keys x this warpgroup's kQueries queries), both operands K-major; two
      // groups so the exponentials of S^T run under the dP^T GEMM.
      float acc_s[kSTiles * 4];
      float acc_dp[kSTiles * 4];
      auto issue_keys_times_queries = [&](float (&acc)[kSTiles * 4], uint64_t a_desc, uint64_t b_desc) {
#pragma unroll
        for (int kk = 0; kk < kD / kWgmmaK; ++kk) {
          const uint32_t off = (kk % kKStepsPerColBlock) * kKMajorStep;
          const uint32_t cb = kk / kKStepsPerColBlock;
          Wgmma<kQueries, T, 0>::ss(acc, desc_advance(a_desc, cb * kKVColBlockBytes + off),
                                    desc_advance(b_desc, cb * kQColBlockBytes + off), kk > 0);
        }
        wgmma_commit();
      };
      // Each fence after its wait: a fence followed by the wait's loop made ptxas inject its own (C7519).
      smem.q_ring.consumer_wait(qs);
      wgmma_fence();
      issue_keys_times_queries(acc_s, desc_k_rows, desc_advance(desc_q_k, q_off));
      smem.do_ring.consumer_wait(ds);
      wgmma_fence();
      issue_keys_times_queries(acc_dp, desc_v_rows, desc_advance(desc_do_k, do_off));

      const uint32_t stats = smem_addr(smem.stats[cw][par]);
      if (stat_thread) st_shared_f32(stats + wg_tid * sizeof(float), stat_next);
      if (it + 1 < iters) stat_next = load_stat(it + 1);
      named_barrier_sync(kStatsBarrier + cw, kWarpgroupThreads);
      float2 lse_log2[kSTiles];
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) lse_log2[j] = ld_shared_f32x2(stats + (8 * j + 2 * t) * sizeof(float));

      // P^T = exp2(S^T * scale_log2 - lse * log2(e)), masked; element e of column tile j is key row0 + g + 8 (e / 2),
      // query q_col0 + 8 j + 2 t + e % 2.
      wgmma_wait<1>();
      fence_regs(acc_s);
      uint32_t dcap[kSTiles * 2];  // with a soft cap: 1 - tanh^2 of the pairs (float16)
      const TileMasking how = probs_from_scores<kSTiles, kSoftCap>(acc_s, dcap, lse_log2, p.scale_log2, cap, mask,
                                                                   m0 + q_col0, n0 + row0, p.seqlen_q, g, t);
      // dS^T = P^T * (dP^T - dsum) (times 1 - tanh^2 with a cap).
      float2 dsum[kSTiles];
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) dsum[j] = ld_shared_f32x2(stats + (kQueries + 8 * j + 2 * t) * sizeof(float));
      wgmma_wait<0>();
      fence_regs(acc_dp);
      dscores_from_probs<kSTiles, kSoftCap>(acc_dp, acc_s, dsum, dcap, how, mask, m0 + q_col0, n0 + row0, g, t);

      // This warpgroup's query half of P^T and dS^T -> shared memory ([key][kBM queries], one swizzled row per key):
      // column tile j is 16-byte chunk q_col0 / 8 + j of rows row0 + g and row0 + g + 8.
      const uint32_t pt_base = smem_addr(smem.pt[0]) + pds_off + pds_thread;
      const uint32_t dst_base = smem_addr(smem.dst[0]) + pds_off + pds_thread;
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t off = r * kSwizzleRows * kSwizzleBytes + ((q_col0 / 8 + j) ^ g) * kSwizzleChunkBytes;
          st_shared_u32(pt_base + off, ET::pack(acc_s[4 * j + 2 * r], acc_s[4 * j + 2 * r + 1]));
          st_shared_u32(dst_base + off, ET::pack(acc_dp[4 * j + 2 * r], acc_dp[4 * j + 2 * r + 1]));
        }
      }
      fence_proxy_async_smem();
      named_barrier_sync(kDsBarrier, Traits::kConsumerWarpgroups * kWarpgroupThreads);

      // This warpgroup's columns: dV += P^T dO (first, so the dO stage frees early), dQ = dS K over the kBN keys
      // (A = dS read M-major from dS^T, B = K read N-major), dK += dS^T Q; P^T, dS^T K-major, Q and dO N-major.
      float acc_dq[kCTiles * 4];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBM / kWgmmaK; ++kk) {
        Wgmma<kCols, T, 1>::ss(acc_dv, desc_advance(desc_pt, pds_off + kk * kKMajorStep),
                               desc_advance(desc_do_n, do_off + kk * kNMajorStep), 1);
      }
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < kBN / kWgmmaK; ++kk) {
        Wgmma<kCols, T, 1>::template ss<1>(acc_dq, desc_advance(desc_ds, pds_off + kk * kNMajorStep),
                                           desc_advance(desc_k_cols, kk * kNMajorStep), kk > 0);
      }
      wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < kBM / kWgmmaK; ++kk) {
        Wgmma<kCols, T, 1>::ss(acc_dk, desc_advance(desc_dst, pds_off + kk * kKMajorStep),
                               desc_advance(desc_q_n, q_off + kk * kNMajorStep), 1);
      }
      wgmma_commit();

      wgmma_wait<2>();
      fence_regs(acc_dv);
      __syncwarp();  // every lane's wgmma reads of the dO stage are done before lane 0 releases it
      if (lane0) smem.do_ring.consumer_release(ds);

      // dQ: the sending warpgroup stores its tile into the peer's dq_peer (float4 k of thread i at [k][i]); the
      // reducing one adds the peer's tile to its own and reduces the sum into dq_accum while dK runs.
      wgmma_wait<1>();
      fence_regs(acc_dq);
      if (cw != rank) {
        smem.peer_ring.producer_wait_empty(peer_use);  // the peer read the previous tile
#pragma unroll
        for (int k = 0; k < kCTiles; ++k) {
          st_async_f32x4(peer_slot + k * kPeerRowBytes, acc_dq[4 * k], acc_dq[4 * k + 1], acc_dq[4 * k + 2],
                         acc_dq[4 * k + 3], peer_full_remote);
        }
      } else {
        if (wg_tid == 0) mbar_arrive_expect_tx(smem.peer_ring.full_barrier(peer_use), sizeof(smem.dq_peer));
        smem.peer_ring.consumer_wait(peer_use);
        // Column tile j of both rows is float4 j of the peer's tile; loaded kLoadGroup at a time so the loaded
        // values never need registers beside all three accumulators.
        constexpr int kLoadGroup = 4;
        const int h = walk.head(it);
        const int m = m0 + row0 + g;  // and m + 8
        float* dq_row = p.dq_accum_of(b, h) + int64_t(m) * p.head_dim_rounded + d_col0 + 2 * t;
        const int64_t dq_row8 = int64_t(8) * p.head_dim_rounded;  // row m + 8
        const bool row_ok[2] = {m < p.seqlen_q, m + 8 < p.seqlen_q};
#pragma unroll
        for (int j0 = 0; j0 < kCTiles; j0 += kLoadGroup) {
          float4 peer_dq[kLoadGroup];
#pragma unroll
          for (int u = 0; u < kLoadGroup; ++u) peer_dq[u] = ld_shared_f32x4(own_slot + (j0 + u) * kPeerRowBytes);
#pragma unroll
          for (int u = 0; u < kLoadGroup; ++u) {
            const int j = j0 + u;
            if (d_col0 + 8 * j + 2 * t < p.head_dim) {
              if (row_ok[0]) {
                atomic_add_f32x2(dq_row + 8 * j, acc_dq[4 * j] + peer_dq[u].x, acc_dq[4 * j + 1] + peer_dq[u].y);
              }
              if (row_ok[1]) {
                atomic_add_f32x2(dq_row + dq_row8 + 8 * j, acc_dq[4 * j + 2] + peer_dq[u].z,
                                 acc_dq[4 * j + 3] + peer_dq[u].w);
              }
            }
          }
        }
        mbar_arrive_cluster_relaxed(peer_empty_remote);  // the loaded values were consumed by the reductions
      }

      wgmma_wait<0>();
      fence_regs(acc_dk);
      __syncwarp();  // every lane's wgmma reads of the Q stage are done before lane 0 releases it
      if (lane0) smem.q_ring.consumer_release(qs);
    }

    // Epilogue: dK = scale * dS^T Q, dV = P^T dO for keys < seqlen_k, this warpgroup's columns < head_dim.
    store_kv_grads<T, kCTiles>(gdK, gdV, kv_stride, acc_dk, acc_dv, p.scale, row0, keys_valid, d_col0, p.head_dim,
                               g, t);
  });
#else
  __trap();  // built for a target without wgmma; the dispatcher only launches this on compute capability 9.0
#endif
}

}  // namespace jax_flash::cuda::sm90
