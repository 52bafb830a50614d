// The order in which the sm_90a backward kernel (head dims 64 and 128) takes its (key block, kv head, batch) units.
//
// Units are numbered with the key block fastest, as the CTA-per-unit grid of before ran them: the key blocks of one
// (batch, kv head) run at the same time on neighbouring SMs, so its query tiles, which every one of them walks, stay
// in L2 (a heavy-first order across heads measured no gain here and cost L2 hits; NOTES.md, "Scheduling").
//
// The grid is persistent (one CTA an SM) and its CTAs take units dynamically: unit c first, then the next one of a
// counter (the first int of FlashParams::dq_semaphore, which only ordered dQ additions use; the preprocess zeroes it)
// each time they finish one. That is the order and the balance in which the hardware dispatched the CTA-per-unit
// grid (the units' work varies under a causal mask or with segment ids, so a static round-robin would not balance).
// What persistence buys: the next unit's K, V and first query tiles load while the last unit's dK and dV are
// stored, the CTA's set-up is paid once, and the dQ reductions and dK/dV stores complete in the background instead
// of holding the CTA's exit. Deterministic dQ keeps one CTA per unit (its ordered reductions then follow the
// hardware's dispatch order).
#pragma once

#include <climits>
#include <cstdint>

#include "flash_params.h"

namespace jax_flash::cuda::sm90 {

struct BwdTile {
  int n_block;  // key block
  int hk;       // kv head
  int b;        // batch element
};

// What the producer publishes of each unit for the other roles (the kernel's unit ring): the unit and its walk
// over query tiles (QueryTileWalk's first and count, which it derives from the mask once for all roles).
struct BwdUnitSlot {
  int unit;   // >= BwdTileScheduler::units: no unit left
  int first;  // first query tile that sees the key block
  int count;  // query tiles per query head (0: none sees it)
};

struct BwdTileScheduler {
  int n_blocks;  // key blocks per (batch, kv head)
  int heads_kv;
  int64_t units_wide;  // n_blocks * heads_kv * batch; launches refuse counts the counter cannot hold (units_fit)
  int units;           // the same as an int, what the kernel walks

  JF_HD BwdTileScheduler(const FlashParams& p, int block_n)
      : n_blocks(int((p.seqlen_k + block_n - 1) / block_n)),
        heads_kv(p.heads_kv),
        units_wide(int64_t(n_blocks) * p.heads_kv * p.batch),
        units(int(units_wide)) {}

  // The units handed out reach units + grid - 1 (each CTA takes one past the end): room for any grid.
  JF_HD bool units_fit() const { return units_wide <= INT_MAX / 2; }

  // Whether unit index u means no unit is left (past the end; negative only from a counter nobody zeroed).
  JF_HD bool done(int u) const { return u < 0 || u >= units; }

  JF_HD BwdTile tile(int u) const {
    const int hb = u / n_blocks;
    return BwdTile{u - hb * n_blocks, hb % heads_kv, hb / heads_kv};
  }

#if defined(__CUDACC__)
  // The CTA's k-th unit (k = 0, 1, ...): done() when there is none left. One thread asks, once per k.
  // The counter must start at 0 (the preprocess of launch_bwd_sequence zeroes it): a kernel launched on its own, or
  // timed again without the preprocess, would find the previous call's count and leave units undone.
  template <bool kPersistent>
  __device__ __forceinline__ int next_unit(const FlashParams& p, int k) const {
    if (k == 0) return int(blockIdx.x);
    if constexpr (kPersistent) return int(gridDim.x) + atomicAdd(p.dq_semaphore, 1);
    return units;
  }
#endif
};

}  // namespace jax_flash::cuda::sm90
