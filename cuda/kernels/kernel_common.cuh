// Block bookkeeping shared by every CUDA kernel (sm_80-class and sm_90a): which key tiles a query block needs
// (forward) and which query tiles a key block needs (backward).
#pragma once

#include <cstdint>

#include "../flash_params.h"
#include "../mask.h"

namespace jax_flash::cuda {

// Key tiles [*n_begin, *n_end) of kBlockN keys that rows [m0, m0 + rows) can see (n_end <= n_begin: none).
template <int kBlockN>
__device__ __forceinline__ void key_tiles_for_rows(const AttentionMask& mask, const FlashParams& p, int m0, int rows,
                                                   int* n_begin, int* n_end) {
  int key_begin, key_end;
  mask.key_range(m0, m0 + rows, &key_begin, &key_end);
  *n_begin = imax(key_begin, 0) / kBlockN;
  *n_end = key_end > key_begin ? (imin(key_end, p.seqlen_k) + kBlockN - 1) / kBlockN : *n_begin;
}

// Query tiles of kBlockM rows that can see keys [n0, n0 + kBlockN): m_first and their count (0: none).
template <int kBlockN, int kBlockM>
__device__ __forceinline__ void query_tiles_for_keys(const AttentionMask& mask, const FlashParams& p, int n0,
                                                     int* m_first, int* m_count) {
  int row_begin, row_end;
  mask.row_range(n0, n0 + kBlockN, &row_begin, &row_end);
  row_end = imin(row_end, p.seqlen_q);
  *m_first = imax(row_begin, 0) / kBlockM;
  *m_count = row_end > row_begin ? (row_end + kBlockM - 1) / kBlockM - *m_first : 0;
}

}  // namespace jax_flash::cuda
