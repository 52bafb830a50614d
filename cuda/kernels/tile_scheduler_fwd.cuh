// The order in which the sm_90a forward kernel's CTAs take their (query block, query head, batch) tiles.
//
// Work comes in units, in a persistent grid or without a causal mask numbered with the query block fastest
// (heaviest, i.e. last, first) and (batch, head) slowest, so the CTAs running at one time read a few heads' K and V
// and those stay in L2. A persistent grid takes units round-robin (CTA c: units c, c + gridDim.x, ...), which only
// balances if units hold equal work: with a causal mask query block m sees about m + 1 key tiles, so there a unit
// pairs the heaviest and the lightest block of one (batch, head) that are left (blocks m_blocks - 1 - j and j, the
// heavier first). Otherwise a unit is one block. A grid of one CTA per unit under a causal mask (no window) with
// enough query blocks per head takes its units in heaviest-first order across heads (tile_scheduler_common.cuh):
// the hardware hands units to SMs as they free up, so the grid should end on light ones.
#pragma once

#include <climits>
#include <cstdint>

#include "../flash_params.h"
#include "tile_scheduler_common.cuh"

namespace jax_flash::cuda {

struct FwdTile {
  int m_block;  // query block
  int h;        // query head
  int b;        // batch element
};

struct FwdTileScheduler {
  int m_blocks;        // query blocks per (batch, head)
  int units_per_head;  // m_blocks, or ceil(m_blocks / 2) when blocks are paired
  int heads_q;
  int64_t units_wide;  // units_per_head * heads_q * batch; launches refuse counts above INT_MAX (units_fit)
  int units;           // the same as an int, what the kernel walks
  bool paired;
  int group_units;   // a CTA per unit: heavy_first_group_units() (0: heads one after another); persistent: 0
  bool heavy_first;  // group_units > 0: units in HeavyFirstOrder over every (batch, head)

  // The last two parameters are for the CPU check (tests/cpp/tile_scheduler_check.cc).
  JF_HD FwdTileScheduler(const FlashParams& p, int block_m, bool persistent,
                         int group_units_ = kHeavyFirstGroupUnits, int min_blocks = kHeavyFirstMinBlocks)
      : m_blocks(int((p.seqlen_q + block_m - 1) / block_m)),
        units_per_head(persistent && p.causal ? (m_blocks + 1) / 2 : m_blocks),
        heads_q(p.heads_q),
        units_wide(int64_t(units_per_head) * p.heads_q * p.batch),
        units(int(units_wide)),
        paired(persistent && p.causal),
        group_units(persistent ? 0
                               : heavy_first_group_units(m_blocks, p.causal && p.window_left < 0, group_units_,
                                                         min_blocks)),
        heavy_first(group_units > 0) {}

  JF_HD bool units_fit() const { return units_wide <= INT_MAX; }

  // Tiles in unit u: 2 for a pair, 1 for the middle block of an odd count or an unpaired block.
  JF_HD int tiles(int u) const {
    if (!paired) return 1;
    const int j = u % units_per_head;
    return m_blocks - 1 - j == j ? 1 : 2;
  }
  // Tile k (0 or 1) of unit u.
  JF_HD FwdTile tile(int u, int k) const {
    int j = u % units_per_head;
    int hb = u / units_per_head;
    if (heavy_first) HeavyFirstOrder::make(m_blocks, units / m_blocks, group_units).at(u, &j, &hb);
    return FwdTile{k == 0 ? m_blocks - 1 - j : j, hb % heads_q, hb / heads_q};
  }
};

}  // namespace jax_flash::cuda
