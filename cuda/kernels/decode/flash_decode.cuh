// Decode: a few query rows (Tq <= 16) of each sequence against its long key/value cache, dense or paged, at the
// memory-bandwidth limit. Bandwidth-bound, so one design serves sm_80 and sm_90 (mma.sync + cp.async):
//
//   * split-KV: CTA (split, kv head, batch) walks its share of the sequence's keys, so B x Hkv x splits CTAs keep
//     every SM streaming even at batch 1; a combine kernel merges the splits through their log-sum-exps;
//   * the query heads sharing a kv head, times Tq, are packed into the rows of one tile (row r: step t = r / G, head
//     hk G + r % G), so each K/V tile is read once for all of them;
//   * K/V tiles of kBlockN keys stream through a kStages-deep cp.async ring; paged caches resolve each key's
//     page through the page table, whose entries are fetched a tile's compute ahead into shared memory (ids
//     clamped: nothing outside the cache is read, whatever the table holds);
//   * every warp computes: a row tile's keys are sliced across warps (kSlices slices of a tile), each with its own
//     online softmax, merged through shared memory at the end;
//   * masks at positions: row r sits at kv_length - Tq + t (bottom-right causal), windows from there.
//
// Partial results (float32 O normalised by its own sum, and its lse: -inf where the split sees no key of the row) go
// to p.o_partial / p.lse_partial; flash_decode_combine_kernel writes O and lse (with the sink). A row whose visible
// logits are all -inf (infinite inputs) counts as seeing no key here (0, where jax.nn gives nan).
#pragma once

#include <cmath>

#include "flash_params.h"
#include "score_mod.h"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/decode/decode_traits.h"
#include "kernels/sm90/pipeline.h"  // PipelineState: plain ring counting, no sm_90 instructions
#include "kernels/sm80/utils_sm80.cuh"

namespace jax_flash::cuda::decode {

inline constexpr int kElems = 8;  // 16-bit elements per 16-byte chunk

// The rows and key range of one decode call for batch element b (shared by the split kernel and the launcher's
// reasoning): positions of step t are base + t, base = kv_len - Tq; keys [lo, hi) are the ones any row may see.
struct DecodeRange {
  int kv_len;
  int base;
  int lo;
  int hi;
};
__device__ __forceinline__ DecodeRange decode_range(const FlashParams& p, int b) {
  DecodeRange r;
  r.kv_len = min(max(p.kv_lens[b], 0), p.seqlen_k);
  r.base = r.kv_len - p.seqlen_q;
  const int last = r.base + p.seqlen_q - 1;  // the last row's position
  r.lo = p.window_left >= 0 ? max(r.base - p.window_left, 0) : 0;
  r.hi = r.kv_len;
  if (p.causal) r.hi = min(r.hi, last + 1);
  if (p.window_right >= 0) r.hi = min(r.hi, last + p.window_right + 1);
  return r;
}

// The page id of a tile's key i (thread i < kBlockN fetches it): the raw page-table entry, 0 past `hi`.
__device__ __forceinline__ int fetch_page(const FlashParams& p, int b, int key, int hi) {
  if (key >= hi) return 0;
  const int index = p.page_shift >= 0 ? key >> p.page_shift : key / p.page_size;
  return p.page_table[int64_t(b) * p.max_pages + index];
}

// Issues one thread's cp.async copies of K and V for the tile starting at key0 into stage buffers sK, sV: the tile's
// kBlockN x kD elements in 16-byte chunks, chunk c = tid + j kThreads holding key c / (kD / 8). Keys at or past `hi`
// are zero-filled. For a paged cache `pages` (shared memory) holds the page id of each of the tile's keys, clamped
// here into the pool: nothing outside the cache is read, whatever the table holds.
template <typename T, typename Traits>
__device__ __forceinline__ void load_kv_tile(T* sK, T* sV, const int* pages, const FlashParams& p, int b, int hk,
                                             int key0, int hi, int tid) {
  constexpr int kChunksPerRow = Traits::kD / kElems;
  constexpr int kPerThread = Traits::kBlockN * kChunksPerRow / Traits::kThreads;
  static_assert(Traits::kBlockN * kChunksPerRow % Traits::kThreads == 0);
  const int64_t row_stride = int64_t(p.heads_kv) * p.head_dim;
  const T* gK = static_cast<const T*>(p.k) + int64_t(hk) * p.head_dim;
  const T* gV = static_cast<const T*>(p.v) + int64_t(hk) * p.head_dim;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    const int c = tid + j * Traits::kThreads;
    const int i = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * kElems;
    const int key = key0 + i;
    const bool pred = key < hi && col < p.head_dim;
    int64_t row;
    if (p.page_table != nullptr) {
      const int in_page = p.page_shift >= 0 ? key & (p.page_size - 1) : key % p.page_size;
      row = int64_t(min(max(pages[i], 0), p.num_pages - 1)) * p.page_size + in_page;
    } else {
      row = int64_t(b) * p.seqlen_k + key;
    }
    const int64_t off = pred ? row * row_stride + col : 0;
    const uint32_t dst = swz<Traits::kD>(i, col);
    cp_async_16(smem_addr(sK + dst), gK + off, pred);
    cp_async_16(smem_addr(sV + dst), gV + off, pred);
  }
}

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads) flash_decode_split_kernel(const FlashParams p) {
  constexpr int kD = Traits::kD;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kSN = Traits::kSliceN;
  constexpr int kNTiles = kSN / 8;
  constexpr int kDTiles = kD / 8;
  constexpr int kRB = kRowBytes<kD>;
  constexpr int kStages = Traits::kStages;
  using ET = ElemTraits<T>;

  extern __shared__ __align__(1024) unsigned char smem_raw[];  // no static shared memory before it (traits)
  T* sQ = reinterpret_cast<T*>(smem_raw);  // [kRows][kD]
  T* sK = sQ + Traits::kRows * kD;        // [kStages][kBN][kD]
  T* sV = sK + kStages * kBN * kD;        // [kStages][kBN][kD]

  const int split = blockIdx.x;
  const int hk = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  const int group = p.group_size();
  const int rows = group * p.seqlen_q;  // packed rows of this kv head
  const int row_tile = warp / Traits::kSlices;
  const int slice = warp % Traits::kSlices;

  const DecodeRange range = decode_range(p, b);
  const int tiles = range.hi > range.lo ? (range.hi - range.lo + kBN - 1) / kBN : 0;
  const int per_split = (tiles + p.num_splits - 1) / p.num_splits;
  const int tile_begin = split * per_split;
  const int tile_end = min(tiles, tile_begin + per_split);

  // Partial outputs of this split: O [split][b][t][h][d] float32, lse [split][b][h][t].
  const int64_t split_rows = int64_t(p.batch) * p.seqlen_q * p.heads_q;
  auto o_part = [&](int r) {
    const int step = r / group, h = hk * group + r % group;
    return p.o_partial + ((split * split_rows) + (int64_t(b) * p.seqlen_q + step) * p.heads_q + h) * p.head_dim;
  };
  auto lse_part = [&](int r) {
    const int step = r / group, h = hk * group + r % group;
    return p.lse_partial + split * split_rows + (int64_t(b) * p.heads_q + h) * p.seqlen_q + step;
  };
  if (tile_end <= tile_begin) {  // nothing for this split: weight 0 in the combine
    for (int r = tid; r < rows; r += Traits::kThreads) *lse_part(r) = -INFINITY;
    return;
  }

  // Q rows: row r is step r / G of query head hk G + r % G; rows past `rows` zero-filled. (In the first tile's
  // cp.async group: the first wait below covers it.)
  {
    constexpr int kChunksPerRow = kD / kElems;
    const T* q = static_cast<const T*>(p.q);
    for (int c = tid; c < Traits::kRows * kChunksPerRow; c += Traits::kThreads) {
      const int r = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * kElems;
      const bool pred = r < rows && col < p.head_dim;
      const int step = r / group, h = hk * group + r % group;
      const T* src = pred ? q + ((int64_t(b) * p.seqlen_q + step) * p.heads_q + h) * p.head_dim + col : q;
      cp_async_16(smem_addr(sQ + swz<kD>(r, col)), src, pred);
    }
  }
  // Paged caches: the page ids of a tile's keys sit in sPage[its stage] (thread i < kBlockN fetches key i's). The
  // first kStages tiles' are read now; each later tile's are fetched into a register before the compute of the tile
  // kStages - 1 before it and stored after it, so the table's latency hides behind that compute.
  int(*sPage)[kBN] = reinterpret_cast<int(*)[kBN]>(sV + kStages * kBN * kD);  // [kStages][kBN]
  const bool paged = p.page_table != nullptr;
  auto tile_key0 = [&](int tile) { return range.lo + tile * kBN; };
  if (paged && tid < kBN) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) sPage[s][tid] = fetch_page(p, b, tile_key0(tile_begin + s) + tid, range.hi);
  }
  __syncthreads();
  // Prologue: the first kStages - 1 tiles in flight (one cp.async group each, empty past the split's end).
  sm90::PipelineState<kStages> read_state;  // the stage of the tile computed next
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (tile_begin + s < tile_end) {
      load_kv_tile<T, Traits>(sK + s * kBN * kD, sV + s * kBN * kD, sPage[s], p, b, hk, tile_key0(tile_begin + s),
                              range.hi, tid);
    }
    cp_async_commit();
  }
  sm90::PipelineState<kStages> write_state = read_state.ahead(kStages - 1);

  const bool computes = row_tile * 16 < rows && warp < Traits::kRows / 16 * Traits::kSlices;
  const int row0 = row_tile * 16;
  float acc_o[kDTiles][4];
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
#pragma unroll
  for (int i = 0; i < kDTiles; ++i) acc_o[i][0] = acc_o[i][1] = acc_o[i][2] = acc_o[i][3] = 0.f;
  // This thread's two rows: their visible key intervals.
  int lo_r[2], hi_r[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = row0 + g + 8 * rr;
    const int pos = range.base + r / group;
    lo_r[rr] = p.window_left >= 0 ? pos - p.window_left : 0;
    hi_r[rr] = range.kv_len;
    if (p.causal) hi_r[rr] = min(hi_r[rr], pos + 1);
    if (p.window_right >= 0) hi_r[rr] = min(hi_r[rr], pos + p.window_right + 1);
    if (r >= rows) hi_r[rr] = lo_r[rr];  // padding row
  }
  const SoftCap cap(p);

  const uint32_t q_addr = swz_addr<kD>(smem_addr(sQ), row0 + lane % 16, lane / 16);
  const uint32_t k_addr = swz_addr<kD>(smem_addr(sK), (lane % 8) + (lane / 16) * 8, (lane / 8) % 2) +
                          slice * kSN * kRB;
  const uint32_t v_addr = swz_addr<kD>(smem_addr(sV), (lane % 8) + ((lane / 8) % 2) * 8, lane / 16) +
                          slice * kSN * kRB;
  constexpr uint32_t kStageBytes = kBN * kD * 2;

  for (int tile = tile_begin; tile < tile_end; ++tile) {
    cp_async_wait<kStages - 2>();  // this tile's group (and Q) landed
    __syncthreads();               // ... for every thread; and every warp is done with the stage written next
    const int ahead = tile + kStages - 1;
    if (ahead < tile_end) {
      const int w = write_state.slot();
      load_kv_tile<T, Traits>(sK + w * kBN * kD, sV + w * kBN * kD, sPage[w], p, b, hk, tile_key0(ahead), range.hi,
                              tid);
    }
    cp_async_commit();
    write_state.advance();
    const int stage = read_state.slot();
    read_state.advance();
    // The page ids of tile `ahead + 1`, for the stage this tile frees (stored after the compute below).
    const bool stash = paged && tid < kBN && ahead + 1 < tile_end;
    const int next_page = stash ? fetch_page(p, b, tile_key0(ahead + 1) + tid, range.hi) : 0;
    if (computes) {
      const int key0 = tile_key0(tile) + slice * kSN;  // this warp's slice of the tile
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
      // Soft cap, mask, online softmax (as the forward kernels).
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        float mx = row_max[rr];
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            float s = acc_s[nt][2 * rr + e];
            if (cap.enabled()) s = cap.apply(s);
            const int key = key0 + nt * 8 + 2 * t + e;
            s = key >= lo_r[rr] && key < hi_r[rr] ? s : -INFINITY;
            acc_s[nt][2 * rr + e] = s;
            mx = fmaxf(mx, s);
          }
        }
        mx = quad_max(mx);
        const float max_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
        const float correction = exp2f(row_max[rr] * p.scale_log2 - max_scaled);
        row_max[rr] = mx;
        row_sum[rr] *= correction;
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          acc_o[dt][2 * rr] *= correction;
          acc_o[dt][2 * rr + 1] *= correction;
        }
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pe = exp2f(acc_s[nt][2 * rr + e] * p.scale_log2 - max_scaled);
            acc_s[nt][2 * rr + e] = pe;
            row_sum[rr] += pe;
          }
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
    }  // computes
    if (stash) sPage[stage][tid] = next_page;  // published by the next iteration's barrier
  }
  cp_async_wait<0>();
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) row_sum[rr] = quad_sum(row_sum[rr]);

  // Merge the key slices of each row tile (slice 0's warp takes the others' float32 O, max and sum from shared
  // memory, which the K/V stages no longer need).
  if constexpr (Traits::kSlices > 1) {
    __syncthreads();  // every warp is done with the K/V stages
    // Slot of (row tile, slice >= 1): row_tile * (kSlices - 1) + slice - 1.
    float* sO = reinterpret_cast<float*>(sK);                         // [slot][kDTiles][32 lanes][4]
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
#pragma unroll
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

  // This split's rows: O / sum (float32) and lse; -inf for a row that saw no key here (weight 0 in the combine).
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = row0 + g + 8 * rr;
    const float sum = row_sum[rr];
    if (r >= rows) continue;
    const bool some = sum > 0.f || sum != sum;  // nan (a nan or +inf logit) stays nan
    const float inv = some ? 1.f / sum : 0.f;
    float* o = o_part(r);
#pragma unroll
    for (int dt = 0; dt < kDTiles; ++dt) {
      const int col = dt * 8 + 2 * t;
      if (col < p.head_dim) {
        *reinterpret_cast<float2*>(o + col) = make_float2(acc_o[dt][2 * rr] * inv, acc_o[dt][2 * rr + 1] * inv);
      }
    }
    if (t == 0) *lse_part(r) = some ? row_max[rr] * p.scale + logf(sum) : -INFINITY;
  }
}

// One CTA per (batch, step, query head) row: O = sum_s w_s O_s with w_s = exp(lse_s - lse) and lse = log(sum_s
// exp(lse_s) + exp(sink)). Splits are spread over the threads (the weights first, then float4 columns x split
// groups with a shared-memory reduction), so many splits of few rows cost little. A row that no split lets see a
// key: O = 0, lse = +inf (the kernels' convention; jax_flash.decode_attention turns it into -inf or the sink).
inline constexpr int kCombineThreads = 256;
template <typename T>
__global__ void __launch_bounds__(kCombineThreads) flash_decode_combine_kernel(const FlashParams p) {
  __shared__ float s_weight[kMaxDecodeSplits];
  __shared__ float4 s_acc[kCombineThreads];
  __shared__ float s_red[kCombineThreads / kWarpSize];
  const int64_t idx = blockIdx.x;  // ((b * Tq) + step) * Hq + h
  const int h = int(idx % p.heads_q);
  const int step = int(idx / p.heads_q % p.seqlen_q);
  const int b = int(idx / p.heads_q / p.seqlen_q);
  const int tid = threadIdx.x;
  const int64_t split_rows = int64_t(p.batch) * p.seqlen_q * p.heads_q;
  const int64_t lse_off = (int64_t(b) * p.heads_q + h) * p.seqlen_q + step;
  const int splits = p.num_splits;

  // Block-wide max (nan: any split's) and sum.
  auto block_reduce = [&](float v, bool is_max) {
    v = is_max ? warp_max(v) : warp_sum(v);
    __syncthreads();  // s_red free
    if (tid % kWarpSize == 0) s_red[tid / kWarpSize] = v;
    __syncthreads();
    v = s_red[0];
    for (int w = 1; w < kCombineThreads / kWarpSize; ++w) v = is_max ? fmaxf(v, s_red[w]) : v + s_red[w];
    return v;
  };
  float top = -INFINITY, nan_seen = 0.f;
  for (int s = tid; s < splits; s += kCombineThreads) {
    const float l = p.lse_partial[s * split_rows + lse_off];
    s_weight[s] = l;
    top = fmaxf(top, l);
    nan_seen += l != l ? 1.f : 0.f;
  }
  top = block_reduce(top, true);
  const bool any_nan = block_reduce(nan_seen, false) > 0.f;
  const float sink = p.sinks != nullptr ? p.sinks[int64_t(b) * p.heads_q + h] : -INFINITY;
  T* out = static_cast<T*>(p.o) + idx * p.head_dim;
  if (top == -INFINITY && !any_nan) {  // sees no key
    for (int c = tid; c < p.head_dim; c += kCombineThreads) out[c] = T(0.f);
    if (tid == 0) p.lse[lse_off] = INFINITY;
    return;
  }
  const float m = fmaxf(top, sink);
  float part = 0.f;
  for (int s = tid; s < splits; s += kCombineThreads) {
    const float l = s_weight[s];
    const float w = l == -INFINITY ? 0.f : expf(l - m);
    s_weight[s] = w;
    part += w;
  }
  float total = block_reduce(part, false) + (sink == -INFINITY ? 0.f : expf(sink - m));
  if (any_nan) total = NAN;
  const float inv = 1.f / total;
  __syncthreads();  // s_weight holds the unnormalised weights

  // Columns in float4s x groups of splits.
  const int cols = p.head_dim / 4;
  const int groups = kCombineThreads / cols;
  const int col = tid % cols, group = tid / cols;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (group < groups) {
    const float* o = p.o_partial + idx * p.head_dim + col * 4;
#pragma unroll 4
    for (int s = group; s < splits; s += groups) {
      const float w = s_weight[s];
      if (w == 0.f) continue;
      const float4 v = *reinterpret_cast<const float4*>(o + s * split_rows * p.head_dim);
      acc.x += w * v.x;
      acc.y += w * v.y;
      acc.z += w * v.z;
      acc.w += w * v.w;
    }
  }
  s_acc[tid] = acc;
  __syncthreads();
  if (tid < cols) {
    float4 sum = s_acc[tid];
    for (int g = 1; g < groups; ++g) {
      const float4 v = s_acc[g * cols + tid];
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    T* dst = out + tid * 4;
    dst[0] = T(sum.x * inv);
    dst[1] = T(sum.y * inv);
    dst[2] = T(sum.z * inv);
    dst[3] = T(sum.w * inv);
  }
  if (tid == 0) p.lse[lse_off] = m + logf(total);
}

}  // namespace jax_flash::cuda::decode
