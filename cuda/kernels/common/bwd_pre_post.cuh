// The kernels around every main backward kernel (sm_80-class and sm_90a alike) and the sequence that launches
// them: dq_accum = 0, the row statistics lse * log2(e) and dsum = rowsum(dO * O) (preprocess), the main kernel,
// dq = scale * dq_accum (conversion).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash_params.h"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/launch_utils.h"
#include "kernels/common/warp_reduce.cuh"

namespace jax_flash::cuda {

inline constexpr int kPreprocessThreads = 256;

// One warp per (row, head) of the padded rows (seqlen_q_rounded): the row statistics of (b, h, i), lse * log2(e)
// and dsum = sum_d dO[b, i, h, d] * O[b, i, h, d]; both 0 in the padding rows i >= seqlen_q.
template <typename T>
__global__ void __launch_bounds__(kPreprocessThreads) flash_bwd_preprocess_kernel(const FlashParams p) {
  using ET = ElemTraits<T>;
  const int64_t rows = int64_t(p.batch) * p.seqlen_q_rounded * p.heads_q;  // flattened [b, i, h]
  const int64_t warp_id = (int64_t(blockIdx.x) * kPreprocessThreads + threadIdx.x) / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  if (warp_id >= rows) return;
  const int h = int(warp_id % p.heads_q);
  const int64_t bi = warp_id / p.heads_q;
  const int i = int(bi % p.seqlen_q_rounded);
  const int b = int(bi / p.seqlen_q_rounded);
  float acc = 0.f;
  float lse_log2 = 0.f;
  if (i < p.seqlen_q) {
    const int64_t off = (int64_t(b) * p.seqlen_q + i) * p.q_row_stride() + int64_t(h) * p.head_dim;
    const T* o = static_cast<const T*>(p.o) + off;
    const T* dout = static_cast<const T*>(p.dout) + off;
    for (int d = 2 * lane; d < p.head_dim; d += 2 * kWarpSize) {
      const float2 a = ET::unpack(*reinterpret_cast<const uint32_t*>(o + d));
      const float2 c = ET::unpack(*reinterpret_cast<const uint32_t*>(dout + d));
      acc += a.x * c.x + a.y * c.y;
    }
#pragma unroll
    for (int lane_mask = kWarpSize / 2; lane_mask > 0; lane_mask /= 2) {
      acc += __shfl_xor_sync(0xffffffff, acc, lane_mask);
    }
    lse_log2 = p.lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + i] * kLog2e;
  }
  if (lane == 0) {
    p.lse_log2_of(b, h)[i] = lse_log2;
    p.dsum_of(b, h)[i] = acc;
  }
}

// The order in which a main kernel adds into a dq_accum slab (FlashParams::dq_accum_of), as tiles of kTileRows rows x
// head_dim_rounded columns, one after the other; offset(row, col) is where (row, col) of a tile lies in it (col
// even: col and col + 1 are adjacent). DqRowMajor: rows of head_dim_rounded floats (the sm_80-class and the
// split-head-dim kernels); the sm_90a d64/d128 kernel's order is its accumulator fragments' (DqFragmentOrder).
struct DqRowMajor {
  static constexpr int kTileRows = 1;
  __device__ __forceinline__ static int offset(int /*row*/, int col) { return col; }
};

// One thread per pair of columns of dq: dq[b, i, h, d] = scale * dq_accum (in DqOrder) of (b, h, i, d).
template <typename T, typename DqOrder>
__global__ void __launch_bounds__(kPreprocessThreads) flash_bwd_convert_dq_kernel(const FlashParams p) {
  using ET = ElemTraits<T>;
  const int64_t pairs = int64_t(p.batch) * p.seqlen_q * p.heads_q * p.head_dim / 2;
  const int64_t i = int64_t(blockIdx.x) * kPreprocessThreads + threadIdx.x;
  if (i >= pairs) return;
  const int pairs_per_row = p.head_dim / 2;
  const int d = int(i % pairs_per_row) * 2;
  const int64_t bih = i / pairs_per_row;  // flattened [b, i, h]
  const int h = int(bih % p.heads_q);
  const int row = int(bih / p.heads_q % p.seqlen_q);
  const int b = int(bih / p.heads_q / p.seqlen_q);
  const int tile_row0 = row / DqOrder::kTileRows * DqOrder::kTileRows;
  const float* tile = p.dq_accum_of(b, h) + int64_t(tile_row0) * p.head_dim_rounded;
  const float2 v = *reinterpret_cast<const float2*>(tile + DqOrder::offset(row - tile_row0, d));
  reinterpret_cast<uint32_t*>(p.dq)[i] = ET::pack(v.x * p.scale, v.y * p.scale);
}

// The backward sequence every main backward kernel shares: dq_accum = 0, the row statistics, the main kernel
// (launch_main(), which returns its launch error; skipped without keys; it adds into dq_accum in DqOrder),
// dq = scale * dq_accum.
template <typename T, typename DqOrder, typename LaunchMain>
cudaError_t launch_bwd_sequence(const FlashParams& p, cudaStream_t stream, LaunchMain&& launch_main) {
  const int64_t q_elems = int64_t(p.batch) * p.seqlen_q * p.heads_q * p.head_dim;
  const int64_t accum_elems = int64_t(p.batch) * p.heads_q * p.seqlen_q_rounded * p.head_dim_rounded;
  if (cudaError_t e = cudaMemsetAsync(p.dq_accum, 0, accum_elems * sizeof(float), stream); e != cudaSuccess) {
    return e;
  }
  if (p.deterministic) {
    const size_t stat_elems = size_t(p.batch) * p.heads_q * p.seqlen_q;
    if (cudaError_t e = cudaMemsetAsync(p.dq_semaphore, 0, stat_elems * sizeof(int32_t), stream); e != cudaSuccess) {
      return e;
    }
  }
  if (q_elems > 0) {
    const int64_t rows = int64_t(p.batch) * p.seqlen_q_rounded * p.heads_q;
    flash_bwd_preprocess_kernel<T><<<ceil_div(rows * kWarpSize, kPreprocessThreads), kPreprocessThreads, 0, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (p.seqlen_k > 0) {
    if (cudaError_t e = launch_main(); e != cudaSuccess) return e;
  }
  if (q_elems > 0) {
    flash_bwd_convert_dq_kernel<T, DqOrder>
        <<<ceil_div(q_elems / 2, kPreprocessThreads), kPreprocessThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

}  // namespace jax_flash::cuda
