// Backward main kernel for sm_80 and newer, FlashAttention-2's CTA-wide tiling: every GEMM of an iteration is
// spread over all warps of the CTA as a 2-D warp grid, and P^T and dS^T go through shared memory between them.
//
// A CTA keeps kBlockN keys of one kv head (K, V) in shared memory and loops over every query head of the group and
// every query block of kBlockM rows that can see them (Q, dO, lse, dsum in a two-stage cp.async ring):
//   1. S^T = K Q^T and dP^T = V dO^T            warp grid kSWarpsN x kSWarpsM over [kBlockN keys][kBlockM queries]
//      P^T = exp2(S^T * scale_log2 - lse * log2 e) (masked), dS^T = P^T (dP^T - dsum)  -> shared memory (16-bit)
//   2. dV += P^T dO and dK += dS^T Q             warp grid kKvWarpsN x kKvWarpsD over [kBlockN keys][head dim]
//   3. dQ(partial) = dS K                        warp grid kDqWarpsM x kDqWarpsD over [kBlockM queries][head dim]
//      added into the float32 accumulator with vector reductions.
// Compared with the per-warp kernel (flash_bwd_sm80_mma_cpasync.cuh, 16 keys x the whole head dim per warp), each
// fragment read from shared memory feeds two to four MMAs instead of one or two, at the price of 2 x kBlockN x
// kBlockM x 2 bytes of P^T/dS^T traffic and more shared memory: it needs the large shared memory of sm_80/sm_90
// (the launcher falls back to the per-warp kernel where the device has less).
#pragma once

#include "flash_params.h"
#include "mask.h"
#include "score_mod.h"
#include "kernels/sm80/flash_bwd_sm80_mma_cpasync.cuh"
#include "kernels/sm80/flash_fwd_sm80_mma_cpasync.cuh"
#include "kernels/common/block_ranges.cuh"
#include "kernels/sm80/kernel_traits_sm80.h"
#include "kernels/sm80/utils_sm80.cuh"

namespace jax_flash::cuda {

// Shared memory of the CTA-wide backward kernel. Every tile is row-major with the 16-byte-chunk XOR swizzle of
// utils_sm80.cuh and starts on a multiple of its row size, at most 512 bytes (the swz_addr XOR steps rely on it).
template <typename T, typename Traits>
struct BwdCtaSharedStorage {
  alignas(512) T k[Traits::kBlockN * Traits::kHeadDim];                          // [kBlockN][kD]
  alignas(512) T v[Traits::kBlockN * Traits::kHeadDim];                          // [kBlockN][kD]
  alignas(512) T q[Traits::kStages][Traits::kBlockM * Traits::kHeadDim];         // [stage][kBlockM][kD]
  alignas(512) T dout[Traits::kStages][Traits::kBlockM * Traits::kHeadDim];      // [stage][kBlockM][kD]
  alignas(512) T pt[Traits::kBlockN * Traits::kPCols];                           // P^T  [kBlockN][kPCols]
  alignas(512) T dst[Traits::kBlockN * Traits::kPCols];                          // dS^T [kBlockN][kPCols]
  float lse[Traits::kStages][Traits::kBlockM];                                    // [stage][kBlockM]
  float dsum[Traits::kStages][Traits::kBlockM];                                   // [stage][kBlockM]
};

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm)
    flash_bwd_sm80_cta_kernel(const FlashParams p) {
  constexpr int kD = Traits::kHeadDim;
  constexpr int kBM = Traits::kBlockM;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kPCols = Traits::kPCols;
  constexpr int kRB = kRowBytes<kD>;       // bytes per row of K, V, Q, dO
  constexpr int kPRB = kRowBytes<kPCols>;  // bytes per row of P^T, dS^T
  // Per-warp MMA tile counts of the three GEMM phases (m16 rows x n8 columns).
  constexpr int kSTM = Traits::kSRows / 16, kSTN = Traits::kSCols / 8;      // S^T, dP^T
  constexpr int kKvTM = Traits::kKvRows / 16, kKvTN = Traits::kKvCols / 8;  // dV, dK
  constexpr int kDqTM = Traits::kDqRows / 16, kDqTN = Traits::kDqCols / 8;  // dQ
  using ET = ElemTraits<T>;
  using Smem = BwdCtaSharedStorage<T, Traits>;

  extern __shared__ __align__(128) unsigned char smem_raw[];  // the dynamic window starts 1024-byte aligned
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);

  const int n_block = blockIdx.x;
  const int hk = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  // This warp's place in the three warp grids.
  const int s_wn = warp % Traits::kSWarpsN, s_wm = warp / Traits::kSWarpsN;
  const int kv_wn = warp % Traits::kKvWarpsN, kv_wd = warp / Traits::kKvWarpsN;
  const int dq_wm = warp % Traits::kDqWarpsM, dq_wd = warp / Traits::kDqWarpsM;

  const AttentionMask mask = mask_for_batch(p, b);

  const auto [n0, keys_valid, kv_stride, kv_off, gdK, gdV] = key_block<kBN, T>(p, n_block, hk, b);
  const int64_t q_stride = p.q_row_stride();

  const auto walk = query_tile_walk<kBN, kBM>(mask, p, n0, hk);
  const int iters = walk.iters();
  if (iters == 0) {  // no query sees these keys: zero gradients
    zero_kv_grads<kThreads>(gdK, gdV, kv_stride, keys_valid, p.head_dim, tid);
    return;
  }

  // Loads the query-side tiles of iteration `it` into ring stage `stage`.
  auto load_query_side = [&](int it, int stage) {
    load_query_side_async<kBM, kD, kThreads>(p, q_stride, b, walk.head(it), walk.row0(it),
                                             s.q[stage], s.dout[stage],
                                             s.lse[stage], s.dsum[stage], tid);
  };

  load_tile_async<kBN, kD, kThreads>(s.k, static_cast<const T*>(p.k) + kv_off, kv_stride, keys_valid, p.head_dim, tid);
  load_tile_async<kBN, kD, kThreads>(s.v, static_cast<const T*>(p.v) + kv_off, kv_stride, keys_valid, p.head_dim, tid);
  load_query_side(0, 0);
  cp_async_commit();

  float acc_dk[kKvTM][kKvTN][4];  // this warp's kKvRows keys x kKvCols columns of dK (unscaled)
  float acc_dv[kKvTM][kKvTN][4];
#pragma unroll
  for (int i = 0; i < kKvTM; ++i) {
#pragma unroll
    for (int j = 0; j < kKvTN; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dk[i][j][e] = acc_dv[i][j][e] = 0.f;
    }
  }

  // ldmatrix lane addresses (utils_sm80.cuh): moving right by 2j chunks is `^ (32 * j)`, down by 8r rows `+ r * 8 *
  // row bytes`. Stage offsets are added per iteration.
  const int a_row = lane % 16, a_chunk = lane / 16;                            // A from a row-major tile
  const int bn_row = (lane % 8) + (lane / 16) * 8, bn_chunk = (lane / 8) % 2;  // B from an [n][k] tile
  const int bt_row = (lane % 8) + ((lane / 8) % 2) * 8, bt_chunk = lane / 16;  // B from a [k][n] tile (.trans)
  const int at_row = (lane % 8) + (lane / 16) * 8, at_chunk = (lane / 8) % 2;  // A from a [k][m] tile (.trans)
  // Phase 1: A = K / V rows of this warp's keys, B = Q / dO rows of its queries.
  const uint32_t k_a = swz_addr<kD>(smem_addr(s.k), s_wn * Traits::kSRows + a_row, a_chunk);
  const uint32_t v_a = swz_addr<kD>(smem_addr(s.v), s_wn * Traits::kSRows + a_row, a_chunk);
  const uint32_t q_b0 = swz_addr<kD>(smem_addr(s.q[0]), s_wm * Traits::kSCols + bn_row, bn_chunk);
  const uint32_t do_b0 = swz_addr<kD>(smem_addr(s.dout[0]), s_wm * Traits::kSCols + bn_row, bn_chunk);
  // P^T / dS^T stores: rows s_wn * kSRows + g (+8), 4-byte word t of chunk (s_wm * kSCols / 8 + n-tile).
  const uint32_t pt_st = swz_addr<kPCols>(smem_addr(s.pt), s_wn * Traits::kSRows + g, s_wm * kSTN) + 4 * t;
  const uint32_t dst_st = swz_addr<kPCols>(smem_addr(s.dst), s_wn * Traits::kSRows + g, s_wm * kSTN) + 4 * t;
  // Phase 2: A = P^T / dS^T rows of this warp's keys, B = dO / Q [query][column] via .trans.
  const uint32_t pt_a = swz_addr<kPCols>(smem_addr(s.pt), kv_wn * Traits::kKvRows + a_row, a_chunk);
  const uint32_t dst_a = swz_addr<kPCols>(smem_addr(s.dst), kv_wn * Traits::kKvRows + a_row, a_chunk);
  const uint32_t do_t0 = swz_addr<kD>(smem_addr(s.dout[0]), bt_row, kv_wd * Traits::kKvCols / 8 + bt_chunk);
  const uint32_t q_t0 = swz_addr<kD>(smem_addr(s.q[0]), bt_row, kv_wd * Traits::kKvCols / 8 + bt_chunk);
  // Phase 3: A = dS [query][key] read from dS^T via .trans, B = K [key][column] via .trans.
  const uint32_t ds_a = swz_addr<kPCols>(smem_addr(s.dst), at_row, dq_wm * Traits::kDqRows / 8 + at_chunk);
  const uint32_t k_t = swz_addr<kD>(smem_addr(s.k), bt_row, dq_wd * Traits::kDqCols / 8 + bt_chunk);
  constexpr uint32_t kStageBytes = sizeof(s.q[0]);

  for (int it = 0; it < iters; ++it) {
    const int stage = it & 1;
    const int h = walk.head(it);
    const int m0 = walk.row0(it);
    const uint32_t q_b = q_b0 + stage * kStageBytes;
    const uint32_t do_b = do_b0 + stage * kStageBytes;
    cp_async_wait<0>();
    __syncthreads();  // this step's tiles landed; every warp is done with the other stage and with P^T / dS^T
    if (it + 1 < iters) load_query_side(it + 1, stage ^ 1);
    cp_async_commit();

    // ---- phase 1: S^T = K Q^T, dP^T = V dO^T over this warp's kSRows keys x kSCols queries ----
    float acc_s[kSTM][kSTN][4];
    float acc_dp[kSTM][kSTN][4];
#pragma unroll
    for (int i = 0; i < kSTM; ++i) {
#pragma unroll
      for (int j = 0; j < kSTN; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[i][j][e] = acc_dp[i][j][e] = 0.f;
      }
    }
    // acc += A B^T over the head dim; A: this warp's key rows of K or V, B: its query rows of Q or dO.
    auto keys_times_queries = [&](float (&acc)[kSTM][kSTN][4], uint32_t a_base, uint32_t b_base) {
#pragma unroll
      for (int kk = 0; kk < kD / kMmaK; ++kk) {
        uint32_t a[kSTM][4];
#pragma unroll
        for (int mi = 0; mi < kSTM; ++mi) ldmatrix_x4(a[mi], (a_base + mi * 16 * kRB) ^ (kk * 32));
#pragma unroll
        for (int nb = 0; nb < kSTN / 2; ++nb) {
          uint32_t bf[4];
          ldmatrix_x4(bf, (b_base + nb * 16 * kRB) ^ (kk * 32));
#pragma unroll
          for (int mi = 0; mi < kSTM; ++mi) {
            mma_16x8x16<T>(acc[mi][2 * nb], a[mi], bf[0], bf[1]);
            mma_16x8x16<T>(acc[mi][2 * nb + 1], a[mi], bf[2], bf[3]);
          }
        }
      }
    };
    keys_times_queries(acc_s, k_a, q_b);
    keys_times_queries(acc_dp, v_a, do_b);

    // P^T = exp2(S^T * scale_log2 - lse * log2(e)), masked; dS^T = P^T * (dP^T - dsum). Element (mi, nj, e) is key
    // s_wn * kSRows + 16 mi + g + 8 (e / 2), query s_wm * kSCols + 8 nj + 2 t + e % 2.
    // Segment ids are in visible(); with a soft cap dS^T goes through its 1 - tanh^2.
    const SoftCap cap(p);
    const int key0 = n0 + s_wn * Traits::kSRows;
    const int q0 = s_wm * Traits::kSCols;
    const bool need_mask = !mask.tile_fully_visible(m0 + q0, m0 + q0 + Traits::kSCols, key0, key0 + Traits::kSRows,
                                                    p.seqlen_q);
#pragma unroll
    for (int nj = 0; nj < kSTN; ++nj) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int m_local = q0 + nj * 8 + 2 * t + c;
        const float lse_log2 = s.lse[stage][m_local] * kLog2e;
        const float dsum = s.dsum[stage][m_local];
#pragma unroll
        for (int mi = 0; mi < kSTM; ++mi) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int e = 2 * r + c;
            // A hidden pair's P^T and dS^T are exactly 0, even where dP^T or dsum is not finite (as jax.nn's).
            const bool hidden = need_mask && !mask.visible(m0 + m_local, key0 + mi * 16 + g + 8 * r);
            const float sc = cap.enabled() ? cap.apply(acc_s[mi][nj][e]) : acc_s[mi][nj][e];
            const float pe = hidden ? 0.f : exp2f(sc * p.scale_log2 - lse_log2);
            acc_s[mi][nj][e] = pe;
            float ds = pe * (acc_dp[mi][nj][e] - dsum);
            if (cap.enabled()) ds *= cap.dtanh(sc);
            acc_dp[mi][nj][e] = hidden ? 0.f : ds;
          }
        }
      }
    }
#pragma unroll
    for (int mi = 0; mi < kSTM; ++mi) {
#pragma unroll
      for (int nj = 0; nj < kSTN; ++nj) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint32_t off = (mi * 16 + r * 8) * kPRB;
          st_shared_u32((pt_st ^ (nj * 16)) + off, ET::pack(acc_s[mi][nj][2 * r], acc_s[mi][nj][2 * r + 1]));
          st_shared_u32((dst_st ^ (nj * 16)) + off, ET::pack(acc_dp[mi][nj][2 * r], acc_dp[mi][nj][2 * r + 1]));
        }
      }
    }
    __syncthreads();  // P^T and dS^T complete

    // ---- phase 2: dV += P^T dO, dK += dS^T Q over this warp's kKvRows keys x kKvCols columns ----
    const uint32_t do_t = do_t0 + stage * kStageBytes;
    const uint32_t q_t = q_t0 + stage * kStageBytes;
#pragma unroll
    for (int kk = 0; kk < kBM / kMmaK; ++kk) {
      uint32_t a_p[kKvTM][4], a_ds[kKvTM][4];
#pragma unroll
      for (int mi = 0; mi < kKvTM; ++mi) {
        ldmatrix_x4(a_p[mi], (pt_a + mi * 16 * kPRB) ^ (kk * 32));
        ldmatrix_x4(a_ds[mi], (dst_a + mi * 16 * kPRB) ^ (kk * 32));
      }
#pragma unroll
      for (int dj = 0; dj < kKvTN / 2; ++dj) {
        uint32_t b_do[4], b_q[4];
        ldmatrix_x4_trans(b_do, (do_t ^ (dj * 32)) + kk * kMmaK * kRB);
        ldmatrix_x4_trans(b_q, (q_t ^ (dj * 32)) + kk * kMmaK * kRB);
#pragma unroll
        for (int mi = 0; mi < kKvTM; ++mi) {
          mma_16x8x16<T>(acc_dv[mi][2 * dj], a_p[mi], b_do[0], b_do[1]);
          mma_16x8x16<T>(acc_dv[mi][2 * dj + 1], a_p[mi], b_do[2], b_do[3]);
          mma_16x8x16<T>(acc_dk[mi][2 * dj], a_ds[mi], b_q[0], b_q[1]);
          mma_16x8x16<T>(acc_dk[mi][2 * dj + 1], a_ds[mi], b_q[2], b_q[3]);
        }
      }
    }

    // ---- phase 3: dQ(partial) = dS K over this warp's kDqRows queries x kDqCols columns ----
    float acc_dq[kDqTM][kDqTN][4];
#pragma unroll
    for (int i = 0; i < kDqTM; ++i) {
#pragma unroll
      for (int j = 0; j < kDqTN; ++j) acc_dq[i][j][0] = acc_dq[i][j][1] = acc_dq[i][j][2] = acc_dq[i][j][3] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < kBN / kMmaK; ++kk) {
      uint32_t a_ds[kDqTM][4];
#pragma unroll
      for (int mi = 0; mi < kDqTM; ++mi) ldmatrix_x4_trans(a_ds[mi], (ds_a ^ (mi * 32)) + kk * kMmaK * kPRB);
#pragma unroll
      for (int dj = 0; dj < kDqTN / 2; ++dj) {
        uint32_t b_k[4];
        ldmatrix_x4_trans(b_k, (k_t ^ (dj * 32)) + kk * kMmaK * kRB);
#pragma unroll
        for (int mi = 0; mi < kDqTM; ++mi) {
          mma_16x8x16<T>(acc_dq[mi][2 * dj], a_ds[mi], b_k[0], b_k[1]);
          mma_16x8x16<T>(acc_dq[mi][2 * dj + 1], a_ds[mi], b_k[2], b_k[3]);
        }
      }
    }
    float* gdQ = p.dq_accum_of(b, h);
#pragma unroll
    for (int mi = 0; mi < kDqTM; ++mi) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = m0 + dq_wm * Traits::kDqRows + mi * 16 + g + 8 * r;
        if (row < p.seqlen_q) {
#pragma unroll
          for (int nj = 0; nj < kDqTN; ++nj) {
            const int col = dq_wd * Traits::kDqCols + nj * 8 + 2 * t;
            if (col < p.head_dim) {
              atomic_add_f32x2(gdQ + row * p.head_dim_rounded + col, acc_dq[mi][nj][2 * r],
                               acc_dq[mi][nj][2 * r + 1]);
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: dK = scale * dS^T Q, dV = P^T dO for keys < seqlen_k, columns < head_dim.
#pragma unroll
  for (int mi = 0; mi < kKvTM; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = kv_wn * Traits::kKvRows + mi * 16 + g + 8 * r;
      if (row < keys_valid) {
#pragma unroll
        for (int nj = 0; nj < kKvTN; ++nj) {
          const int col = kv_wd * Traits::kKvCols + nj * 8 + 2 * t;
          if (col < p.head_dim) {
            *reinterpret_cast<uint32_t*>(gdK + row * kv_stride + col) =
                ET::pack(acc_dk[mi][nj][2 * r] * p.scale, acc_dk[mi][nj][2 * r + 1] * p.scale);
            *reinterpret_cast<uint32_t*>(gdV + row * kv_stride + col) =
                ET::pack(acc_dv[mi][nj][2 * r], acc_dv[mi][nj][2 * r + 1]);
          }
        }
      }
    }
  }
}

}  // namespace jax_flash::cuda
