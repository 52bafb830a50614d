// Forward FlashAttention-2 kernel for sm_80 and newer: cp.async K/V ring, mma.sync m16n8k16 for QK^T and PV,
// online softmax in registers with exp2 and the log2(e)-folded scale, O and LSE written once.
//
// Grid: (query blocks, query heads, batch). Each warp owns 16 query rows; per lane (g = lane / 4, t = lane % 4)
// that is rows g and g + 8 of the warp's slice, columns 2t, 2t+1 of every 8-wide MMA tile.
#pragma once

#include <cmath>

#include "flash_params.h"
#include "mask.h"
#include "score_mod.h"
#include "kernels/common/block_ranges.cuh"
#include "kernels/common/row_finish.cuh"
#include "kernels/sm80/kernel_traits_sm80.h"
#include "kernels/sm80/utils_sm80.cuh"

namespace jax_flash::cuda {

// Copies rows [0, rows_valid) of a kRows x kCols tile (global row stride `stride` elements, `cols_valid` real
// columns) into swizzled shared memory with cp.async; rows/columns outside are zero-filled.
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void load_tile_async(T* smem, const T* gmem, int64_t stride, int rows_valid,
                                                int cols_valid, int tid) {
  constexpr int kChunksPerRow = kCols / kElemsPerChunk;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
  for (int c = tid; c < kChunks; c += kThreads) {
    const int row = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * kElemsPerChunk;
    const bool pred = row < rows_valid && col < cols_valid;
    const T* src = pred ? gmem + row * stride + col : gmem;
    cp_async_16(smem_addr(smem + swz<kCols>(row, col)), src, pred);
  }
}

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm) flash_fwd_sm80_kernel(const FlashParams p) {
  constexpr int kD = Traits::kHeadDim;
  constexpr int kBM = Traits::kBlockM;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kTM = Traits::kWarpMTiles;  // 16-row MMA tiles per warp
  constexpr int kThreads = Traits::kThreads;
  constexpr int kNTiles = kBN / 8;   // 8-wide MMA column tiles of S
  constexpr int kDTiles = kD / 8;    // 8-wide MMA column tiles of O
  using ET = ElemTraits<T>;

  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);                  // [kBM][kD]
  T* sK = sQ + Traits::kSmemQElems;                        // [kStages][kBN][kD]
  T* sV = sK + Traits::kStages * Traits::kSmemKVElems;     // [kStages][kBN][kD]

  const int m_block = gridDim.x - 1 - blockIdx.x;  // last (heaviest under a causal mask) blocks first
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int hk = h / p.group_size();
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;

  const AttentionMask mask = mask_for_batch(p, b);

  const int m0 = m_block * kBM;
  const int rows_valid = imin(kBM, p.seqlen_q - m0);
  const int64_t q_stride = p.q_row_stride();
  const int64_t kv_stride = p.kv_row_stride();
  const T* gQ = static_cast<const T*>(p.q) + b * p.q_batch_stride() + m0 * q_stride + int64_t(h) * p.head_dim;
  const T* gK = static_cast<const T*>(p.k) + b * p.kv_batch_stride() + int64_t(hk) * p.head_dim;
  const T* gV = static_cast<const T*>(p.v) + b * p.kv_batch_stride() + int64_t(hk) * p.head_dim;
  T* gO = static_cast<T*>(p.o) + b * p.q_batch_stride() + m0 * q_stride + int64_t(h) * p.head_dim;
  float* gLse = p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q + m0;

  int n_begin, n_end;
  key_tiles_for_rows<kBN>(mask, p, m0, rows_valid, &n_begin, &n_end);
  if (n_end <= n_begin) {  // no row of this block sees a key: zeros and lse = +inf
    for (int c = tid; c < rows_valid * (p.head_dim / kElemsPerChunk); c += kThreads) {
      const int row = c / (p.head_dim / kElemsPerChunk);
      const int col = (c % (p.head_dim / kElemsPerChunk)) * kElemsPerChunk;
      *reinterpret_cast<uint4*>(gO + row * q_stride + col) = make_uint4(0, 0, 0, 0);
    }
    for (int r = tid; r < rows_valid; r += kThreads) gLse[r] = INFINITY;
    return;
  }

  load_tile_async<kBM, kD, kThreads>(sQ, gQ, q_stride, rows_valid, p.head_dim, tid);
  load_tile_async<kBN, kD, kThreads>(sK, gK + int64_t(n_begin) * kBN * kv_stride, kv_stride,
                                     p.seqlen_k - n_begin * kBN, p.head_dim, tid);
  load_tile_async<kBN, kD, kThreads>(sV, gV + int64_t(n_begin) * kBN * kv_stride, kv_stride,
                                     p.seqlen_k - n_begin * kBN, p.head_dim, tid);
  cp_async_commit();

  float acc_o[kTM][kDTiles][4];  // O: this warp's kTM x 16 rows, all kD columns
  float row_max[kTM][2];         // running max of the raw logits of rows g and g + 8 of each m-tile
  float row_sum[kTM][2];         // per-lane partial sums; reduced over the quad at the end
  bool seen[kTM][2];             // the lane saw a key of the row (needed with segment ids)
#pragma unroll
  for (int mi = 0; mi < kTM; ++mi) {
#pragma unroll
    for (int i = 0; i < kDTiles; ++i) acc_o[mi][i][0] = acc_o[mi][i][1] = acc_o[mi][i][2] = acc_o[mi][i][3] = 0.f;
    row_max[mi][0] = row_max[mi][1] = -INFINITY;
    row_sum[mi][0] = row_sum[mi][1] = 0.f;
    seen[mi][0] = seen[mi][1] = false;
  }
  const SoftCap cap(p);
  const SegmentPolicy& seg = mask.segments;
  const float sink = p.sinks != nullptr ? p.sinks[int64_t(b) * p.heads_q + h] : -INFINITY;

  uint32_t q_frag[Traits::kQInRegs ? kTM : 1][Traits::kQInRegs ? kD / kMmaK : 1][4];
  const int warp_row0 = warp * kTM * kMmaM;  // first row of this warp inside the block
  constexpr int kRB = kRowBytes<kD>;
  constexpr uint32_t kStageBytes = Traits::kSmemKVElems * sizeof(T);
  // ldmatrix lane addresses (see utils_sm80.cuh): A operands take row lane%16, chunk lane/16; B operands from a
  // [n][k] tile take row (lane%8) + (lane/16)*8, chunk (lane/8)%2; B from a [k][n] tile (.trans) take row
  // (lane%8) + ((lane/8)%2)*8, chunk lane/16. Column steps of 16 elements are XORs with 32 bytes.
  const uint32_t q_addr = swz_addr<kD>(smem_addr(sQ), warp_row0 + lane % 16, lane / 16);
  const uint32_t k_addr = swz_addr<kD>(smem_addr(sK), (lane % 8) + (lane / 16) * 8, (lane / 8) % 2);
  const uint32_t v_addr = swz_addr<kD>(smem_addr(sV), (lane % 8) + ((lane / 8) % 2) * 8, lane / 16);

  for (int n_block = n_begin; n_block < n_end; ++n_block) {
    const int stage = (n_block - n_begin) & 1;
    const uint32_t k_stage = k_addr + stage * kStageBytes;
    const uint32_t v_stage = v_addr + stage * kStageBytes;
    cp_async_wait<0>();
    __syncthreads();  // tiles of this step landed; every warp is done with the other stage
    if constexpr (Traits::kQInRegs) {
      if (n_block == n_begin) {
#pragma unroll
        for (int mi = 0; mi < kTM; ++mi) {
#pragma unroll
          for (int kk = 0; kk < kD / kMmaK; ++kk) {
            ldmatrix_x4(q_frag[mi][kk], (q_addr ^ (kk * 32)) + mi * kMmaM * kRB);
          }
        }
      }
    }
    if (n_block + 1 < n_end) {
      const int n1 = (n_block + 1) * kBN;
      load_tile_async<kBN, kD, kThreads>(sK + (stage ^ 1) * Traits::kSmemKVElems, gK + int64_t(n1) * kv_stride,
                                         kv_stride, p.seqlen_k - n1, p.head_dim, tid);
      load_tile_async<kBN, kD, kThreads>(sV + (stage ^ 1) * Traits::kSmemKVElems, gV + int64_t(n1) * kv_stride,
                                         kv_stride, p.seqlen_k - n1, p.head_dim, tid);
    }
    cp_async_commit();

    // S = Q K^T for this warp's rows x kBN keys; each K fragment feeds kTM MMAs.
    float acc_s[kTM][kNTiles][4];
#pragma unroll
    for (int mi = 0; mi < kTM; ++mi) {
#pragma unroll
      for (int i = 0; i < kNTiles; ++i) acc_s[mi][i][0] = acc_s[mi][i][1] = acc_s[mi][i][2] = acc_s[mi][i][3] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < kD / kMmaK; ++kk) {
      uint32_t a_reg[kTM][4];
#pragma unroll
      for (int mi = 0; mi < kTM; ++mi) {
        if constexpr (Traits::kQInRegs) {
#pragma unroll
          for (int i = 0; i < 4; ++i) a_reg[mi][i] = q_frag[mi][kk][i];
        } else {
          ldmatrix_x4(a_reg[mi], (q_addr ^ (kk * 32)) + mi * kMmaM * kRB);
        }
      }
      const uint32_t k_col = k_stage ^ (kk * 32);
#pragma unroll
      for (int nn = 0; nn < kBN / 16; ++nn) {
        uint32_t b_reg[4];
        ldmatrix_x4(b_reg, k_col + nn * 16 * kRB);
#pragma unroll
        for (int mi = 0; mi < kTM; ++mi) {
          mma_16x8x16<T>(acc_s[mi][2 * nn], a_reg[mi], b_reg[0], b_reg[1]);
          mma_16x8x16<T>(acc_s[mi][2 * nn + 1], a_reg[mi], b_reg[2], b_reg[3]);
        }
      }
    }

    // Soft cap, mask (only m-tiles whose 16 rows do not see the whole key tile), then online softmax: rescale the
    // running state by exp2((old_max - new_max) * scale_log2).
    const int n0 = n_block * kBN;
#pragma unroll
    for (int mi = 0; mi < kTM; ++mi) {
      const int tile_row0 = m0 + warp_row0 + mi * kMmaM;
      if (cap.enabled()) {
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[mi][nt][e] = cap.apply(acc_s[mi][nt][e]);
        }
      }
      if (!mask.tile_fully_visible(tile_row0, tile_row0 + kMmaM, n0, n0 + kBN, p.seqlen_q)) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = tile_row0 + g + 8 * r;
          const int lo = mask.lo(row);
          const int hi = mask.hi(row);
          // With segment ids, ids are tested where the interval lets the pair through (in range there).
          const int32_t id = seg.enabled() ? seg.q_ids[imin(row, p.seqlen_q - 1)] : 0;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = n0 + nt * 8 + 2 * t + e;
              bool shown = col >= lo && col < hi;
              if (seg.enabled()) shown = shown && seg.kv_ids[imin(col, p.seqlen_k - 1)] == id;
              seen[mi][r] |= shown;
              if (!shown) acc_s[mi][nt][2 * r + e] = -INFINITY;
            }
          }
        }
      } else {
        seen[mi][0] = seen[mi][1] = true;
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[mi][r];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          mx = fmaxf(mx, fmaxf(acc_s[mi][nt][2 * r], acc_s[mi][nt][2 * r + 1]));
        }
        mx = quad_max(mx);
        const float max_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
        const float correction = exp2f(row_max[mi][r] * p.scale_log2 - max_scaled);
        row_max[mi][r] = mx;
        row_sum[mi][r] *= correction;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          acc_o[mi][dt][2 * r] *= correction;
          acc_o[mi][dt][2 * r + 1] *= correction;
        }
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = exp2f(acc_s[mi][nt][2 * r + e] * p.scale_log2 - max_scaled);
            acc_s[mi][nt][2 * r + e] = pe;
            row_sum[mi][r] += pe;
          }
        }
      }
    }

    // O += P V, P straight from the S accumulators (their layout is the A-operand layout); each V fragment
    // feeds kTM MMAs.
#pragma unroll
    for (int kk = 0; kk < kBN / kMmaK; ++kk) {
      uint32_t a_reg[kTM][4];
#pragma unroll
      for (int mi = 0; mi < kTM; ++mi) {
        a_reg[mi][0] = ET::pack(acc_s[mi][2 * kk][0], acc_s[mi][2 * kk][1]);
        a_reg[mi][1] = ET::pack(acc_s[mi][2 * kk][2], acc_s[mi][2 * kk][3]);
        a_reg[mi][2] = ET::pack(acc_s[mi][2 * kk + 1][0], acc_s[mi][2 * kk + 1][1]);
        a_reg[mi][3] = ET::pack(acc_s[mi][2 * kk + 1][2], acc_s[mi][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dd = 0; dd < kD / 16; ++dd) {
        uint32_t b_reg[4];
        ldmatrix_x4_trans(b_reg, (v_stage ^ (dd * 32)) + kk * kMmaK * kRB);
#pragma unroll
        for (int mi = 0; mi < kTM; ++mi) {
          mma_16x8x16<T>(acc_o[mi][2 * dd], a_reg[mi], b_reg[0], b_reg[1]);
          mma_16x8x16<T>(acc_o[mi][2 * dd + 1], a_reg[mi], b_reg[2], b_reg[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue: normalise, write O (rows < seqlen_q, columns < head_dim) and the natural-log LSE.
#pragma unroll
  for (int mi = 0; mi < kTM; ++mi) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row0 + mi * kMmaM + g + 8 * r;  // inside the block
      // With segment ids a row may see no key inside its interval: the quad's lanes pool what they saw.
      const bool sees = mask.lo(m0 + row) < mask.hi(m0 + row) && (!seg.enabled() || quad_any(seen[mi][r]));
      const RowFinish f = finish_row(row_max[mi][r], quad_sum(row_sum[mi][r]), p.scale, sees, sink);
      if (row < rows_valid) {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          const int col = dt * 8 + 2 * t;
          if (col < p.head_dim) {
            *reinterpret_cast<uint32_t*>(gO + row * q_stride + col) =
                ET::pack(f.scaled(acc_o[mi][dt][2 * r]), f.scaled(acc_o[mi][dt][2 * r + 1]));
          }
        }
        if (t == 0) gLse[row] = f.lse;
      }
    }
  }
}

}  // namespace jax_flash::cuda
