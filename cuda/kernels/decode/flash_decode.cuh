// Decode: a few query rows (Tq <= 16) of each sequence against its long key/value cache, dense or paged, at the
// memory-bandwidth limit. This file's split kernel (mma.sync + cp.async) runs on every GPU; on sm_90a calls of more
// than 32 packed rows at head dims up to 128 run sm90/flash_decode_wgmma_sm90.cuh's instead (same design, wgmma for
// the products). The design (the shared parts in split_mainloop.cuh):
//
//   * split-KV: CTA (split, kv head, batch) walks its share of the sequence's keys, so B x Hkv x splits CTAs keep
//     every SM streaming even at batch 1; a combine kernel merges the splits through their log-sum-exps;
//   * the query heads sharing a kv head, times Tq, are packed into the rows of one tile (row r: step t = r / G, head
//     hk G + r % G), so each K/V tile is read once for all of them;
//   * K/V tiles of kBlockN keys stream through a kStages-deep cp.async ring; paged caches resolve each key's
//     pool row through the page table (ids clamped: nothing outside the cache is read, whatever the table holds)
//     a tile's compute ahead, into shared memory;
//   * every warp computes: a row tile's keys are sliced across warps (kSlices slices of a tile), each with its own
//     online softmax, merged through shared memory at the end;
//   * masks at positions: row r sits at kv_length - Tq + t (bottom-right causal), windows from there.
//
// Partial results (float32 O normalised by its own sum, and its lse: -inf where the split sees no key of the row) go
// to p.o_partial / p.lse_partial; a combine kernel (combine.cuh) writes O and lse (with the sink). With one split the
// split kernel writes O and lse itself and no combine runs (many sequences: the combine and the partials' float32
// traffic would cost more than the attention there). A row whose visible logits are all -inf (infinite inputs)
// counts as seeing no key here (0, where jax.nn gives nan).
#pragma once

#include <cmath>

#include "flash_params.h"
#include "score_mod.h"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/decode/decode_traits.h"
#include "kernels/decode/split_mainloop.cuh"
#include "kernels/sm80/utils_sm80.cuh"

namespace jax_flash::cuda::decode {

// Tiles of the mma.sync split kernel (decode_traits.h has the host-visible choices): row tiles of 16 packed rows,
// a tile's keys sliced across warps, the sm_80-class swizzle (swz) for every operand.
template <int kHeadDim, int kRowTiles>
struct DecodeTraits {
  static constexpr int kD = kHeadDim;
  static constexpr int kBlockN = BlockN(kHeadDim);          // keys per K/V tile
  static constexpr int kStages = decode::kStages;           // K/V tiles in flight (cp.async groups)
  static constexpr int kRows = kRowTiles * 16;              // packed query rows per CTA
  static constexpr int kWarps = Warps(kHeadDim, kRowTiles);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kSlices = Slices(kHeadDim, kRowTiles);  // key slices per row tile (one warp each)
  static constexpr int kSliceN = kBlockN / kSlices;             // keys per slice
  static_assert(kSliceN % 16 == 0 && kRowTiles * kSlices <= kWarps);
  // Slices 1.. of each row tile leave their float32 partial O and (max, sum) in shared memory for slice 0 to merge,
  // reusing the K/V stages.
  static constexpr int kMergeSlots = kRowTiles * (kSlices - 1);
  static_assert(kMergeSlots * 32 * (kD / 8 * 4 + 4) * 4 <= 2 * kStages * kBlockN * kD * 2);
  __device__ __forceinline__ static int q_offset(int r, int col) { return swz<kD>(r, col); }
  __device__ __forceinline__ static int kv_offset(int key, int col) { return swz<kD>(key, col); }
  __device__ __forceinline__ static void tile_landed() {}
  static constexpr int kReadLag = 0;  // a tile's compute is done with its stage when it returns
  static constexpr bool kPagedKvEvictFirst = true;  // (split_mainloop.cuh's KVTileLoader)
};
static_assert(SmemBytes(256, 8) == SplitSmem<__half, DecodeTraits<256, 8>>::kBytes &&
              SmemBytes(64, 1) == SplitSmem<__half, DecodeTraits<64, 1>>::kBytes);

// kPaged: the call has a page table; kSoftCap: a logit soft cap (its tanh compiled in only then).
template <typename T, typename Traits, bool kPaged, bool kSoftCap>
__global__ void __launch_bounds__(Traits::kThreads) flash_decode_split_kernel(const FlashParams p) {
  constexpr int kD = Traits::kD;
  constexpr int kSN = Traits::kSliceN;
  constexpr int kNTiles = kSN / 8;
  constexpr int kDTiles = kD / 8;
  constexpr int kRB = kRowBytes<kD>;
  using ET = ElemTraits<T>;

  extern __shared__ __align__(1024) unsigned char smem_raw[];  // no static shared memory before it (SplitSmem)
  const SplitSmem<T, Traits> smem(smem_raw);

  const int split = blockIdx.x;
  const int hk = blockIdx.y;
  const int tid = threadIdx.x;
  // the K ring is free until the stream starts
  const int b = batch_element<Traits::kBlockN, Traits::kThreads>(p, blockIdx.z, reinterpret_cast<int*>(smem.k), tid);
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  const int group = p.group_size();
  const int rows = group * p.seqlen_q;  // packed rows of this kv head
  const int row_tile = warp / Traits::kSlices;
  const int slice = warp % Traits::kSlices;

  const DecodeRange range = decode_range(p, b);
  const SplitTiles tiles = split_tiles<Traits::kBlockN, Traits::kThreads>(p, range, split, smem.pool_row[0], tid);
  if (tiles.end <= tiles.begin) {
    mark_split_empty<T>(p, split, b, hk, 0, rows, tid, Traits::kThreads);
    return;
  }

  const bool computes = row_tile * 16 < rows && warp < Traits::kRows / 16 * Traits::kSlices;
  const int row0 = row_tile * 16;
  float acc_o[kDTiles][4];
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < kDTiles; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  int lo_r[2], hi_r[2];  // this thread's two rows' visible keys
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) row_keys(p, range, row0 + g + 8 * rr, group, rows, &lo_r[rr], &hi_r[rr]);
  const SoftCap cap(p);

  const uint32_t q_addr = swz_addr<kD>(smem_addr(smem.q), row0 + lane % 16, lane / 16);
  const uint32_t k_addr = swz_addr<kD>(smem_addr(smem.k), (lane % 8) + (lane / 16) * 8, (lane / 8) % 2) +
                          slice * kSN * kRB;
  const uint32_t v_addr = swz_addr<kD>(smem_addr(smem.v), (lane % 8) + ((lane / 8) % 2) * 8, lane / 16) +
                          slice * kSN * kRB;
  constexpr uint32_t kStageBytes = Traits::kBlockN * kD * 2;

  stream_split<T, Traits, kPaged>(p, range, tiles, b, hk, 0, rows, smem, tid, [&](int stage, int tile_key0) {
    if (!computes) return;
    const int key0 = tile_key0 + slice * kSN;  // this warp's slice of the tile
    float acc_s[kNTiles][4];
#pragma unroll
    for (int i = 0; i < kNTiles; ++i) acc_s[i][0] = acc_s[i][1] = acc_s[i][2] = acc_s[i][3] = 0.f;
    const uint32_t k_stage = k_addr + stage * kStageBytes;
#pragma unroll
    for (int kk = 0; kk < kD / 16; ++kk) {
      uint32_t a_reg[4];
      ldmatrix_x4(a_reg, q_addr ^ (kk * 32));
#pragma unroll
      for (int nn = 0; nn < kSN / 16; ++nn) {
        uint32_t b_reg[4];
        ldmatrix_x4(b_reg, (k_stage ^ (kk * 32)) + nn * 16 * kRB);
        mma_16x8x16<T>(acc_s[2 * nn], a_reg, b_reg[0], b_reg[1]);
        mma_16x8x16<T>(acc_s[2 * nn + 1], a_reg, b_reg[2], b_reg[3]);
      }
    }
    float correction[2];
    softmax_tile<kNTiles, kSoftCap>(&acc_s[0][0], key0, t, lo_r, hi_r, cap, p.scale_log2, row_max, row_sum,
                                    correction);
    if (warp_rows_rescale(correction)) {
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_o[dt][e] *= correction[e / 2];
      }
    }
    // O += P V over this warp's slice of keys.
    const uint32_t v_stage = v_addr + stage * kStageBytes;
#pragma unroll
    for (int kk = 0; kk < kSN / 16; ++kk) {
      uint32_t a_reg[4];
      a_reg[0] = ET::pack(acc_s[2 * kk][0], acc_s[2 * kk][1]);
      a_reg[1] = ET::pack(acc_s[2 * kk][2], acc_s[2 * kk][3]);
      a_reg[2] = ET::pack(acc_s[2 * kk + 1][0], acc_s[2 * kk + 1][1]);
      a_reg[3] = ET::pack(acc_s[2 * kk + 1][2], acc_s[2 * kk + 1][3]);
#pragma unroll
      for (int dd = 0; dd < kD / 16; ++dd) {
        uint32_t b_reg[4];
        ldmatrix_x4_trans(b_reg, (v_stage ^ (dd * 32)) + kk * 16 * kRB);
        mma_16x8x16<T>(acc_o[2 * dd], a_reg, b_reg[0], b_reg[1]);
        mma_16x8x16<T>(acc_o[2 * dd + 1], a_reg, b_reg[2], b_reg[3]);
      }
    }
  });
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) row_sum[rr] = quad_sum(row_sum[rr]);

  // Merge the key slices of each row tile (slice 0's warp takes the others' float32 O, max and sum from shared
  // memory, which the K/V stages no longer need).
  if constexpr (Traits::kSlices > 1) {
    __syncthreads();  // every warp is done with the K/V stages
    // Slot of (row tile, slice >= 1): row_tile * (kSlices - 1) + slice - 1.
    float* sO = reinterpret_cast<float*>(smem.k);                    // [slot][kDTiles][32 lanes][4]
    float* sStat = sO + Traits::kMergeSlots * kDTiles * kWarpSize * 4;  // [slot][32 lanes][max0, max1, sum0, sum1]
    const int slot0 = row_tile * (Traits::kSlices - 1) - 1;           // + slice
    if (computes && slice != 0) {
      const int w = slot0 + slice;
      float* o = sO + w * kDTiles * kWarpSize * 4;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        *reinterpret_cast<float4*>(o + (dt * kWarpSize + lane) * 4) =
            make_float4(acc_o[dt][0], acc_o[dt][1], acc_o[dt][2], acc_o[dt][3]);
      }
      *reinterpret_cast<float4*>(sStat + (w * kWarpSize + lane) * 4) =
          make_float4(row_max[0], row_max[1], row_sum[0], row_sum[1]);
    }
    __syncthreads();
    if (!computes || slice != 0) return;
    // Not unrolled over the slices: this code runs once per block, after the stream, and its instructions are
    // fetched cold then (NOTES, session 68: the unrolled merge and stores waited on instruction fetches).
#pragma unroll 1
    for (int s = 1; s < Traits::kSlices; ++s) {
      const int w = slot0 + s;
      const float4 st = *reinterpret_cast<const float4*>(sStat + (w * kWarpSize + lane) * 4);
      const float other_max[2] = {st.x, st.y};
      const float other_sum[2] = {st.z, st.w};
      float mine_scale[2], other_scale[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const float m = fmaxf(row_max[rr], other_max[rr]);
        const float m_scaled = m == -INFINITY ? 0.f : m * p.scale_log2;
        mine_scale[rr] = exp2f(row_max[rr] * p.scale_log2 - m_scaled);
        other_scale[rr] = exp2f(other_max[rr] * p.scale_log2 - m_scaled);
        row_max[rr] = m;
        row_sum[rr] = row_sum[rr] * mine_scale[rr] + other_sum[rr] * other_scale[rr];
      }
      const float* o = sO + w * kDTiles * kWarpSize * 4;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        const float4 v = *reinterpret_cast<const float4*>(o + (dt * kWarpSize + lane) * 4);
        acc_o[dt][0] = acc_o[dt][0] * mine_scale[0] + v.x * other_scale[0];
        acc_o[dt][1] = acc_o[dt][1] * mine_scale[0] + v.y * other_scale[0];
        acc_o[dt][2] = acc_o[dt][2] * mine_scale[1] + v.z * other_scale[1];
        acc_o[dt][3] = acc_o[dt][3] * mine_scale[1] + v.w * other_scale[1];
      }
    }
  }
  if (!computes) return;
  store_split_rows<T, kDTiles>(p, split, b, hk, rows, row0, g, t, &acc_o[0][0], row_max, row_sum);
}

}  // namespace jax_flash::cuda::decode
