// Backward FlashAttention-2 kernels for sm_80 and newer.
//   1. flash_bwd_preprocess_kernel: the row statistics lse * log2(e) and dsum = rowsum(dO * O) (float32,
//      FlashParams::row_stats).
//   2. flash_bwd_sm80_kernel: key/value stationary. A CTA keeps kBlockN keys of one kv head in shared memory and
//      loops over every query head of the group and every query block that can see them, recomputing
//      P^T = exp(S^T - lse) from K Q^T. dK and dV stay in registers for the whole loop (no head-expanded
//      temporaries for GQA); dQ partials go to a float32 accumulator with atomics (rows of DqRowMajor).
//   3. flash_bwd_convert_dq_kernel: dq = scale * dq_accum in the input dtype.
// Working with S^T (keys as rows) puts P^T and dS^T in the A-operand layout of dV += P^T dO and dK += dS^T Q,
// so both are fed from registers; dS^T also goes to shared memory for dQ = dS K.
#pragma once

#include <cmath>

#include "flash_params.h"
#include "mask.h"
#include "score_mod.h"
#include "kernels/sm80/flash_fwd_sm80_mma_cpasync.cuh"
#include "kernels/common/atomics.cuh"
#include "kernels/common/block_ranges.cuh"
#include "kernels/sm80/kernel_traits_sm80.h"
#include "kernels/sm80/utils_sm80.cuh"

namespace jax_flash::cuda {

// 4-byte cp.async (row statistics), zero-filled when !pred.
__device__ __forceinline__ void cp_async_4(uint32_t smem_addr, const void* gmem, bool pred) {
  const int src_bytes = pred ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}

// cp.async of the query side of one backward iteration: rows [m0, m0 + kBM) of Q and dO (row stride q_stride)
// for query head h of batch element b into the swizzled [kBM][kD] tiles sQ and sdO, their lse and dsum entries
// into sLse and sDsum; rows past seqlen_q are zero-filled.
template <int kBM, int kD, int kThreads, typename T>
__device__ __forceinline__ void load_query_side_async(const FlashParams& p, int64_t q_stride, int b, int h, int m0,
                                                      T* sQ, T* sdO, float* sLse, float* sDsum, int tid) {
  const int64_t q_off = b * p.q_batch_stride() + m0 * q_stride + int64_t(h) * p.head_dim;
  const int rows = p.seqlen_q - m0;
  load_tile_async<kBM, kD, kThreads>(sQ, static_cast<const T*>(p.q) + q_off, q_stride, rows, p.head_dim, tid);
  load_tile_async<kBM, kD, kThreads>(sdO, static_cast<const T*>(p.dout) + q_off, q_stride, rows, p.head_dim, tid);
  const float* lse = p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q + m0;
  const float* dsum = p.dsum_of(b, h) + m0;
  for (int r = tid; r < kBM; r += kThreads) {
    const bool ok = r < rows;
    cp_async_4(smem_addr(sLse + r), ok ? lse + r : p.lse, ok);
    cp_async_4(smem_addr(sDsum + r), ok ? dsum + r : p.row_stats, ok);
  }
}

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm) flash_bwd_sm80_kernel(const FlashParams p) {
  constexpr int kD = Traits::kHeadDim;
  constexpr int kBM = Traits::kBlockM;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kMTiles = kBM / 8;                   // 8-wide column tiles of S^T (query rows)
  constexpr int kDW = Traits::kDimPerWarp;           // dK/dV columns per warp
  constexpr int kDqW = Traits::kDqDimPerWarp;        // dQ columns per warp
  using ET = ElemTraits<T>;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);                            // [kBN][kD]
  T* sV = sK + Traits::kSmemKVElems;                                 // [kBN][kD]
  T* sQ = sV + Traits::kSmemKVElems;                                 // [kStages][kBM][kD]
  T* sdO = sQ + Traits::kStages * Traits::kSmemQElems;               // [kStages][kBM][kD]
  T* sdS = sdO + Traits::kStages * Traits::kSmemQElems;              // [kBN][kDsCols]  (dS^T)
  float* sLse = reinterpret_cast<float*>(sdS + Traits::kSmemDsElems);  // [kStages][kBM]
  float* sDsum = sLse + Traits::kStages * kBM;                         // [kStages][kBM]

  const int n_block = blockIdx.x;
  const int hk = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  const int warp_n = warp % Traits::kWarpsN;  // which 16 keys
  const int warp_d = warp / Traits::kWarpsN;  // which dK/dV column slice

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
                                             sQ + stage * Traits::kSmemQElems,
                                             sdO + stage * Traits::kSmemQElems, sLse + stage * kBM,
                                             sDsum + stage * kBM, tid);
  };

  load_tile_async<kBN, kD, kThreads>(sK, static_cast<const T*>(p.k) + kv_off, kv_stride, keys_valid, p.head_dim, tid);
  load_tile_async<kBN, kD, kThreads>(sV, static_cast<const T*>(p.v) + kv_off, kv_stride, keys_valid, p.head_dim, tid);
  load_query_side(0, 0);
  cp_async_commit();

  float acc_dk[kDW / 8][4];
  float acc_dv[kDW / 8][4];
#pragma unroll
  for (int i = 0; i < kDW / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dk[i][e] = acc_dv[i][e] = 0.f;
  }

  const int key_row0 = warp_n * kMmaM;  // first key of this warp inside the block
  const int dq_wm = warp % Traits::kDqWarpsM;
  const int dq_wd = warp / Traits::kDqWarpsM;
  constexpr int kRB = kRowBytes<kD>;
  constexpr uint32_t kStageBytes = Traits::kSmemQElems * sizeof(T);
  // ldmatrix lane addresses (see utils_sm80.cuh); column steps of 16 elements are XORs with 32 bytes.
  const int a_row = lane % 16, a_chunk = lane / 16;                          // A from a row-major tile
  const int bn_row = (lane % 8) + (lane / 16) * 8, bn_chunk = (lane / 8) % 2;  // B from an [n][k] tile
  const int bt_row = (lane % 8) + ((lane / 8) % 2) * 8, bt_chunk = lane / 16;  // B from a [k][n] tile (.trans)
  const uint32_t k_a_addr = swz_addr<kD>(smem_addr(sK), key_row0 + a_row, a_chunk);
  const uint32_t v_a_addr = swz_addr<kD>(smem_addr(sV), key_row0 + a_row, a_chunk);
  const uint32_t q_b_addr = swz_addr<kD>(smem_addr(sQ), bn_row, bn_chunk);
  const uint32_t do_b_addr = swz_addr<kD>(smem_addr(sdO), bn_row, bn_chunk);
  const uint32_t q_t_addr = swz_addr<kD>(smem_addr(sQ), bt_row, warp_d * kDW / 8 + bt_chunk);
  const uint32_t do_t_addr = swz_addr<kD>(smem_addr(sdO), bt_row, warp_d * kDW / 8 + bt_chunk);
  const uint32_t k_t_addr = swz_addr<kD>(smem_addr(sK), bt_row, dq_wd * kDqW / 8 + bt_chunk);
  // dS^T as an A operand via ldmatrix.trans: row (lane%8) + (lane/16)*8, chunk dq_wm*2 + (lane/8)%2.
  const uint32_t ds_t_addr = swz_addr<Traits::kDsCols>(smem_addr(sdS), (lane % 8) + (lane / 16) * 8, dq_wm * 2 + (lane / 8) % 2);
  // dS^T stores: rows key_row0 + g (+8), 4-byte word t of chunk mt.
  const uint32_t ds_st_addr = swz_addr<Traits::kDsCols>(smem_addr(sdS), key_row0 + g, 0) + 4 * t;

  for (int it = 0; it < iters; ++it) {
    const int stage = it & 1;
    const int h = walk.head(it);
    const int m0 = walk.row0(it);
    const uint32_t q_b = q_b_addr + stage * kStageBytes;
    const uint32_t do_b = do_b_addr + stage * kStageBytes;
    const uint32_t q_t = q_t_addr + stage * kStageBytes;
    const uint32_t do_t = do_t_addr + stage * kStageBytes;
    const float* sLses = sLse + stage * kBM;
    const float* sDsums = sDsum + stage * kBM;
    cp_async_wait<0>();
    __syncthreads();  // this step's tiles landed; every warp is done with the other stage and with sdS
    if (it + 1 < iters) load_query_side(it + 1, stage ^ 1);
    cp_async_commit();

    // S^T = K Q^T and dP^T = V dO^T: this warp's 16 keys x kBM query rows.
    float acc_s[kMTiles][4];
    float acc_dp[kMTiles][4];
#pragma unroll
    for (int i = 0; i < kMTiles; ++i) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_s[i][e] = acc_dp[i][e] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < kD / kMmaK; ++kk) {
      uint32_t a_k[4], a_v[4];
      ldmatrix_x4(a_k, k_a_addr ^ (kk * 32));
      ldmatrix_x4(a_v, v_a_addr ^ (kk * 32));
      const uint32_t q_col = q_b ^ (kk * 32), do_col = do_b ^ (kk * 32);
#pragma unroll
      for (int mm = 0; mm < kBM / 16; ++mm) {
        uint32_t b_q[4], b_do[4];
        ldmatrix_x4(b_q, q_col + mm * 16 * kRB);
        ldmatrix_x4(b_do, do_col + mm * 16 * kRB);
        mma_16x8x16<T>(acc_s[2 * mm], a_k, b_q[0], b_q[1]);
        mma_16x8x16<T>(acc_s[2 * mm + 1], a_k, b_q[2], b_q[3]);
        mma_16x8x16<T>(acc_dp[2 * mm], a_v, b_do[0], b_do[1]);
        mma_16x8x16<T>(acc_dp[2 * mm + 1], a_v, b_do[2], b_do[3]);
      }
    }

    // P^T = exp2(S^T * scale_log2 - lse * log2(e)), masked (segment ids included: visible()); dS^T = P^T * (dP^T -
    // dsum), through the soft cap's 1 - tanh^2 when there is one.
    const SoftCap cap(p);
    const bool need_mask =
        !mask.tile_fully_visible(m0, m0 + kBM, n0 + key_row0, n0 + key_row0 + kMmaM, p.seqlen_q);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int m_local = mt * 8 + 2 * t + (e & 1);
        const int key = n0 + key_row0 + g + 8 * (e >> 1);
        // A hidden pair's P^T and dS^T are exactly 0, even where dP^T or dsum is not finite (as jax.nn's).
        const bool hidden = need_mask && !mask.visible(m0 + m_local, key);
        const float sc = cap.enabled() ? cap.apply(acc_s[mt][e]) : acc_s[mt][e];
        const float pe = hidden ? 0.f : exp2f(sc * p.scale_log2 - sLses[m_local] * kLog2e);
        acc_s[mt][e] = pe;
        float ds = pe * (acc_dp[mt][e] - sDsums[m_local]);
        if (cap.enabled()) ds *= cap.dtanh(sc);
        acc_dp[mt][e] = hidden ? 0.f : ds;
      }
    }

    // dS^T -> shared memory (bf16/fp16) for dQ; one warp of each split-D group writes.
    if (warp_d == 0) {
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          st_shared_u32((ds_st_addr ^ (mt * 16)) + r * 8 * kRowBytes<Traits::kDsCols>,
                        ET::pack(acc_dp[mt][2 * r], acc_dp[mt][2 * r + 1]));
        }
      }
    }

    // dV += P^T dO and dK += dS^T Q over this warp's kDW columns; A operands straight from registers.
#pragma unroll
    for (int kk = 0; kk < kBM / kMmaK; ++kk) {
      uint32_t a_p[4], a_ds[4];
      a_p[0] = ET::pack(acc_s[2 * kk][0], acc_s[2 * kk][1]);
      a_p[1] = ET::pack(acc_s[2 * kk][2], acc_s[2 * kk][3]);
      a_p[2] = ET::pack(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
      a_p[3] = ET::pack(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
      a_ds[0] = ET::pack(acc_dp[2 * kk][0], acc_dp[2 * kk][1]);
      a_ds[1] = ET::pack(acc_dp[2 * kk][2], acc_dp[2 * kk][3]);
      a_ds[2] = ET::pack(acc_dp[2 * kk + 1][0], acc_dp[2 * kk + 1][1]);
      a_ds[3] = ET::pack(acc_dp[2 * kk + 1][2], acc_dp[2 * kk + 1][3]);
#pragma unroll
      for (int dd = 0; dd < kDW / 16; ++dd) {
        uint32_t b_do[4], b_q[4];
        ldmatrix_x4_trans(b_do, (do_t ^ (dd * 32)) + kk * kMmaK * kRB);
        ldmatrix_x4_trans(b_q, (q_t ^ (dd * 32)) + kk * kMmaK * kRB);
        mma_16x8x16<T>(acc_dv[2 * dd], a_p, b_do[0], b_do[1]);
        mma_16x8x16<T>(acc_dv[2 * dd + 1], a_p, b_do[2], b_do[3]);
        mma_16x8x16<T>(acc_dk[2 * dd], a_ds, b_q[0], b_q[1]);
        mma_16x8x16<T>(acc_dk[2 * dd + 1], a_ds, b_q[2], b_q[3]);
      }
    }
    __syncthreads();  // dS^T complete

    // dQ(partial) = dS K over this block's keys: warp tile (dq_wm: 16 rows) x (dq_wd: kDqW columns).
    float acc_dq[kDqW / 8][4];
#pragma unroll
    for (int i = 0; i < kDqW / 8; ++i) acc_dq[i][0] = acc_dq[i][1] = acc_dq[i][2] = acc_dq[i][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kBN / kMmaK; ++kk) {
      uint32_t a_ds[4];
      ldmatrix_x4_trans(a_ds, ds_t_addr + kk * kMmaK * kRowBytes<Traits::kDsCols>);
#pragma unroll
      for (int dd = 0; dd < kDqW / 16; ++dd) {
        uint32_t b_k[4];
        ldmatrix_x4_trans(b_k, (k_t_addr ^ (dd * 32)) + kk * kMmaK * kRB);
        mma_16x8x16<T>(acc_dq[2 * dd], a_ds, b_k[0], b_k[1]);
        mma_16x8x16<T>(acc_dq[2 * dd + 1], a_ds, b_k[2], b_k[3]);
      }
    }
    float* gdQ = p.dq_accum_of(b, h);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = m0 + dq_wm * kMmaM + g + 8 * r;
      if (row < p.seqlen_q) {
#pragma unroll
        for (int dt = 0; dt < kDqW / 8; ++dt) {
          const int col = dq_wd * kDqW + dt * 8 + 2 * t;
          if (col < p.head_dim) {
            atomic_add_f32x2(gdQ + row * p.head_dim_rounded + col, acc_dq[dt][2 * r], acc_dq[dt][2 * r + 1]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: dK = scale * dS^T Q, dV = P^T dO for keys < seqlen_k, columns < head_dim.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = key_row0 + g + 8 * r;
    if (row < keys_valid) {
#pragma unroll
      for (int dt = 0; dt < kDW / 8; ++dt) {
        const int col = warp_d * kDW + dt * 8 + 2 * t;
        if (col < p.head_dim) {
          *reinterpret_cast<uint32_t*>(gdK + row * kv_stride + col) =
              ET::pack(acc_dk[dt][2 * r] * p.scale, acc_dk[dt][2 * r + 1] * p.scale);
          *reinterpret_cast<uint32_t*>(gdV + row * kv_stride + col) =
              ET::pack(acc_dv[dt][2 * r], acc_dv[dt][2 * r + 1]);
        }
      }
    }
  }
}

}  // namespace jax_flash::cuda
