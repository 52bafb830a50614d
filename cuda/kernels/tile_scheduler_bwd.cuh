// The order in which the sm_90a backward kernels' CTAs take their (key block, kv head, batch) work.
//
// One CTA per key block of one (batch, kv head) on a 1-D grid in heaviest-first order (tile_scheduler_common.cuh):
// under a causal mask a (batch, kv head)'s first key blocks are the heaviest (the most query tiles see them, and
// with GQA each CTA walks the tiles of all `group` query heads sharing its kv head). Heads are grouped only under
// a causal mask without a window and with enough key blocks per head (heavy_first_group_units); otherwise the
// (batch, kv head) pairs come one after another, key blocks in increasing order. kCluster consecutive CTAs are
// neighbouring key blocks of one (batch, kv head) (the head-dim-256 kernel's pairs), and a key block's lower
// neighbours always start before it (the deterministic dQ order relies on that).
#pragma once

#include <climits>
#include <cstdint>

#include "../flash_params.h"
#include "tile_scheduler_common.cuh"

namespace jax_flash::cuda {

// The grid of a backward launch whose key blocks hold block_n keys; kCluster CTAs per cluster.
template <int kCluster>
struct BwdGrid {
  int64_t key_blocks;  // a multiple of kCluster: a block past seqlen_k loads zeros, sees no query, writes nothing
  int heads_kv;
  int batch;
  int group_units;  // HeavyFirstOrder's, over clusters
  // The last two parameters are for the CPU check (tests/cpp/tile_scheduler_bwd_check.cc).
  JF_HD static BwdGrid make(const FlashParams& p, int block_n, int group_units = kHeavyFirstGroupUnits,
                            int min_blocks = kHeavyFirstMinBlocks) {
    const int64_t blocks = (int64_t(p.seqlen_k) + block_n - 1) / block_n;
    const int64_t clusters = (blocks + kCluster - 1) / kCluster;
    const bool work_falls = p.causal && p.window_left < 0;
    return {clusters * kCluster, p.heads_kv, p.batch,
            heavy_first_group_units(clusters > INT_MAX ? INT_MAX : int(clusters), work_falls, group_units,
                                    min_blocks)};
  }
  JF_HD int64_t ctas() const { return key_blocks * heads_kv * batch; }
  JF_HD bool fits() const { return ctas() <= INT_MAX; }  // gridDim.x limit; launches refuse larger grids
  // CTA `id`'s key block, kv head and batch element (a grid that fits: every value is an int).
  JF_HD void coord(int id, int* n_block, int* hk, int* b) const {
    int cluster, head;
    HeavyFirstOrder::make(int(key_blocks / kCluster), heads_kv * batch, group_units)
        .at(id / kCluster, &cluster, &head);
    *n_block = cluster * kCluster + id % kCluster;
    *hk = head % heads_kv;
    *b = head / heads_kv;
  }
};

}  // namespace jax_flash::cuda
