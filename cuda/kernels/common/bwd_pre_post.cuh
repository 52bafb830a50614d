// The kernels around every main backward kernel (sm_80-class and sm_90a alike) and the sequence that launches
// them: the row statistics lse * log2(e) and dsum = rowsum(dO * O) with dq_accum = 0 (preprocess), the main
// kernel, dq = scale * dq_accum (conversion).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash_params.h"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/launch_utils.h"
#include "kernels/common/warp_reduce.cuh"

namespace jax_flash::cuda {

inline constexpr int kPreprocessThreads = 256;

// Threads per row of the preprocess: 16-byte loads of 8 elements, 128 columns per pass (two rows per warp).
inline constexpr int kPreprocessLanesPerRow = 16;
inline constexpr int kPreprocessElems = 8;  // 16-bit elements per 16-byte load; head_dim is a multiple of 8
inline constexpr int kPreprocessChunkColumns = kPreprocessLanesPerRow * kPreprocessElems;  // a row's, per chunk
// Query rows per preprocess block: a tile of one (batch, head), kPreprocessThreads / kPreprocessLanesPerRow rows a
// pass (seqlen_q_rounded is a multiple of kRowStatsAlign, so tiles never straddle heads).
inline constexpr int kPreprocessRows = 64;
inline constexpr int kPreprocessPasses = kPreprocessRows * kPreprocessLanesPerRow / kPreprocessThreads;
static_assert(kRowStatsAlign % kPreprocessRows == 0, "preprocess tiles cover the padded rows exactly");

// The row statistics of (b, h, i) for every padded row (seqlen_q_rounded), a block per kPreprocessRows rows of one
// (b, h): lse * log2(e) and dsum = sum_d dO[b, i, h, d] * O[b, i, h, d]; both 0 in the padding rows i >= seqlen_q.
// kPreprocessLanesPerRow threads a row, each thread's kPreprocessPasses rows a pass apart, all their O and dO loads
// issued before any is used; lse read and lse * log2(e) written by one thread a row, coalesced. The block also zeroes
// its rows of the (b, h) dq_accum slab (contiguous; whatever order the main kernel adds in, the rows tile the slab):
// one pass instead of a memset before it. (FlashAttention-3's preprocess has this shape: 5-7 % faster than one row a
// 16-thread group and a block per 16 rows, NOTES, session 54.) Without deterministic dQ, block 0 also zeroes
// dq_semaphore's first kBwdCounterInts ints: the persistent sm_90a backward's work counter and its split units'
// flags (sm90/tile_scheduler_bwd.cuh), unused by the other backward kernels. kChunks: 16-byte loads a row and thread
// (head_dim up to kChunks x 128).
template <typename T, int kChunks>
__global__ void __launch_bounds__(kPreprocessThreads, 2) flash_bwd_preprocess_kernel(const FlashParams p) {
  using ET = ElemTraits<T>;
  constexpr int kLanes = kPreprocessLanesPerRow;
  constexpr int kElems = kPreprocessElems;
  constexpr int kRowsPerPass = kPreprocessThreads / kLanes;
  const int tiles = p.seqlen_q_rounded / kPreprocessRows;
  const int m0 = int(blockIdx.x % tiles) * kPreprocessRows;
  const int h = int(blockIdx.x / tiles % p.heads_q);
  const int b = int(blockIdx.x / tiles / p.heads_q);
  const int t = threadIdx.x;
  const int sub = t % kLanes;
  if (!p.deterministic && p.dq_semaphore != nullptr && blockIdx.x == 0) {
    const int64_t ints = p.dq_semaphore_ints();
    for (int i = t; i < kBwdCounterInts && i < ints; i += kPreprocessThreads) p.dq_semaphore[i] = 0;
  }
  const bool lse_row = t < kPreprocessRows && m0 + t < p.seqlen_q;  // (loaded first: its latency hides below)
  const float lse = lse_row ? p.lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + m0 + t] : 0.f;
  uint4 ov[kPreprocessPasses][kChunks], dv[kPreprocessPasses][kChunks];
#pragma unroll
  for (int k = 0; k < kPreprocessPasses; ++k) {
    const int i = m0 + t / kLanes + k * kRowsPerPass;
    const int64_t off = (int64_t(b) * p.seqlen_q + i) * p.q_row_stride() + int64_t(h) * p.head_dim;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int d = (c * kLanes + sub) * kElems;
      const bool in = i < p.seqlen_q && d < p.head_dim;
      ov[k][c] = in ? *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + off + d) : make_uint4(0, 0, 0, 0);
      dv[k][c] = in ? *reinterpret_cast<const uint4*>(static_cast<const T*>(p.dout) + off + d) : make_uint4(0, 0, 0, 0);
    }
  }
  float4* accum = reinterpret_cast<float4*>(p.dq_accum_of(b, h) + int64_t(m0) * p.head_dim_rounded);
  for (int c = t; c < kPreprocessRows * p.head_dim_rounded / 4; c += kPreprocessThreads) {
    accum[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int k = 0; k < kPreprocessPasses; ++k) {
    float acc = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const uint32_t ow[4] = {ov[k][c].x, ov[k][c].y, ov[k][c].z, ov[k][c].w};
      const uint32_t dw[4] = {dv[k][c].x, dv[k][c].y, dv[k][c].z, dv[k][c].w};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 a = ET::unpack(ow[w]);
        const float2 g = ET::unpack(dw[w]);
        acc += a.x * g.x + a.y * g.y;
      }
    }
#pragma unroll
    for (int lane_mask = kLanes / 2; lane_mask > 0; lane_mask /= 2) {
      acc += __shfl_xor_sync(0xffffffff, acc, lane_mask);
    }
    if (sub == 0) p.dsum_of(b, h)[m0 + t / kLanes + k * kRowsPerPass] = acc;
  }
  if (t < kPreprocessRows) p.lse_log2_of(b, h)[m0 + t] = lse * kLog2e;
}

// The order in which a main kernel adds into a dq_accum slab (FlashParams::dq_accum_of): tiles of kTileRows rows x
// head_dim_rounded columns one after the other, each a sequence of float4 slots; slot `slot` of a tile holds two
// column pairs, (row[k], col[k]) and (row[k], col[k] + 1) for k = 0, 1, which pairs() gives. DqRowMajor: rows of
// head_dim_rounded floats (the sm_80-class kernels); the sm_90a d64/d128 kernel adds in its
// accumulator fragments' order (DqFragmentOrder). An order whose slots hold four scalars instead
// (kScalarElems, DqTransposedFragmentOrder: the d256 redesign's dQ^T, whose pairs run along rows) gives them by
// elems(slot, row[4], col[4]).
struct DqRowMajor {
  static constexpr int kTileRows = 1;
  static constexpr bool kScalarElems = false;
  __device__ __forceinline__ static void pairs(int slot, int (&row)[2], int (&col)[2]) {
    row[0] = row[1] = 0;
    col[0] = 4 * slot;
    col[1] = 4 * slot + 2;
  }
};

// Query rows per block of the conversion: whole tiles of DqOrder, about 32 KB of float32 dQ.
template <typename DqOrder>
__host__ __device__ __forceinline__ int convert_dq_rows(int head_dim_rounded) {
  const int rows = 8192 / head_dim_rounded;
  return rows > DqOrder::kTileRows ? rows : DqOrder::kTileRows;
}
inline constexpr int kConvertPad = 4;  // floats after each shared-memory row (16-byte rows stay aligned)

// dq[b, i, h, d] = scale * dq_accum of (b, h, i, d), a block of convert_dq_rows rows of one (b, h) at a time: the
// block's dq_accum floats are read in their storage order (coalesced float4 loads) into a row-major shared-memory
// tile, then written to dq as 16-byte rows.
template <typename T, typename DqOrder>
__global__ void __launch_bounds__(kPreprocessThreads) flash_bwd_convert_dq_kernel(const FlashParams p) {
  using ET = ElemTraits<T>;
  extern __shared__ float4 convert_smem[];
  float* tile = reinterpret_cast<float*>(convert_smem);  // [rows][head_dim_rounded + kConvertPad]
  const int cols = p.head_dim_rounded;
  const int ld = cols + kConvertPad;
  const int rows = convert_dq_rows<DqOrder>(cols);
  const int blocks_per_slab = p.seqlen_q_rounded / rows;
  const int row0 = int(blockIdx.x % blocks_per_slab) * rows;
  const int h = int(blockIdx.x / blocks_per_slab % p.heads_q);
  const int b = int(blockIdx.x / blocks_per_slab / p.heads_q);
  const float4* src = reinterpret_cast<const float4*>(p.dq_accum_of(b, h) + int64_t(row0) * cols);
  const int slots_per_tile = DqOrder::kTileRows * cols / 4;
  const int slots = rows * cols / 4;
  // kLoads float4 loads in flight per thread before any is stored (a block's 32 KB at once): one at a time, the
  // blocks an SM holds kept ~24 KB in flight and read dq_accum at ~3.3 TB/s, below the HBM peak.
  constexpr int kLoads = 8;
  for (int i0 = threadIdx.x; i0 < slots; i0 += kLoads * kPreprocessThreads) {
    float4 v[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = i0 + k * kPreprocessThreads;
      if (i < slots) v[k] = src[i];
    }
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int i = i0 + k * kPreprocessThreads;
      if (i >= slots) break;
      const int tile_row0 = i / slots_per_tile * DqOrder::kTileRows;
      if constexpr (DqOrder::kScalarElems) {  // (scalar stores: a warp's rows g and columns 2 t differ by bank)
        int row[4], col[4];
        DqOrder::elems(i % slots_per_tile, row, col);
        const float x[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int e = 0; e < 4; ++e) tile[(tile_row0 + row[e]) * ld + col[e]] = x[e];
      } else {
        int row[2], col[2];
        DqOrder::pairs(i % slots_per_tile, row, col);
        *reinterpret_cast<float2*>(tile + (tile_row0 + row[0]) * ld + col[0]) = make_float2(v[k].x, v[k].y);
        *reinterpret_cast<float2*>(tile + (tile_row0 + row[1]) * ld + col[1]) = make_float2(v[k].z, v[k].w);
      }
    }
  }
  __syncthreads();
  constexpr int kChunk = 8;  // elements per 16-byte store; head_dim is a multiple of 8
  const int chunks = p.head_dim / kChunk;
  T* dq = static_cast<T*>(p.dq) + b * p.q_batch_stride() + int64_t(h) * p.head_dim;
  for (int i = threadIdx.x; i < rows * chunks; i += kPreprocessThreads) {
    const int r = i / chunks;
    const int c = i % chunks * kChunk;
    if (row0 + r >= p.seqlen_q) continue;
    const float4 lo = *reinterpret_cast<const float4*>(tile + r * ld + c);
    const float4 hi = *reinterpret_cast<const float4*>(tile + r * ld + c + 4);
    const float s = p.scale;
    *reinterpret_cast<uint4*>(dq + (row0 + r) * p.q_row_stride() + c) =
        make_uint4(ET::pack(lo.x * s, lo.y * s), ET::pack(lo.z * s, lo.w * s), ET::pack(hi.x * s, hi.y * s),
                   ET::pack(hi.z * s, hi.w * s));
  }
}

// The backward sequence every main backward kernel shares: the row statistics and dq_accum = 0, the main kernel
// (launch_main(), which returns its launch error; skipped without keys; it adds into dq_accum in DqOrder),
// dq = scale * dq_accum.
template <typename T, typename DqOrder, typename LaunchMain>
cudaError_t launch_bwd_sequence(const FlashParams& p, cudaStream_t stream, LaunchMain&& launch_main) {
  const int64_t q_elems = int64_t(p.batch) * p.seqlen_q * p.heads_q * p.head_dim;
  if (p.deterministic) {
    const size_t stat_elems = size_t(p.batch) * p.heads_q * p.seqlen_q;
    if (cudaError_t e = cudaMemsetAsync(p.dq_semaphore, 0, stat_elems * sizeof(int32_t), stream); e != cudaSuccess) {
      return e;
    }
  }
  if (q_elems > 0) {
    const int64_t blocks = int64_t(p.batch) * p.heads_q * (p.seqlen_q_rounded / kPreprocessRows);
    if (blocks > INT32_MAX || p.seqlen_q_rounded % kPreprocessRows != 0) return cudaErrorInvalidConfiguration;
    if (p.head_dim <= kPreprocessChunkColumns) {
      flash_bwd_preprocess_kernel<T, 1><<<unsigned(blocks), kPreprocessThreads, 0, stream>>>(p);
    } else if (p.head_dim <= 2 * kPreprocessChunkColumns) {
      flash_bwd_preprocess_kernel<T, 2><<<unsigned(blocks), kPreprocessThreads, 0, stream>>>(p);
    } else {
      return cudaErrorInvalidValue;  // (the handlers allow head dims up to 256)
    }
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (p.seqlen_k > 0) {
    if (cudaError_t e = launch_main(); e != cudaSuccess) return e;
  }
  if (q_elems > 0) {
    const int rows = convert_dq_rows<DqOrder>(p.head_dim_rounded);
    const size_t smem = size_t(rows) * (p.head_dim_rounded + kConvertPad) * sizeof(float);
    const int64_t blocks = int64_t(p.batch) * p.heads_q * (p.seqlen_q_rounded / rows);
    if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
    if (smem > 48 * 1024) {  // (DqTransposedFragmentOrder's 64 rows of 256 columns: 66560 bytes)
      if (cudaError_t e = ensure_smem_limit<flash_bwd_convert_dq_kernel<T, DqOrder>>(int(smem)); e != cudaSuccess) {
        return e;
      }
    }
    flash_bwd_convert_dq_kernel<T, DqOrder><<<unsigned(blocks), kPreprocessThreads, smem, stream>>>(p);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace jax_flash::cuda
