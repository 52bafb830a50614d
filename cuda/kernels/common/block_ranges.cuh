// Block bookkeeping shared by every CUDA kernel (sm_80-class and sm_90a): which key tiles a query block needs
// (forward), which query tiles a key block needs (backward), and the zero gradients of a key block no query sees.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash_params.h"
#include "mask.h"

namespace jax_flash::cuda {

// Key tiles [*n_begin, *n_end) of kBlockN keys that rows [m0, m0 + rows) can see (n_end <= n_begin: none). kLanes:
// the threads of a warp that call together pass the same arguments (segment ids' chunks read a chunk per lane).
template <int kBlockN, bool kLanes = false>
__device__ __forceinline__ void key_tiles_for_rows(const AttentionMask& mask, const FlashParams& p, int m0, int rows,
                                                   int* n_begin, int* n_end) {
  int key_begin, key_end;
  mask.template key_range<kLanes>(m0, m0 + rows, &key_begin, &key_end);
  *n_begin = imax(key_begin, 0) / kBlockN;
  *n_end = key_end > key_begin ? (imin(key_end, p.seqlen_k) + kBlockN - 1) / kBlockN : *n_begin;
}

// Query tiles of kBlockM rows that can see keys [n0, n0 + kBlockN): m_first and their count (0: none). kLanes as
// for key_tiles_for_rows.
template <int kBlockN, int kBlockM, bool kLanes = false>
__device__ __forceinline__ void query_tiles_for_keys(const AttentionMask& mask, const FlashParams& p, int n0,
                                                     int* m_first, int* m_count) {
  int row_begin, row_end;
  mask.template row_range<kLanes>(n0, n0 + kBlockN, &row_begin, &row_end);
  row_end = imin(row_end, p.seqlen_q);
  *m_first = imax(row_begin, 0) / kBlockM;
  *m_count = row_end > row_begin ? (row_end + kBlockM - 1) / kBlockM - *m_first : 0;
}

// What a backward CTA owns: key block n_block (kBlockN keys from n0) of key/value head hk, batch b; `keys` of them
// lie below seqlen_k (none for a padding block); row n0 of that head is element `off` of K, V, dK and dV, rows
// `stride` elements apart; dk, dv point at it.
template <typename T>
struct KeyBlock {
  int n0;
  int keys;
  int64_t stride;
  int64_t off;
  T* dk;
  T* dv;
};
template <int kBlockN, typename T>
__device__ __forceinline__ KeyBlock<T> key_block(const FlashParams& p, int n_block, int hk, int b) {
  const int n0 = n_block * kBlockN;
  const int64_t stride = p.kv_row_stride();
  const int64_t off = b * p.kv_batch_stride() + n0 * stride + int64_t(hk) * p.head_dim;
  return {n0, imin(kBlockN, p.seqlen_k - n0), stride, off, static_cast<T*>(p.dk) + off, static_cast<T*>(p.dv) + off};
}

// A backward CTA's iterations: for each of the `group` query heads sharing kv head hk (head-major), the query
// tiles [first, first + count) of kBlockM rows that can see keys [n0, n0 + kKeys). query_tile_walk() is asked by
// every thread of the CTA with the same arguments (key_tiles_for_rows' kLanes).
template <int kBlockM>
struct QueryTileWalk {
  int first;
  int count;
  int group;
  int hk;
  __device__ __forceinline__ int iters() const { return count * group; }
  __device__ __forceinline__ int head(int it) const { return hk * group + it / count; }
  __device__ __forceinline__ int row0(int it) const { return (first + it % count) * kBlockM; }

  // Where an iteration stands (first row and query head), stepped one iteration at a time: what head() and row0()
  // give without their division per iteration.
  struct Position {
    int row0;
    int head;
  };
  __device__ __forceinline__ Position start() const { return {first * kBlockM, hk * group}; }
  __device__ __forceinline__ void advance(Position& pos) const {
    pos.row0 += kBlockM;
    if (pos.row0 == (first + count) * kBlockM) {
      pos.row0 = first * kBlockM;
      ++pos.head;
    }
  }
};
template <int kKeys, int kBlockM>
__device__ __forceinline__ QueryTileWalk<kBlockM> query_tile_walk(const AttentionMask& mask, const FlashParams& p,
                                                                  int n0, int hk) {
  QueryTileWalk<kBlockM> walk{0, 0, p.group_size(), hk};
  query_tiles_for_keys<kKeys, kBlockM, true>(mask, p, n0, &walk.first, &walk.count);
  return walk;
}

// dK = dV = 0 for the first `keys` rows of a key block that no query sees (16-byte stores; head_dim is a multiple
// of 8 16-bit elements), spread over the CTA's kThreads threads.
template <int kThreads, typename T>
__device__ __forceinline__ void zero_kv_grads(T* gdK, T* gdV, int64_t kv_stride, int keys, int head_dim, int tid) {
  constexpr int kElems = 8;  // 16-bit elements per 16-byte store
  for (int c = tid; c < keys * (head_dim / kElems); c += kThreads) {
    const int row = c / (head_dim / kElems);
    const int col = (c % (head_dim / kElems)) * kElems;
    *reinterpret_cast<uint4*>(gdK + row * kv_stride + col) = make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(gdV + row * kv_stride + col) = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace jax_flash::cuda
