// Forward FlashAttention kernel for sm_90a: TMA loads into an mbarrier-guarded shared-memory ring, wgmma for
// S = Q K^T (both operands from shared memory) and O += P V (P from registers), online softmax with exp2 and the
// log2(e)-folded scale, warp specialisation (a producer warpgroup issues the loads; consumer warpgroups compute).
//
// Grid: (query blocks, query heads, batch), heaviest (last) query blocks first. Each consumer warpgroup owns 64
// query rows; per thread (warp w of the warpgroup, lane = 4 g + t) rows 16 w + g and 16 w + g + 8, columns
// 8 j + 2 t (+1) of every 8-wide column tile j of S and O.
//
// TMA tensor maps view q as (head_dim, seqlen_q, heads_q, batch) in boxes of kColBlock columns x tile rows, and k, v
// likewise with heads_kv; out-of-range rows and columns load as zeros (and are masked), so no length needs to
// divide a tile. O and LSE are stored from registers.
#pragma once

#include <cmath>

#include "../flash_params.h"
#include "../mask.h"
#include "kernel_common.cuh"
#include "kernel_traits_sm80.h"  // kWarpSize
#include "kernel_traits_sm90.h"
#include "utils_sm80.cuh"  // ElemTraits, quad reductions
#include "utils_sm90.cuh"
#include "wgmma_sm90.cuh"

namespace jax_flash::cuda::sm90 {

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ FlashParams p, const __grid_constant__ CUtensorMap tm_q,
                          const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v) {
#if defined(JAX_FLASH_SM90A)
  constexpr int kD = Traits::kHeadDim;
  constexpr int kBM = Traits::kBlockM;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kSTiles = kBN / 8;   // 8-wide column tiles of S
  constexpr int kOTiles = kD / 8;    // 8-wide column tiles of O
  using ET = ElemTraits<T>;
  using Storage = typename Traits::SharedStorage;

  Storage& smem = shared_storage<Storage>();

  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int hk = h / p.group_size();
  const int tid = threadIdx.x;

  const AttentionMask mask = mask_for_batch(p, b);

  const int m0 = m_block * kBM;
  const int rows_valid = imin(kBM, p.seqlen_q - m0);
  const int64_t q_stride = p.q_row_stride();
  T* gO = static_cast<T*>(p.o) + b * p.q_batch_stride() + m0 * q_stride + int64_t(h) * p.head_dim;
  float* gLse = p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q + m0;

  int n_begin, n_end;
  key_tiles_for_rows<kBN>(mask, p, m0, rows_valid, &n_begin, &n_end);
  const int n_tiles = n_end - n_begin;
  if (n_tiles <= 0) {  // no row of this block sees a key: zeros and lse = +inf
    for (int c = tid; c < rows_valid * (p.head_dim / 8); c += Traits::kThreads) {
      const int row = c / (p.head_dim / 8);
      const int col = (c % (p.head_dim / 8)) * 8;
      *reinterpret_cast<uint4*>(gO + row * q_stride + col) = make_uint4(0, 0, 0, 0);
    }
    for (int r = tid; r < rows_valid; r += Traits::kThreads) gLse[r] = INFINITY;
    return;
  }

  constexpr int kConsumerWarps = Traits::kConsumerWarpgroups * 4;
  if (tid == 0) {
    mbar_init(&smem.q_full, 1);
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&smem.k_full[s], 1);
      mbar_init(&smem.v_full[s], 1);
      mbar_init(&smem.k_empty[s], kConsumerWarps);  // one arrival per consumer warp
      mbar_init(&smem.v_empty[s], kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int warpgroup = tid / kWarpgroupThreads;
  if (warpgroup == 0) {
    // ---- producer: one thread issues every load ------------------------------------------------------------
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (tid == 0) {
      prefetch_tensor_map(&tm_q);
      prefetch_tensor_map(&tm_k);
      prefetch_tensor_map(&tm_v);
      mbar_arrive_expect_tx(&smem.q_full, Traits::kQBytes);
#pragma unroll
      for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
        tma_load_4d(smem.q + cb * kBM * kColBlock, &tm_q, &smem.q_full, cb * kColBlock, m0, h, b);
      }
      for (int i = 0; i < n_tiles; ++i) {
        const int s = i % kStages;
        const int n0 = (n_begin + i) * kBN;
        if (i >= kStages) mbar_wait(&smem.k_empty[s], ((i / kStages) - 1) & 1);
        mbar_arrive_expect_tx(&smem.k_full[s], Traits::kKVBytes);
#pragma unroll
        for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
          tma_load_4d(smem.k[s] + cb * kBN * kColBlock, &tm_k, &smem.k_full[s], cb * kColBlock, n0, hk, b);
        }
        if (i >= kStages) mbar_wait(&smem.v_empty[s], ((i / kStages) - 1) & 1);
        mbar_arrive_expect_tx(&smem.v_full[s], Traits::kKVBytes);
#pragma unroll
        for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
          tma_load_4d(smem.v[s] + cb * kBN * kColBlock, &tm_v, &smem.v_full[s], cb * kColBlock, n0, hk, b);
        }
      }
    }
    return;
  }

  // ---- consumers -----------------------------------------------------------------------------------------------
  // Per key tile i the warpgroup issues S_i = Q K_i^T and O += P_{i-1} V_{i-1} back to back, then runs the softmax
  // of S_i while the PV product is still on the tensor cores (intra-warpgroup overlap). With kPingPong the two
  // consumer warpgroups also take turns issuing their products, so one's softmax overlaps the other's GEMMs.
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int cw = warpgroup - 1;                 // consumer warpgroup: query rows [64 cw, 64 cw + 64) of the block
  const int warp = (tid / kWarpSize) % 4;       // warp inside the warpgroup
  const int lane = tid % kWarpSize;
  const bool lane0 = lane == 0;
  const int g = lane / 4;
  const int t = lane % 4;
  const int warp_row0 = cw * kWgmmaM + warp * kWarpRows;  // first of this warp's 16 rows inside the block

  float acc_o[kOTiles * 4];    // O: 64 rows x kD, accumulator layout
  float acc_s[kSTiles * 4];    // S of the current key tile, then its exp2 values
  uint32_t a_p[kBN / kWgmmaK][4];  // P of the previous tile as wgmma A fragments (16 keys per step)
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of the raw logits of rows g, g + 8
  float row_sum[2] = {0.f, 0.f};              // per-lane partial sums; reduced over the quad at the end
#pragma unroll
  for (int i = 0; i < kOTiles * 4; ++i) acc_o[i] = 0.f;

  // Q slice of this warpgroup: column block cb starts at q + cb * kBM * 64, its rows at 128-byte pitch.
  const uint32_t q_base = smem_addr(smem.q) + cw * kWgmmaM * kSwizzleBytes;
  constexpr uint32_t kQColBlockBytes = kBM * kSwizzleBytes;
  constexpr uint32_t kKVColBlockBytes = kBN * kSwizzleBytes;
  constexpr int kKStepsPerColBlock = kColBlock / kWgmmaK;  // 16-element K slices per 128-byte row

  // Ping-pong: warpgroup cw waits on barrier kPingPongBarrier + cw before issuing, then releases the other.
  constexpr bool kPingPong = Traits::kPingPong && Traits::kConsumerWarpgroups == 2;
  const int my_turn = kPingPongBarrier + cw;
  const int their_turn = kPingPongBarrier + (cw ^ 1);
  constexpr int kPairThreads = 2 * kWarpgroupThreads;
  int steps_left = n_tiles + 1;  // issue steps: S_0, then (S_i, PV_{i-1}) for i >= 1, then PV_{n-1}
  auto begin_issue = [&] {
    if constexpr (kPingPong) named_barrier_sync(my_turn, kPairThreads);
  };
  auto end_issue = [&] {
    --steps_left;
    // Warpgroup 1 lets warpgroup 0 go first (below) and so skips its very last release to stay balanced.
    if constexpr (kPingPong) {
      if (cw == 0 || steps_left > 0) named_barrier_arrive(their_turn, kPairThreads);
    }
  };
  if constexpr (kPingPong) {
    if (cw == 1) named_barrier_arrive(their_turn, kPairThreads);
  }

  auto issue_s = [&](int i) {  // S_i = Q K_i^T (64 x kBN), both operands in shared memory
    const uint32_t k_base = smem_addr(smem.k[i % kStages]);
#pragma unroll
    for (int kk = 0; kk < kD / kWgmmaK; ++kk) {
      const uint32_t k_off = (kk % kKStepsPerColBlock) * (kWgmmaK * sizeof(T));  // inside the 128-byte row
      const uint64_t desc_q =
          make_desc_sw128(q_base + (kk / kKStepsPerColBlock) * kQColBlockBytes + k_off, kKMajorLeadingBytes);
      const uint64_t desc_k =
          make_desc_sw128(k_base + (kk / kKStepsPerColBlock) * kKVColBlockBytes + k_off, kKMajorLeadingBytes);
      Wgmma<kBN, T, 0>::ss(acc_s, desc_q, desc_k, kk > 0);
    }
    wgmma_commit();
  };
  auto issue_pv = [&](int i) {  // O += P V_i; V read N-major, 64-dim column blocks kKVColBlockBytes apart
    const uint32_t v_base = smem_addr(smem.v[i % kStages]);
#pragma unroll
    for (int kk = 0; kk < kBN / kWgmmaK; ++kk) {
      const uint64_t desc_v = make_desc_sw128(v_base + kk * kWgmmaK * kSwizzleBytes, kKVColBlockBytes);
      Wgmma<kD, T, 1>::rs(acc_o, a_p[kk], desc_v, 1);
    }
    wgmma_commit();
  };

  // Masks S_i (only warps whose 16 rows do not see the whole tile), then the online-softmax update: S_i becomes
  // exp2 values, the running max and sum move on; returns the factors that rescale O for rows g and g + 8.
  auto softmax = [&](int i, float (&correction)[2]) {
    const int n0 = (n_begin + i) * kBN;
    const int tile_row0 = m0 + warp_row0;
    if (!mask.tile_fully_visible(tile_row0, tile_row0 + kWarpRows, n0, n0 + kBN, p.seqlen_q)) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int lo = mask.lo(tile_row0 + g + 8 * r);
        const int hi = mask.hi(tile_row0 + g + 8 * r);
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = n0 + j * 8 + 2 * t + e;
            if (col < lo || col >= hi) acc_s[4 * j + 2 * r + e] = -INFINITY;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) mx = fmaxf(mx, fmaxf(acc_s[4 * j + 2 * r], acc_s[4 * j + 2 * r + 1]));
      mx = quad_max(mx);
      const float max_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
      correction[r] = exp2f(row_max[r] * p.scale_log2 - max_scaled);
      row_max[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = exp2f(acc_s[4 * j + 2 * r + e] * p.scale_log2 - max_scaled);
          acc_s[4 * j + 2 * r + e] = pe;
          sum += pe;
        }
      }
      row_sum[r] = row_sum[r] * correction[r] + sum;
    }
  };
  auto rescale_o = [&](const float (&correction)[2]) {
#pragma unroll
    for (int j = 0; j < kOTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[4 * j + e] *= correction[e / 2];
    }
  };
  auto convert_p = [&] {  // 16 keys per step = S column tiles 2 kk and 2 kk + 1
#pragma unroll
    for (int kk = 0; kk < kBN / kWgmmaK; ++kk) {
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4) a_p[kk][q4] = ET::pack(acc_s[8 * kk + 2 * q4], acc_s[8 * kk + 2 * q4 + 1]);
    }
  };

  mbar_wait(&smem.q_full, 0);

  // Tile 0: S_0 alone.
  float correction[2];
  mbar_wait(&smem.k_full[0], 0);
  begin_issue();
  wgmma_fence();
  issue_s(0);
  end_issue();
  wgmma_wait<0>();
  fence_regs(acc_s);
  if (lane0) mbar_arrive(&smem.k_empty[0]);
  softmax(0, correction);
  convert_p();

  for (int i = 1; i < n_tiles; ++i) {
    const int s = i % kStages;
    const int sp = (i - 1) % kStages;
    mbar_wait(&smem.k_full[s], (i / kStages) & 1);
    mbar_wait(&smem.v_full[sp], ((i - 1) / kStages) & 1);
    begin_issue();
    wgmma_fence();
    issue_s(i);
    issue_pv(i - 1);
    end_issue();
    wgmma_wait<1>();  // S_i done; PV_{i-1} may still run
    fence_regs(acc_s);
    if (lane0) mbar_arrive(&smem.k_empty[s]);
    softmax(i, correction);
    wgmma_wait<0>();  // PV_{i-1} done: O and P's registers are free
    fence_regs(acc_o);
    fence_regs(a_p);
    if (lane0) mbar_arrive(&smem.v_empty[sp]);
    rescale_o(correction);
    convert_p();
  }

  // Last PV.
  {
    const int sp = (n_tiles - 1) % kStages;
    mbar_wait(&smem.v_full[sp], ((n_tiles - 1) / kStages) & 1);
    begin_issue();
    wgmma_fence();
    issue_pv(n_tiles - 1);
    end_issue();
    wgmma_wait<0>();
    fence_regs(acc_o);
    fence_regs(a_p);
    if (lane0) mbar_arrive(&smem.v_empty[sp]);
  }

  // Epilogue: normalise, write O (rows < seqlen_q, columns < head_dim) and the natural-log LSE.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = quad_sum(row_sum[r]);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int row = warp_row0 + g + 8 * r;
    if (row < rows_valid) {
#pragma unroll
      for (int j = 0; j < kOTiles; ++j) {
        const int col = j * 8 + 2 * t;
        if (col < p.head_dim) {
          *reinterpret_cast<uint32_t*>(gO + row * q_stride + col) =
              ET::pack(acc_o[4 * j + 2 * r] * inv, acc_o[4 * j + 2 * r + 1] * inv);
        }
      }
      if (t == 0) gLse[row] = sum > 0.f ? row_max[r] * p.scale + logf(sum) : INFINITY;
    }
  }
#else
  __trap();  // built for a target without wgmma; the dispatcher only launches this on compute capability 9.0
#endif
}

}  // namespace jax_flash::cuda::sm90
