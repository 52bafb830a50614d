// Heaviest-first work order for grids of one CTA per unit of work, shared by the forward and backward schedulers.
//
// The hardware starts CTAs in increasing linear order on whichever SM frees up first, so a grid ends well when its
// last CTAs are its lightest. Units here are (block, head) pairs whose work falls with the block index (rank 0 is
// the heaviest block of every head under a causal mask). Heads come in groups; inside a group the block index
// varies slowest, so each group starts all its heads' heavy blocks before any light one. One group spanning every
// head would be the ideal order, but the CTAs running together would then each read a different head's operands
// (K/V in the forward, Q/dO in the backward) and fewer of those reads would hit in L2; groups of about
// kHeavyFirstGroupUnits units keep a few heads per wave, and the first group takes the remainder so the last is
// whole and fills the final waves heaviest first (benchmarks/schedule_model.py models the tail).
//
// Grouping across heads only pays where a head has many blocks of falling work; heavy_first_group_units() gives
// one head per group (the heads one after another, each heaviest block first) otherwise. Measured on the H100
// (session 10 A/B, groups of 512 units for every shape): causal 1x8192x32/8 d128 backward +4 %, 4x4096x8 d256
// forward +3.6 %, but 16x1024x8 d256 (8 query tiles, 8 key-block pairs per head) forward -23 % and backward -11 %,
// 32x512x32 d64 (4 key blocks) backward -9 %, and unmasked backwards -1 to -2 %: with few blocks per head a group
// spans so many heads that their operands no longer stay in L2, and without a causal mask nothing falls.
#pragma once

#include "../flash_params.h"

namespace jax_flash::cuda {

inline constexpr int kHeavyFirstGroupUnits = 512;  // about four waves of 132 SMs
inline constexpr int kHeavyFirstMinBlocks = 16;    // blocks per head below which heads are not grouped (above)

// HeavyFirstOrder's group size in units for heads of `blocks` blocks: group_units where the work falls with the
// block rank (a causal mask without a window) and a head has at least min_blocks blocks, else 0 (one head per
// group). The parameters after the first two are for the CPU checks.
JF_HD int heavy_first_group_units(int blocks, bool work_falls, int group_units = kHeavyFirstGroupUnits,
                                  int min_blocks = kHeavyFirstMinBlocks) {
  return work_falls && blocks >= min_blocks ? group_units : 0;
}

struct HeavyFirstOrder {
  int blocks;  // per head
  int heads;
  int group;   // heads per group (the first group: heads % group of them, or a whole group)

  // blocks >= 1 and heads >= 1 (the launchers run no grid without work), so group >= 1; group_units 0 gives 1.
  JF_HD static HeavyFirstOrder make(int blocks, int heads, int group_units = kHeavyFirstGroupUnits) {
    const int per_group = blocks > 0 ? (group_units + blocks - 1) / blocks : 1;
    return {blocks, heads, per_group < 1 ? 1 : per_group > heads ? heads : per_group};
  }
  // Unit u (< blocks * heads) is block rank *block (0: heaviest) of head *head.
  JF_HD void at(int u, int* block, int* head) const {
    const int first = heads % group != 0 ? heads % group : group;
    int size = first, base = 0, r = u;
    if (u >= first * blocks) {
      const int v = u - first * blocks;
      const int g = v / (group * blocks);
      r = v - g * group * blocks;
      size = group;
      base = first + g * group;
    }
    *block = r / size;
    *head = base + r % size;
  }
};

}  // namespace jax_flash::cuda
