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
//
// The last round: with units of equal work (no causal mask, window or segment ids) and r = units mod CTAs left for
// it, the last r units are handed out as k parts each (each part an equal share of the unit's query tiles, k chosen
// for the shortest round: ceil(r k / CTAs) / k of a unit instead of a whole one; at most kMaxParts, and parts of at
// least kMinPartIters query tiles). Each part adds dQ as a unit does; part 0 stores dK and dV and raises its flag,
// the others wait for it and add theirs (the kernel's epilogue).
#pragma once

#include <climits>
#include <cstdint>

#include "flash_params.h"
#if defined(__CUDACC__)
#include "kernels/sm90/work_counter.cuh"  // (device code only: host C++ checks include this file)
#endif

namespace jax_flash::cuda::sm90 {

struct BwdTile {
  int n_block;  // key block
  int hk;       // kv head
  int b;        // batch element
};

// What the producer publishes of each unit for the other roles (the kernel's unit ring): the unit and its walk
// over query tiles (QueryTileWalk's first and count, which it derives from the mask once for all roles).
struct BwdUnitSlot {
  int unit;   // index of the unit or part handed out; >= BwdTileScheduler::units: no unit left
  int first;  // first query tile that sees the key block
  int count;  // query tiles per query head (0: none sees it)
  int lo;     // the walk's iterations this unit or part takes: [lo, lo + n) of count x query heads
  int n;
  int part;   // a split unit's part (0: the first, or a whole unit)
  int flags;  // a split unit's first flag in dq_semaphore (its warpgroup's: + warpgroup), or -1
};

struct BwdTileScheduler {
  static constexpr int kTailWaves = 3;  // units per running CTA that the tail's order spans
  static constexpr int kTailWavesGrouped = 1;  // the same with more than one query head per kv head

  // Parts of a last-round unit (each part past the first adds its dK and dV in the output dtype: one more rounding).
  // 2048 units on 132 CTAs (every 16-head d128 row of the benchmarks) leave 68: k = 3 takes the round to 2/3 of a
  // unit, k = 7 to 4/7.
  static constexpr int kMaxParts = 7;
  // A part's fewest iterations (query tiles x query heads): each part loads K and V and stores or adds dK and dV,
  // which shorter shares would not repay (16 x 1024 x 16 x 128: 16 iterations a unit, 5-6 a part at k = 3: 0.995x
  // in session 56's A/B).
  static constexpr int kMinPartIters = 8;
  static constexpr int kMaxSplitUnits = (kBwdCounterInts - 1) / 2;  // their flags, 2 each, zeroed by the preprocess

  int n_blocks;  // key blocks per (batch, kv head)
  int heads_kv;
  int64_t units_wide;  // n_blocks * heads_kv * batch; launches refuse counts the counter cannot hold (units_fit)
  int groups;          // (batch, kv head)s
  int tail_groups;     // the last ones, whose units go key block slowest (0: none)
  int head_units;      // units before them
  int parts;           // parts of each of the last split_units units (1: none split)
  int split_units;
  int whole;           // units handed out whole, before the parts
  int units;           // indices handed out: whole + split_units * parts, what the kernel walks

  // block_m x block_n: the kernel's tile (query rows x keys); ctas: how many CTAs run at once (the persistent grid);
  // 0 keeps the key-block-fastest order throughout and splits no unit.
  JF_HD BwdTileScheduler(const FlashParams& p, int block_m, int block_n, int ctas = 0)
      : n_blocks(int((p.seqlen_k + block_n - 1) / block_n)),
        heads_kv(p.heads_kv),
        units_wide(int64_t(n_blocks) * p.heads_kv * p.batch),
        groups(p.heads_kv * p.batch),
        tail_groups(p.causal && ctas > 0 && n_blocks > 1
                        ? tail_group_count(groups, n_blocks, ctas,
                                           p.heads_q > p.heads_kv ? kTailWavesGrouped : kTailWaves)
                        : 0),
        head_units((groups - tail_groups) * n_blocks),
        parts(1),
        split_units(0),
        whole(int(units_wide)),
        units(int(units_wide)) {
    // The last round: units of equal work (no causal mask, window or segment ids) split into parts when fewer are
    // left than CTAs run, so that the round ends sooner: k parts of r units take ceil(r k / ctas) / k of a unit's
    // time instead of one (2048 units on 132 CTAs: r = 68, k = 7: 4/7; NOTES.md, sessions 55-56).
    const int64_t left = ctas > 0 && units_wide > ctas ? units_wide % ctas : 0;
    const bool equal_units = !p.causal && p.window_left < 0 && p.window_right < 0 && p.q_segment_ids == nullptr;
    const int64_t flag_ints = p.dq_semaphore_ints();  // the counter, then the flags
    // A unit's iterations: its query tiles times the query heads of its kv head (a batch element's shorter
    // lengths only shorten its walk, and a part past a walk's end takes nothing).
    const int64_t unit_iters = block_m > 0 && p.heads_kv > 0
                                   ? (int64_t(p.seqlen_q) + block_m - 1) / block_m * (p.heads_q / p.heads_kv)
                                   : 0;
    const int64_t max_parts = unit_iters / kMinPartIters < kMaxParts ? unit_iters / kMinPartIters : kMaxParts;
    if (equal_units && left > 0 && left <= kMaxSplitUnits && 1 + 2 * left <= flag_ints) {
      int best = 1;
      int64_t best_rounds = 1;  // cost of k parts: ceil(left k / ctas) / k of a unit; 1 part: 1 / 1
      for (int k = 2; k <= max_parts; ++k) {
        const int64_t rounds = (left * k + ctas - 1) / ctas;
        if (rounds * best < best_rounds * k) {
          best = k;
          best_rounds = rounds;
        }
      }
      if (best > 1) {
        parts = best;
        split_units = int(left);
        whole = int(units_wide - left);
        units = int(whole + left * best);
      }
    }
  }

  // (batch, kv head)s whose units span about `waves` units per running CTA, at most all of them.
  static JF_HD int tail_group_count(int groups, int n_blocks, int ctas, int waves) {
    const int64_t want = (int64_t(waves) * ctas + n_blocks - 1) / n_blocks;
    return want < groups ? int(want) : groups;
  }

  // The indices handed out reach units + grid - 1 (each CTA takes one past the end): room for any grid (splitting
  // adds at most kMaxSplitUnits * (kMaxParts - 1)).
  JF_HD bool units_fit() const { return units_wide <= INT_MAX / 2 - int64_t(kMaxSplitUnits) * kMaxParts; }

  // Whether unit index u means no unit is left (past the end; negative only from a counter nobody zeroed).
  JF_HD bool done(int u) const { return u < 0 || u >= units; }

  // The unit of index u (a part's unit for the last split_units * parts indices).
  JF_HD int unit_of(int u) const { return u < whole ? u : whole + (u - whole) / parts; }
  // Index u's part of its unit (0 of 1 for a whole unit), and a split unit's flag pair after the work counter.
  JF_HD int part_of(int u) const { return u < whole ? 0 : (u - whole) % parts; }
  JF_HD int parts_of(int u) const { return u < whole ? 1 : parts; }
  JF_HD int flags_of(int u) const { return u < whole ? -1 : 1 + 2 * (unit_of(u) - whole); }
  // Part `part` of `parts` of a walk of `total` iterations: an equal share, [*lo, *lo + *n); with fewer iterations
  // than parts, the parts past them take none.
  static JF_HD void part_range(int total, int part, int parts, int* lo, int* n) {
    const int used = total < parts ? total : parts;
    if (part >= used) {
      *lo = 0;
      *n = 0;
      return;
    }
    *lo = int(int64_t(part) * total / used);
    *n = int(int64_t(part + 1) * total / used) - *lo;
  }

  JF_HD BwdTile tile(int index) const {
    const int u = unit_of(index);
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
    if constexpr (kPersistent) return next_counted_unit(k, p.dq_semaphore);
    return k == 0 ? int(blockIdx.x) : units;
  }
#endif
};

}  // namespace jax_flash::cuda::sm90
