// The order in which the sm_90a backward kernel (head dims 64 and 128) takes its (key block, kv head, batch) units.
//
// Units are numbered with the key block fastest, as the CTA-per-unit grid of before ran them: the key blocks of one
// (batch, kv head) run at the same time on neighbouring SMs, so its query tiles, which every one of them walks, stay
// in L2 (a heavy-first order across all heads measured no gain here and cost L2 hits; NOTES.md, "Scheduling").
//
// Under a causal mask, except in the tail: a key block's work falls with its index (it sees fewer query tiles), so
// the last (batch, kv head)'s heaviest key blocks used to start when little else was left, and the SMs that took
// them ran on alone (Nsight Compute, 4 x 4096 x 16 x 128 causal: SMs active 93.5 % of the kernel's time against
// FlashAttention-3's 98 %; NOTES.md, session 27). The last tail_groups (batch, kv head)s, about kTailWaves units per
// CTA that runs at once, take their units key block slowest instead: every one of their heavy blocks before any
// light one (list scheduling of the unit lengths: 4-27 % over the ideal makespan -> 0.3-3 %, tools/schedule_model.py).
// Each (batch, kv head)'s key blocks still start in increasing order. With grouped query heads a unit walks every
// query head of its kv head, so a tail group's key blocks read the group's Q, dO and dQ accumulators several times
// over: three waves of such groups at once passed the L2 (2 x 8192 x 32/8 causal: DRAM read 5 GB against
// FlashAttention-3's 0.74), and their tail spans one wave (kTailWavesGrouped; NOTES.md, session 33).
//
// The grid is persistent (one CTA an SM) and its CTAs take units dynamically: unit c first, then the next one of a
// counter (the first int of FlashParams::dq_semaphore, which only ordered dQ additions use; the preprocess zeroes it)
// each time they finish one. That is the order and the balance in which the hardware dispatched the CTA-per-unit
// grid (the units' work varies under a causal mask or with segment ids, so a static round-robin would not balance).
// What persistence buys: the next unit's K, V and first query tiles load while the last unit's dK and dV are
// stored, the CTA's set-up is paid once, and the dQ reductions and dK/dV stores complete in the background instead
// of holding the CTA's exit. Deterministic dQ keeps one CTA per unit (its ordered reductions then follow the
// hardware's dispatch order) and the key-block-fastest order throughout.
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
  static constexpr int kTailWaves = 3;  // units per running CTA that the tail's order spans
  static constexpr int kTailWavesGrouped = 1;  // the same with more than one query head per kv head

  int n_blocks;  // key blocks per (batch, kv head)
  int heads_kv;
  int64_t units_wide;  // n_blocks * heads_kv * batch; launches refuse counts the counter cannot hold (units_fit)
  int units;           // the same as an int, what the kernel walks
  int groups;          // (batch, kv head)s
  int tail_groups;     // the last ones, whose units go key block slowest (0: none)
  int head_units;      // units before them

  // ctas: how many CTAs run at once (the persistent grid); 0 keeps the key-block-fastest order throughout.
  JF_HD BwdTileScheduler(const FlashParams& p, int block_n, int ctas = 0)
      : n_blocks(int((p.seqlen_k + block_n - 1) / block_n)),
        heads_kv(p.heads_kv),
        units_wide(int64_t(n_blocks) * p.heads_kv * p.batch),
        units(int(units_wide)),
        groups(p.heads_kv * p.batch),
        tail_groups(p.causal && ctas > 0 && n_blocks > 1
                        ? tail_group_count(groups, n_blocks, ctas,
                                           p.heads_q > p.heads_kv ? kTailWavesGrouped : kTailWaves)
                        : 0),
        head_units((groups - tail_groups) * n_blocks) {}

  // (batch, kv head)s whose units span about `waves` units per running CTA, at most all of them.
  static JF_HD int tail_group_count(int groups, int n_blocks, int ctas, int waves) {
    const int64_t want = (int64_t(waves) * ctas + n_blocks - 1) / n_blocks;
    return want < groups ? int(want) : groups;
  }

  // The units handed out reach units + grid - 1 (each CTA takes one past the end): room for any grid.
  JF_HD bool units_fit() const { return units_wide <= INT_MAX / 2; }

  // Whether unit index u means no unit is left (past the end; negative only from a counter nobody zeroed).
  JF_HD bool done(int u) const { return u < 0 || u >= units; }

  JF_HD BwdTile tile(int u) const {
    int hb, n_block;
    if (u < head_units) {  // key block fastest
      hb = u / n_blocks;
      n_block = u - hb * n_blocks;
    } else {  // the tail: key block slowest
      const int v = u - head_units;
      n_block = v / tail_groups;
      hb = groups - tail_groups + (v - n_block * tail_groups);
    }
    return BwdTile{n_block, hb % heads_kv, hb / heads_kv};
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
