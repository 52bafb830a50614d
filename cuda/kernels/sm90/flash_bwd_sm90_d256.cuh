// Backward FlashAttention kernel for sm_90a at head dim 256 after FlashAttention-3 (docs/d256_bwd_plan.md;
// BwdD256TraitsSm90 gives the CTA's roles and buffers): 64 queries x 80 keys, key/value stationary, one CTA per
// (key block, kv head, batch), no cluster. The row-statistics preprocess and the dQ conversion
// (DqTransposedFragmentOrder) around it are shared with every backward (common/bwd_pre_post.cuh).
// Per thread of consumer warpgroup cw (warp w, lane = 4 g + t):
//   S, dP     : queries 16 w + g (+8), keys 40 cw + 8 j + 2 t (+1), j < 5
//   dV^T, dK^T: head-dim rows 128 cw + 64 h + 16 w + g (+8), keys 8 j + 2 t (+1), j < 10, slices h = 0, 1
//   dQ^T      : head-dim rows as dK^T (one slice at a time), queries 8 j + 2 t (+1), j < 8
// launch_bwd_sm90 runs it at every head dim > 128, segment ids and soft cap included. Inside a query tile each pair
// of GEMM groups is waited for in full (dV^T + dQ^T slice 0, then dK^T + dQ^T slice 1). A red.global.add holds its
// source registers until the LSU takes it, and the next wgmma fence waits for that; with 64 KB of adds per tile the
// queue is long (Nsight Compute, session 35: ~32 % of warp time). So slice 1's adds wait in acc_dq until the next
// tile's S is issued and drain under it (+4.4 % on an H200). Issuing dK^T before slice 0's adds, and the plan's
// overlapped order (section 6), measured no faster (NOTES, session 35).
#pragma once

#include <cmath>

#include "flash_params.h"
#include "kernels/common/atomics.cuh"
#include "kernels/common/block_ranges.cuh"
#include "kernels/common/element_traits.cuh"
#include "kernels/sm90/common_bwd_sm90.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/named_barriers.h"
#include "kernels/sm90/pipeline.cuh"
#include "kernels/sm90/smem_layout.h"
#include "kernels/sm90/utils_sm90.cuh"
#include "kernels/sm90/wgmma_sm90.cuh"
#include "mask.h"

namespace jax_flash::cuda::sm90 {

// Zero in place where the mask hides the pair, for accumulators with queries as rows (S, dP of this kernel): entry e
// of column tile j is query query0 + g + 8 (e / 2), key key0 + 8 j + 2 t + e % 2. A select, as zero_hidden_pairs.
template <int kTiles>
__device__ __forceinline__ void zero_hidden_pairs_rows(float (&acc)[kTiles * 4], const AttentionMask& mask, int query0,
                                                       int key0, int g, int t, bool ids) {
  const SegmentPolicy& seg = mask.segments;
  ids = ids && seg.enabled();
  int lo[2], hi[2];
  int32_t row_id[2] = {0, 0};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = query0 + g + 8 * r;
    lo[r] = mask.lo(i);
    hi[r] = mask.hi(i);
    if (ids) row_id[r] = seg.q_ids[imax(imin(i, mask.length.q_len - 1), 0)];
  }
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int key = key0 + 8 * j + 2 * t + c;
      const int32_t key_id = ids ? seg.kv_ids[imax(imin(key, mask.length.kv_len - 1), 0)] : 0;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const bool seen = key >= lo[r] && key < hi[r] && (!ids || key_id == row_id[r]);
        acc[4 * j + 2 * r + c] = seen ? acc[4 * j + 2 * r + c] : 0.f;
      }
    }
  }
}

template <typename T, bool kSegments, bool kSoftCap>
__global__ void __launch_bounds__(BwdD256TraitsSm90::kThreads, 1)
    flash_bwd_sm90_d256_kernel(const __grid_constant__ FlashParams p, const __grid_constant__ CUtensorMap tm_q,
                               const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                               const __grid_constant__ CUtensorMap tm_do, const __grid_constant__ CUtensorMap tm_dk,
                               const __grid_constant__ CUtensorMap tm_dv) {
#if defined(JAX_FLASH_SM90A)
  using Tr = BwdD256TraitsSm90;
  constexpr int kD = Tr::kHeadDim;
  constexpr int kBM = Tr::kBlockM;
  constexpr int kBN = Tr::kBlockN;
  constexpr int kSTiles = Tr::kWgKeys / 8;  // 8-key column tiles of S, dP (5)
  constexpr int kKvTiles = kBN / 8;         // 8-key column tiles of dK^T, dV^T (10)
  constexpr int kDqTiles = kBM / 8;         // 8-query column tiles of dQ^T (8)
  constexpr int kConsumerThreads = Tr::kConsumerWarpgroups * kWarpgroupThreads;
  using ET = ElemTraits<T>;
  using Storage = typename Tr::template SharedStorage<T>;
  using QState = PipelineState<Tr::kQStages>;
  using DoState = PipelineState<Tr::kDoStages>;
  using KvState = PipelineState<1>;

  Storage& smem = shared_storage<Storage>();
  const int n_block = blockIdx.x;
  const int hk = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;

  with_segment_mode<kSegments>(p, b, [&](auto segment_mode) {
    const AttentionMask mask = kernel_mask_for_batch<decltype(segment_mode)::value>(p, b);
    const SoftCap cap(p);
    const auto [n0, keys_valid, kv_stride, kv_off, gdK, gdV] = key_block<kBN, T>(p, n_block, hk, b);
    const auto walk = query_tile_walk<kBN, kBM>(mask, p, n0, hk);
    const int iters = walk.iters();
    if (iters == 0) {  // no query sees these keys: zero gradients
      zero_kv_grads<Tr::kThreads>(gdK, gdV, kv_stride, keys_valid, p.head_dim, tid);
      return;
    }
    if (tid == 0) {
      smem.kv_ring.init(1);
      smem.q_ring.init(kConsumerThreads);
      smem.do_ring.init(kConsumerThreads);
      mbar_init_fence();
    }
    __syncthreads();

    const int warpgroup = tid / kWarpgroupThreads;
    if (warpgroup == 0) {
      // ---- producer: thread 0 loads K and V once, then Q (with its rows' statistics) and dO per query tile --------
      setmaxnreg_dec<Tr::kProducerRegs>();
      if (tid == 0) {
        prefetch_tensor_map(&tm_q);
        prefetch_tensor_map(&tm_k);
        prefetch_tensor_map(&tm_v);
        prefetch_tensor_map(&tm_do);
        const KvState kvs{};
        smem.kv_ring.producer_acquire(kvs, 2 * kBN * kD * sizeof(T));
        load_key_block_rows<kBN, Tr::kColBlocks>(smem.k, &tm_k, smem.kv_ring.full_barrier(kvs), n0, hk, b);
        load_key_block_rows<kBN, Tr::kColBlocks>(smem.v, &tm_v, smem.kv_ring.full_barrier(kvs), n0, hk, b);
        auto pos = walk.start();
#pragma unroll 1
        for (int it = 0; it < iters; ++it, walk.advance(pos)) {
          const QState qs{it};
          smem.q_ring.producer_acquire(qs, kBM * kD * sizeof(T) + 2 * Tr::kStatsBytes);
          uint64_t* q_full = smem.q_ring.full_barrier(qs);
#pragma unroll
          for (int cb = 0; cb < Tr::kColBlocks; ++cb) {
            tma_load_4d(smem.q[qs.slot()] + cb * kBM * kColBlock, &tm_q, q_full, cb * kColBlock, pos.row0, pos.head,
                        b);
          }
          bulk_load_1d(smem.stats[qs.slot()], p.lse_log2_of(b, pos.head) + pos.row0, Tr::kStatsBytes, q_full);
          bulk_load_1d(smem.stats[qs.slot()] + kBM, p.dsum_of(b, pos.head) + pos.row0, Tr::kStatsBytes, q_full);
          const DoState ds{it};
          smem.do_ring.producer_acquire(ds, kBM * kD * sizeof(T));
#pragma unroll
          for (int cb = 0; cb < Tr::kColBlocks; ++cb) {
            tma_load_4d(smem.dout[ds.slot()] + cb * kBM * kColBlock, &tm_do, smem.do_ring.full_barrier(ds),
                        cb * kColBlock, pos.row0, pos.head, b);
          }
        }
      }
      return;
    }

    // ---- consumers -------------------------------------------------------------------------------------------------
    setmaxnreg_inc<Tr::kConsumerRegs>();
    const int cw = warp_uniform(warpgroup - 1);
    const int wg_tid = tid % kWarpgroupThreads;
    const int warp = wg_tid / kWarpSize;
    const int lane = tid % kWarpSize;
    const int g = lane / 4;
    const int t = lane % 4;
    const int key0 = cw * Tr::kWgKeys;  // this warpgroup's S / dP keys inside the block

    float acc_dv[Tr::kSlices][kKvTiles * 4];
    float acc_dk[Tr::kSlices][kKvTiles * 4];
#pragma unroll
    for (int h = 0; h < Tr::kSlices; ++h) {
#pragma unroll
      for (int i = 0; i < kKvTiles * 4; ++i) acc_dv[h][i] = acc_dk[h][i] = 0.f;
    }

    // Shared-memory descriptors (128-byte swizzle), advanced by compile-time offsets. K-major operands step 32 bytes
    // inside a 128-byte row per k-step and one column block per 64 elements; M/N-major ones 16 rows (2048 bytes).
    constexpr uint32_t kQColBlockBytes = kBM * kSwizzleBytes;   // 64 queries x 64 columns
    constexpr uint32_t kKVColBlockBytes = kBN * kSwizzleBytes;  // 80 keys x 64 columns
    constexpr uint32_t kQStageBytes = sizeof(smem.q[0]);
    constexpr uint32_t kPdsBufferBytes = sizeof(smem.pt[0]);
    constexpr uint32_t kMnStep = kWgmmaK * kSwizzleBytes;
    constexpr uint32_t kKStep = kWgmmaK * sizeof(T);
    constexpr int kKStepsPerColBlock = kColBlock / kWgmmaK;
    static_assert(sizeof(smem.dst[0]) == kPdsBufferBytes, "P^T and dS^T buffers have one size");
    // S = Q K^T, dP = dO V^T: A = the Q / dO tile, B = this warpgroup's 40 K / V rows (both K-major).
    const uint64_t desc_q_k = make_desc_sw128(smem_addr(smem.q[0]), kKMajorLeadingBytes);
    const uint64_t desc_do_k = make_desc_sw128(smem_addr(smem.dout[0]), kKMajorLeadingBytes);
    const uint64_t desc_k_wg = make_desc_sw128(smem_addr(smem.k) + key0 * kSwizzleBytes, kKMajorLeadingBytes);
    const uint64_t desc_v_wg = make_desc_sw128(smem_addr(smem.v) + key0 * kSwizzleBytes, kKMajorLeadingBytes);
    // dV^T / dK^T slice h = dO^T P / Q^T dS: A = column block 2 cw + h of dO / Q read M-major, B = P^T / dS^T
    // ([key][64 queries]) K-major. dQ^T slice h = K^T dS^T: A = column block 2 cw + h of K read M-major, B = dS^T
    // read N-major.
    const uint64_t desc_do_m = make_desc_sw128(smem_addr(smem.dout[0]) + 2 * cw * kQColBlockBytes, kQColBlockBytes);
    const uint64_t desc_q_m = make_desc_sw128(smem_addr(smem.q[0]) + 2 * cw * kQColBlockBytes, kQColBlockBytes);
    const uint64_t desc_k_m = make_desc_sw128(smem_addr(smem.k) + 2 * cw * kKVColBlockBytes, kKVColBlockBytes);
    const uint64_t desc_pt_k = make_desc_sw128(smem_addr(smem.pt[0]), kKMajorLeadingBytes);
    const uint64_t desc_dst_k = make_desc_sw128(smem_addr(smem.dst[0]), kKMajorLeadingBytes);
    const uint64_t desc_dst_n = make_desc_sw128(smem_addr(smem.dst[0]), kPdsBufferBytes);
    // P^T / dS^T stores (stmatrix .trans): this warp's 16 queries are 16-byte chunks 2 w, 2 w + 1 of the key rows.
    const uint32_t pds_lane = stmatrix_x4_trans_lane_offset(key0, 2 * warp, lane);

    float acc_dq[kDqTiles * 4];
    float* dq_prev = nullptr;  // the tile whose dQ^T slice 1 waits in acc_dq
    // dQ^T slice h into dq_accum: float4 slot (cw, 8 h + j, thread) of the tile (DqTransposedFragmentOrder).
    auto add_dq = [&](float* dq_tile, int h) {
#pragma unroll
      for (int j = 0; j < kDqTiles; ++j) {
        atomic_add_f32x4(dq_tile + 4 * DqTransposedFragmentOrder::slot(cw, h, j, wg_tid), acc_dq[4 * j],
                         acc_dq[4 * j + 1], acc_dq[4 * j + 2], acc_dq[4 * j + 3]);
      }
    };
    smem.kv_ring.consumer_wait(KvState{});
    auto pos = walk.start();
    for (int it = 0; it < iters; ++it, walk.advance(pos)) {
      const int m0 = pos.row0;
      const QState qs{it};
      const DoState ds{it};
      const uint32_t q_off = qs.slot() * kQStageBytes;
      const uint32_t do_off = ds.slot() * kQStageBytes;

      float acc_s[kSTiles * 4];
      float acc_dp[kSTiles * 4];
      auto issue_scores = [&](float (&acc)[kSTiles * 4], uint64_t a_desc, uint64_t b_desc) {
#pragma unroll
        for (int kk = 0; kk < kD / kWgmmaK; ++kk) {
          const uint32_t off = (kk % kKStepsPerColBlock) * kKStep;
          const uint32_t cb = kk / kKStepsPerColBlock;
          Wgmma<Tr::kWgKeys, T, 0>::ss(acc, desc_advance(a_desc, cb * kQColBlockBytes + off),
                                       desc_advance(b_desc, cb * kKVColBlockBytes + off), kk > 0);
        }
        wgmma_commit();
      };
      smem.q_ring.consumer_wait(qs);
      // This thread's rows 16 w + g (+8): lse * log2(e) and dsum, read before any GEMM is issued (session 33).
      const float* stats = smem.stats[qs.slot()];
      const int r0 = warp * kWarpRows + g;
      const float lse0 = stats[r0], lse1 = stats[r0 + 8];
      const float dsum0 = stats[kBM + r0], dsum1 = stats[kBM + r0 + 8];
      wgmma_fence();
      issue_scores(acc_s, desc_advance(desc_q_k, q_off), desc_k_wg);
      if (it > 0) add_dq(dq_prev, 1);  // the previous tile's slice 1: the adds drain while S runs
      smem.do_ring.consumer_wait(ds);
      issue_scores(acc_dp, desc_advance(desc_do_k, do_off), desc_v_wg);

      // P = exp2(S * scale_log2 - lse * log2(e)) (S soft-capped first), masked.
      wgmma_wait<1>();
      fence_regs(acc_s);
      [[maybe_unused]] uint32_t dcap[kSTiles * 2];  // 1 - tanh^2 per pair (soft cap only)
      if constexpr (kSoftCap) cap_scores<__half, true, kSTiles * 2>(acc_s, dcap, cap);
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          acc_s[4 * j + e] = exp2f(acc_s[4 * j + e] * p.scale_log2 - (e < 2 ? lse0 : lse1));
        }
      }
      const int q_row0 = m0 + warp * kWarpRows;
      const int n_wg = n0 + key0;
      const TileMasking how = mask.tile_masking_warp(q_row0, q_row0 + kWarpRows, n_wg, n_wg + Tr::kWgKeys, p.seqlen_q);
      if (how != TileMasking::kNone) {
        zero_hidden_pairs_rows<kSTiles>(acc_s, mask, q_row0, n_wg, g, t, how == TileMasking::kIds);
      }
      // dS = P * (dP - dsum) (times 1 - tanh^2 with a cap), exactly 0 where hidden.
      wgmma_wait<0>();
      fence_regs(acc_dp);
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_dp[4 * j + e] = acc_s[4 * j + e] * (acc_dp[4 * j + e] - (e < 2 ? dsum0 : dsum1));
      }
      if constexpr (kSoftCap) scale_by_cap_derivative<__half, kSTiles * 2>(acc_dp, dcap);
      if (how != TileMasking::kNone) {
        zero_hidden_pairs_rows<kSTiles>(acc_dp, mask, q_row0, n_wg, g, t, how == TileMasking::kIds);
      }

      // P^T, dS^T -> buffer it & 1 with stmatrix .trans: x4 of key tiles (0, 1), (2, 3), x2 of tile 4. Register i of
      // an x4 is rows half i % 2 of key tile i / 2 (smem_layout_check: stmatrix trans).
      const uint32_t buf = (it & 1) * kPdsBufferBytes;
      const uint32_t pt_addr = smem_addr(smem.pt[0]) + buf + pds_lane;
      const uint32_t dst_addr = smem_addr(smem.dst[0]) + buf + pds_lane;
#pragma unroll
      for (int piece = 0; piece < 2; ++piece) {
        const float* s8 = acc_s + 8 * piece;
        const float* d8 = acc_dp + 8 * piece;
        stmatrix_x4_trans(pt_addr + piece * 2048, ET::pack(s8[0], s8[1]), ET::pack(s8[2], s8[3]),
                          ET::pack(s8[4], s8[5]), ET::pack(s8[6], s8[7]));
        stmatrix_x4_trans(dst_addr + piece * 2048, ET::pack(d8[0], d8[1]), ET::pack(d8[2], d8[3]),
                          ET::pack(d8[4], d8[5]), ET::pack(d8[6], d8[7]));
      }
      stmatrix_x2_trans(pt_addr + 2 * 2048, ET::pack(acc_s[16], acc_s[17]), ET::pack(acc_s[18], acc_s[19]));
      stmatrix_x2_trans(dst_addr + 2 * 2048, ET::pack(acc_dp[16], acc_dp[17]), ET::pack(acc_dp[18], acc_dp[19]));
      fence_proxy_async_smem();
      named_barrier_sync(kDsBarrier, kConsumerThreads);  // both warpgroups' keys of P^T, dS^T are written

      // dV^T += dO^T P (both slices), then dQ^T slice 0 = K^T dS^T, its adds; dK^T += Q^T dS, dQ^T slice 1 (added
      // after the next tile's S). The fence before dV^T also waits for the previous slice 1's adds to read acc_dq.
      auto issue_dq = [&](int h) {
#pragma unroll
        for (int kk = 0; kk < kBN / kWgmmaK; ++kk) {
          Wgmma<kBM, T, 1>::template ss<1>(acc_dq, desc_advance(desc_k_m, h * kKVColBlockBytes + kk * kMnStep),
                                           desc_advance(desc_dst_n, buf + kk * kMnStep), kk > 0);
        }
        wgmma_commit();
      };
      float* dq_tile = p.dq_accum_of(b, pos.head) + int64_t(m0) * kD;
      auto issue_dv = [&](int h) {  // dV^T slice h += dO^T P
#pragma unroll
        for (int kk = 0; kk < kBM / kWgmmaK; ++kk) {
          Wgmma<kBN, T, 0>::template ss<1>(acc_dv[h], desc_advance(desc_do_m, do_off + h * kQColBlockBytes + kk * kMnStep),
                                           desc_advance(desc_pt_k, buf + kk * kKStep), 1);
        }
      };
      auto issue_dk = [&](int h) {  // dK^T slice h += Q^T dS
#pragma unroll
        for (int kk = 0; kk < kBM / kWgmmaK; ++kk) {
          Wgmma<kBN, T, 0>::template ss<1>(acc_dk[h], desc_advance(desc_q_m, q_off + h * kQColBlockBytes + kk * kMnStep),
                                           desc_advance(desc_dst_k, buf + kk * kKStep), 1);
        }
      };
      wgmma_fence();
      issue_dv(0);
      issue_dv(1);
      wgmma_commit();
      issue_dq(0);
      wgmma_wait<0>();
      fence_regs(acc_dv[0]);
      fence_regs(acc_dv[1]);
      fence_regs(acc_dq);
      smem.do_ring.consumer_release(ds);  // dO's last reader (dV^T) is done
      add_dq(dq_tile, 0);
      wgmma_fence();
      issue_dk(0);
      issue_dk(1);
      wgmma_commit();
      issue_dq(1);
      wgmma_wait<0>();
      fence_regs(acc_dk[0]);
      fence_regs(acc_dk[1]);
      fence_regs(acc_dq);
      smem.q_ring.consumer_release(qs);  // Q's last readers (S, dK^T) and the statistics loads are done
      dq_prev = dq_tile;  // its slice 1 is added after the next tile's S is issued
    }
    add_dq(dq_prev, 1);  // the last tile's

    // Epilogue: both warpgroups' last reads of K and V are done; dK^T (times scale) and dV^T go to K's and V's column
    // blocks 2 cw + h as [key][64 columns] rows (stmatrix .trans: accumulator rows = columns of dK), then one thread
    // of the warpgroup stores its two boxes of each with TMA (rows past seqlen_k, columns past head_dim clipped).
    named_barrier_sync(kDsBarrier, kConsumerThreads);
    const uint32_t kv_lane = stmatrix_x4_trans_lane_offset(0, 2 * warp, lane);
#pragma unroll
    for (int h = 0; h < Tr::kSlices; ++h) {
      const uint32_t k_box = smem_addr(smem.k) + (2 * cw + h) * kKVColBlockBytes + kv_lane;
      const uint32_t v_box = smem_addr(smem.v) + (2 * cw + h) * kKVColBlockBytes + kv_lane;
#pragma unroll
      for (int piece = 0; piece < kKvTiles / 2; ++piece) {
        const float* k8 = acc_dk[h] + 8 * piece;
        const float* v8 = acc_dv[h] + 8 * piece;
        const float s = p.scale;
        stmatrix_x4_trans(k_box + piece * 2048, ET::pack(k8[0] * s, k8[1] * s), ET::pack(k8[2] * s, k8[3] * s),
                          ET::pack(k8[4] * s, k8[5] * s), ET::pack(k8[6] * s, k8[7] * s));
        stmatrix_x4_trans(v_box + piece * 2048, ET::pack(v8[0], v8[1]), ET::pack(v8[2], v8[3]), ET::pack(v8[4], v8[5]),
                          ET::pack(v8[6], v8[7]));
      }
    }
    fence_proxy_async_smem();
    named_barrier_sync(kKvStoreBarrier + cw, kWarpgroupThreads);
    if (wg_tid == 0) {
#pragma unroll
      for (int h = 0; h < Tr::kSlices; ++h) {
        const int cb = 2 * cw + h;
        tma_store_4d(&tm_dk, smem.k + cb * kBN * kColBlock, cb * kColBlock, n0, hk, b);
        tma_store_4d(&tm_dv, smem.v + cb * kBN * kColBlock, cb * kColBlock, n0, hk, b);
      }
      bulk_commit_group();
      bulk_wait_group<0>();  // the stores complete before the CTA exits
    }
  });
#else
  __trap();  // built for a target without wgmma; the dispatcher only launches this on compute capability 9.0
#endif
}

}  // namespace jax_flash::cuda::sm90
