// The combine kernels of split-KV decode: they merge the split kernels' partial results (per split and packed row:
// float32 O normalised by its own sum, and its lse, -inf where the split saw no key of the row) into O and lse.
// For each (batch, step, query head) row: O = sum_s w_s O_s with w_s = exp(lse_s - lse) and lse = log(sum_s
// exp(lse_s) + exp(sink)); a nan lse of any split makes the row nan; a row that no split lets see a key gets O = 0,
// lse = +inf (the kernels' convention; jax_flash.decode_attention turns it into -inf or the sink). Which kernel runs
// is launch_decode_combine's choice (launch_decode.cuh).
#pragma once

#include <cmath>

#include "flash_params.h"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/decode/decode_traits.h"

namespace jax_flash::cuda::decode {

// A row's split weights, computed by one warp from the splits' lse (at most kCombineWarpSplits splits: lane l holds
// splits l and l + 32): w_s = exp(lse_s - m), 0 for a split that saw no key of the row, m = max(lse_s, sink), total =
// sum_s w_s + exp(sink - m), nan when any split's lse is nan (fmaxf skips nan: it is counted apart). `none`: no split
// saw a key and none is nan (the row outputs 0, lse +inf). Every lane gets every value but the weights, which are
// read by shuffles that every lane of the warp must reach.
struct SplitWeights {
  float w[2];  // this lane's splits' weights
  float m;
  float total;
  bool none;
  // The weight of split s, s the same in every lane: one shuffle.
  __device__ __forceinline__ float weight(int s) const {
    return __shfl_sync(0xffffffff, s < kWarpSize ? w[0] : w[1], s % kWarpSize);
  }
  // The same where s may differ between lanes: two shuffles.
  __device__ __forceinline__ float weight_of_any(int s) const {
    const float lo = __shfl_sync(0xffffffff, w[0], s % kWarpSize);
    const float hi = __shfl_sync(0xffffffff, w[1], s % kWarpSize);
    return s < kWarpSize ? lo : hi;
  }
};
__device__ __forceinline__ SplitWeights warp_split_weights(const FlashParams& p, int64_t lse_off, int64_t split_rows,
                                                           int lane, float sink) {
  float l[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int s = lane + i * kWarpSize;
    l[i] = s < p.num_splits ? p.lse_partial[s * split_rows + lse_off] : -INFINITY;
  }
  const float top = warp_max(fmaxf(l[0], l[1]));
  const bool any_nan = __any_sync(0xffffffff, l[0] != l[0] || l[1] != l[1]);
  SplitWeights r;
  r.none = top == -INFINITY && !any_nan;
  r.m = fmaxf(top, sink);
#pragma unroll
  for (int i = 0; i < 2; ++i) r.w[i] = l[i] == -INFINITY ? 0.f : expf(l[i] - r.m);
  r.total = warp_sum(r.w[0] + r.w[1]) + (sink == -INFINITY ? 0.f : expf(sink - r.m));
  if (any_nan) r.total = NAN;
  return r;
}

// At least kCombineWarpMinRows rows of at most kCombineWarpSplits splits each (many rows of a few splits: batches,
// Tq > 1): a warp per row, so that a block of kCombineWarpsPerBlock warps merges that many rows. Lane l holds the lse (then the weight) of splits l and
// l + 32; the column loop takes each split's weight from its lane by a shuffle, and a lane adds one float4 column
// of every split (columns l, l + 32 for head dims past 128; lanes past head_dim / 4 only take part in the
// shuffles). No shared memory and no block barrier.
inline constexpr int kCombineWarpSplits = 2 * kWarpSize;
inline constexpr int kCombineWarpMinRows = 1024;  // fewer rows: the block kernel spreads each row's splits wider
inline constexpr int kCombineWarpsPerBlock = 8;
template <typename T>
__global__ void __launch_bounds__(kCombineWarpsPerBlock * kWarpSize) flash_decode_combine_warp_kernel(
    const FlashParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t split_rows = int64_t(p.batch) * p.seqlen_q * p.heads_q;
  const int64_t idx = int64_t(blockIdx.x) * kCombineWarpsPerBlock + threadIdx.x / kWarpSize;  // ((b Tq) + step) Hq + h
  if (idx >= split_rows) return;  // whole warps only
  const int h = int(idx % p.heads_q);
  const int step = int(idx / p.heads_q % p.seqlen_q);
  const int b = int(idx / p.heads_q / p.seqlen_q);
  const int64_t lse_off = (int64_t(b) * p.heads_q + h) * p.seqlen_q + step;
  const int splits = p.num_splits;

  const float sink = p.sinks != nullptr ? p.sinks[int64_t(b) * p.heads_q + h] : -INFINITY;
  const SplitWeights sw = warp_split_weights(p, lse_off, split_rows, lane, sink);
  T* out = static_cast<T*>(p.o) + idx * p.head_dim;
  const int cols = p.head_dim / 4;
  if (sw.none) {  // sees no key
    for (int c = lane; c < cols; c += kWarpSize) {
      *reinterpret_cast<uint2*>(out + 4 * c) = make_uint2(ElemTraits<T>::pack(0.f, 0.f), ElemTraits<T>::pack(0.f, 0.f));
    }
    if (lane == 0) p.lse[lse_off] = INFINITY;
    return;
  }
  const float inv = 1.f / sw.total;

  for (int c0 = 0; c0 < cols; c0 += kWarpSize) {  // every lane runs every iteration: the shuffles need the warp
    const int c = c0 + lane;
    const bool mine = c < cols;  // head dims under 128 leave lanes without a column
    const float* o = p.o_partial + idx * p.head_dim + 4 * (mine ? c : 0);
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < splits; ++s) {
      const float ws = sw.weight(s);  // one value, every lane
      if (ws == 0.f || !mine) continue;  // a split that saw no key of the row (its partial O is not written)
      const float4 v = *reinterpret_cast<const float4*>(o + s * split_rows * p.head_dim);
      acc.x += ws * v.x;
      acc.y += ws * v.y;
      acc.z += ws * v.z;
      acc.w += ws * v.w;
    }
    if (mine) {
      *reinterpret_cast<uint2*>(out + 4 * c) =
          make_uint2(ElemTraits<T>::pack(acc.x * inv, acc.y * inv), ElemTraits<T>::pack(acc.z * inv, acc.w * inv));
    }
  }
  if (lane == 0) p.lse[lse_off] = sw.m + logf(sw.total);
}

// Otherwise (few rows, or many splits: one sequence over the whole GPU): a block per row and chunk of its columns
// (gridDim.y chunks of float4 columns, so that a few rows still spread over many SMs: 8 rows at 256 splits read 1 MB
// of partials, which 8 blocks took 7.4 us to stream on an H200 and 64 take ~1). Every chunk's block computes the
// row's weights (one lse per split); its splits are spread over the threads (float4 columns x split groups, then a
// shared-memory tree over the groups), so many splits of few rows cost little. Chunk 0 writes the lse.
// Up to kCombineWarpSplits splits, every warp computes the weights itself (warp_split_weights: shuffles, no
// block-wide reduction), and without a balanced grid (whose empty splits leave their partials unwritten: reading them
// would fetch bytes nobody wrote) a thread's partial loads, up to kCombinePrefetch, are issued before the weights are
// known, so that their latency and the lse loads' overlap. (8/1 x 128 at 8 x 32768, 64 rows of 33 splits, in the
// benchmark's graph on an H200: 4.5 us a call with three block-wide reductions in a row before the partial loads,
// 3.6 us this way; cuDNN's reduction 3.0; NOTES.md, sessions 56-57.)
inline constexpr int kCombineThreads = 256;
inline constexpr int kCombineSerialGroups = 16;
inline constexpr int kCombinePrefetch = 8;
// At least 4 blocks an SM (64 registers a thread): with the thread count alone ptxas held the kernel to 32 registers
// (eight blocks an SM) and spilled one.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads, 4) flash_decode_combine_kernel(const FlashParams p) {
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
  // This block's float4 columns: [col0, col0 + chunk_cols) of the row's cols.
  const int cols = p.head_dim / 4;
  const int chunk_cols_max = (cols + int(gridDim.y) - 1) / int(gridDim.y);
  const int col0 = int(blockIdx.y) * chunk_cols_max;
  const int chunk_cols = min(chunk_cols_max, cols - col0);
  if (chunk_cols <= 0) return;  // whole block (the launcher's chunk count divides evenly; a guard all the same)
  const float sink = p.sinks != nullptr ? p.sinks[int64_t(b) * p.heads_q + h] : -INFINITY;
  T* out = static_cast<T*>(p.o) + idx * p.head_dim;
  auto write_zeros = [&] {  // a row that sees no key
    for (int c = 4 * col0 + tid; c < 4 * (col0 + chunk_cols); c += kCombineThreads) out[c] = T(0.f);
    if (tid == 0 && blockIdx.y == 0) p.lse[lse_off] = INFINITY;
  };

  // This chunk's columns in float4s x groups of splits: thread (col, group) adds splits group, group + groups, ...
  const int groups = kCombineThreads / chunk_cols;
  const int col = tid % chunk_cols, group = tid / chunk_cols;
  const float* o = p.o_partial + idx * p.head_dim + (col0 + col) * 4;
  auto partial = [&](int s) { return *reinterpret_cast<const float4*>(o + s * split_rows * p.head_dim); };
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  auto add = [&](float w, const float4& v) {
    acc.x += w * v.x;
    acc.y += w * v.y;
    acc.z += w * v.z;
    acc.w += w * v.w;
  };
  float m, total;
  if (splits <= kCombineWarpSplits) {
    // Every thread runs `trips` steps (the shuffles need whole warps); with whole warps of one group (chunks of
    // whole warps' columns) a step's split is the same in every lane of a warp.
    const int trips = (splits + groups - 1) / groups;
    const bool warp_one_group = chunk_cols % kWarpSize == 0;
    auto mine = [&](int s) { return group < groups && s < splits; };
    const bool prefetch = !p.balance_splits && trips <= kCombinePrefetch;
    float4 v[kCombinePrefetch];
    if (prefetch) {
#pragma unroll
      for (int k = 0; k < kCombinePrefetch; ++k) {
        if (k < trips && mine(group + k * groups)) v[k] = partial(group + k * groups);
      }
    }
    const SplitWeights sw = warp_split_weights(p, lse_off, split_rows, tid % kWarpSize, sink);
    if (sw.none) {  // every warp finds the same: the whole block leaves
      write_zeros();
      return;
    }
    auto weight = [&](int s) { return warp_one_group ? sw.weight(s) : sw.weight_of_any(s); };
    if (prefetch) {
#pragma unroll
      for (int k = 0; k < kCombinePrefetch; ++k) {
        if (k >= trips) break;
        const int s = group + k * groups;
        const float w = weight(s);
        if (mine(s) && w != 0.f) add(w, v[k]);  // w 0: a split that saw no key of the row (its partial unwritten)
      }
    } else {
#pragma unroll 4
      for (int k = 0; k < trips; ++k) {
        const int s = group + k * groups;
        const float w = weight(s);
        if (mine(s) && w != 0.f) add(w, partial(s));
      }
    }
    m = sw.m;
    total = sw.total;
  } else {
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
    if (top == -INFINITY && !any_nan) {
      write_zeros();
      return;
    }
    m = fmaxf(top, sink);
    float part = 0.f;
    for (int s = tid; s < splits; s += kCombineThreads) {
      const float l = s_weight[s];
      const float w = l == -INFINITY ? 0.f : expf(l - m);
      s_weight[s] = w;
      part += w;
    }
    total = block_reduce(part, false) + (sink == -INFINITY ? 0.f : expf(sink - m));
    if (any_nan) total = NAN;
    __syncthreads();  // s_weight holds the unnormalised weights
    if (group < groups) {
#pragma unroll 4
      for (int s = group; s < splits; s += groups) {
        const float w = s_weight[s];
        if (w != 0.f) add(w, partial(s));  // w 0: a split that saw no key of the row (its partial unwritten)
      }
    }
  }
  const float inv = 1.f / total;

  s_acc[tid] = acc;
  // The groups' sums: one thread per column adds them in turn (up to kCombineSerialGroups: one chunk at head dims
  // from 64), or a shared-memory tree (group g adds group g + half while groups remain; any group count) for the
  // many groups of narrow chunks and of head dims under 64.
  if (groups > kCombineSerialGroups) {
    for (int n = groups; n > 1;) {
      const int half = (n + 1) / 2;
      __syncthreads();
      if (group < n - half) {
        const float4 v = s_acc[(group + half) * chunk_cols + col];
        float4& a = s_acc[tid];
        a.x += v.x;
        a.y += v.y;
        a.z += v.z;
        a.w += v.w;
      }
      n = half;
    }
  }
  __syncthreads();
  if (tid < chunk_cols) {
    float4 sum = s_acc[tid];
    for (int g = 1; groups <= kCombineSerialGroups && g < groups; ++g) {
      const float4 v = s_acc[g * chunk_cols + tid];
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    T* dst = out + (col0 + tid) * 4;
    dst[0] = T(sum.x * inv);
    dst[1] = T(sum.y * inv);
    dst[2] = T(sum.z * inv);
    dst[3] = T(sum.w * inv);
  }
  if (tid == 0 && blockIdx.y == 0) p.lse[lse_off] = m + logf(total);
}

// Column chunks of the block kernel for `rows` rows of head_dim / 4 float4 columns and `splits` splits: halved
// while the grid has fewer than kCombineMinBlocks blocks (two per SM of an H100/H200), a chunk keeps at least 4 float4
// columns (64 bytes) and each thread at least kCombineMinLoads partial loads (below that the extra blocks' weight
// set-up costs more than the loads' latency saves: on an H200, 8 rows of 256 splits 7.4 -> ~5 us with 8 chunks,
// 64 rows of 66 splits ~0.8 us slower), and the count divides the columns evenly.
inline constexpr int kCombineMinBlocks = 264;
inline constexpr int kCombineMinLoads = 4;
inline int CombineChunks(int64_t rows, int head_dim, int splits) {
  const int cols = head_dim / 4;
  int chunks = 1;
  auto halves = [&](int next) {  // `next` chunks still meet every condition
    const int chunk_cols = cols / next;
    return cols % next == 0 && chunk_cols >= 4 &&
           int64_t(splits) * chunk_cols >= int64_t(kCombineMinLoads) * kCombineThreads;
  };
  while (rows * chunks < kCombineMinBlocks && halves(2 * chunks)) chunks *= 2;
  return chunks;
}

}  // namespace jax_flash::cuda::decode
