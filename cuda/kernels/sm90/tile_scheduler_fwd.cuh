// The order in which the sm_90a forward kernel's CTAs take their (query block, query head, batch) tiles.
//
// Work comes in units, in a persistent grid or without a causal mask numbered with the query block fastest
// (heaviest, i.e. last, first) and (batch, head) slowest, so the CTAs running at one time read a few heads' K and V
// and those stay in L2. A persistent grid takes units round-robin (CTA c: units c, c + gridDim.x, ...), which only
// balances if units hold equal work: with a causal mask query block m sees about m + 1 key tiles, so there a unit
// pairs the heaviest and the lightest block of one (batch, head) that are left (blocks m_blocks - 1 - j and j, the
// heavier first). Otherwise a unit is one block. A grid of one CTA per unit under a causal mask (no window) with
// enough query blocks per head, or a grid taking such units from a work counter (the kernel's kWorkCounter), takes
// them in heaviest-first order across heads (HeavyFirstOrder below).
#pragma once

#include <climits>
#include <cstdint>

#include "flash_params.h"

namespace jax_flash::cuda {

// Heaviest-first order for the grids of one CTA per unit (the head-dim-256 forward) and those that take such units
// from a work counter (the capped d128 forward's causal calls): the hardware starts CTAs in increasing linear order
// on whichever SM frees up first, and a counter hands out units in that order to whichever CTA asks first, so a grid
// ends well when its last units are its lightest. Units are (block, head) pairs whose work falls with the block rank
// (rank 0 is the heaviest block of every head under a causal mask). Heads come in groups; inside a group the rank
// varies slowest, so each group starts all its heads' heavy blocks before any light one. One group spanning every
// head would be the ideal order, but the CTAs running together would then each read a different head's K/V and fewer
// of those reads would hit in L2; groups of about kHeavyFirstGroupUnits units keep a few heads per wave, and the first
// group takes the remainder so the last is whole and fills the final waves heaviest first (tools/schedule_model.py
// models the tail). A group is cut further to the query heads whose K and V fit in kHeavyFirstGroupKvBytes
// (heavy_first_kv_units): 512 units of the d256 tiles at 4096 rows are 16 heads, 64 MB of K and V without GQA, more
// than the L2, and of the capped d128 tiles 24 heads, 48 MB. Measured (H200, NOTES session 62), 16 MiB groups
// against 512 units: the d256 causal forward x1.029-1.037 (4 x 4096 x 8, 2 x 8192 x 16; two runs), the capped causal
// d128 forward at 4 x 4096 x 16 level to +3 %; GQA 32/8, whose 512 units read 12 MB, keeps them (a 176-unit group
// there: 1 % slower).
//
// Grouping only pays where a head has many blocks of falling work; heavy_first_group_units() gives one head per
// group (the heads one after another, each heaviest block first) otherwise: with few blocks per head a group spans
// so many heads that their K/V no longer stay in L2, which cost more than the order gained. The backward grids keep
// their plain order: this one measured no gain there. (Measurements: NOTES.md, "Scheduling".)
inline constexpr int kHeavyFirstGroupUnits = 512;  // about four waves of 132 SMs
inline constexpr int kHeavyFirstMinBlocks = 16;    // blocks per head below which heads are not grouped (above)
inline constexpr int64_t kHeavyFirstGroupKvBytes = int64_t(16) << 20;  // K and V a group reads: a third of the L2

// group_units cut to the units of the query heads whose K and V (2-byte elements) fit kHeavyFirstGroupKvBytes, all
// the query heads of a kv head together, one kv head's at the least; group_units as it is where p gives no key shape
// (the CPU check's calls).
JF_HD int heavy_first_kv_units(const FlashParams& p, int blocks, int group_units) {
  const int64_t kv_head_bytes = int64_t(p.seqlen_k) * p.head_dim * 2 * 2;
  if (kv_head_bytes <= 0 || p.heads_kv <= 0 || p.heads_q < p.heads_kv) return group_units;
  const int64_t kv_heads = kHeavyFirstGroupKvBytes / kv_head_bytes;
  const int64_t units = (kv_heads > 1 ? kv_heads : 1) * (p.heads_q / p.heads_kv) * blocks;
  return units < group_units ? int(units) : group_units;
}

// HeavyFirstOrder's group size in units for heads of `blocks` blocks: group_units where the work falls with the
// block rank (a causal mask without a window) and a head has at least min_blocks blocks, else 0 (one head per
// group). The last two parameters are for the CPU check.
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

// A persistent grid's walk over its units, in rounds of `ctas` consecutive units: CTA c takes unit k * ctas + c of
// round k, or with kSkew unit k * ctas + (c + k) mod ctas. Without a mask a head's blocks hold equal work but for its
// short last block, which the order numbers first; where the blocks per head divide the grid the plain walk hands every
// head's short block to the same CTAs (16 x 1024 x 16 in 192-row blocks: 6 a head on 132 CTAs, so CTAs 0, 6, ... take
// only short blocks and most others 12 whole ones, where an even share is 10.34). The skewed walk moves each CTA one
// place on a round, which spreads the short blocks over the CTAs while each round still runs the same consecutive
// units (the same few heads' K and V in L2) and a CTA's units still rise: a unit of round k + 1 lies past every unit
// of round k. tools/schedule_model.py rows models both.
template <bool kSkew>
struct PersistentWalk {
  int ctas;
  int cta;
  int u;    // this round's unit
  int off;  // its place in the round (kSkew only)

  JF_HD PersistentWalk(int cta_, int ctas_) : ctas(ctas_), cta(cta_), u(cta_), off(cta_) {}
  JF_HD void advance() {
    if constexpr (kSkew) {
      const int next = off + 1 == ctas ? 0 : off + 1;
      u += ctas - off + next;
      off = next;
    } else {
      u += ctas;
    }
  }
  // On to this CTA's first unit at or after `first`, or to `units` if it has none left.
  JF_HD void skip_to(int64_t first, int units) {
    int64_t v;
    if constexpr (kSkew) {
      const int64_t k = first / ctas;
      int64_t o = (cta + k) % ctas;
      v = k * ctas + o;
      if (v < first) {
        o = o + 1 == ctas ? 0 : o + 1;
        v = (k + 1) * ctas + o;
      }
      off = int(o);
    } else {
      v = first + ((int64_t(cta) - first) % ctas + ctas) % ctas;
    }
    u = int(v < units ? v : units);
  }
};

struct FwdTile {
  int m_block;  // query block
  int h;        // query head
  int b;        // batch element
};

struct FwdTileScheduler {
  int m_blocks;        // query blocks per (batch, head)
  int units_per_head;  // m_blocks, or ceil(m_blocks / 2) when blocks are paired
  int heads_q;
  int64_t units_wide;  // units_per_head * heads_q * batch; launches refuse counts above INT_MAX / 2 (units_fit)
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
                               : heavy_first_group_units(m_blocks, p.causal && p.window_left < 0,
                                                         heavy_first_kv_units(p, m_blocks, group_units_),
                                                         min_blocks)),
        heavy_first(group_units > 0) {}

  // A persistent walk's next unit and a work counter's next index run up to a grid's width past the last unit: int
  // holds them with this bound (any grid far narrower than INT_MAX / 2).
  JF_HD bool units_fit() const { return units_wide <= INT_MAX / 2; }

  // Without the heavy-first order (every persistent grid) units run batch-major: batch element b holds units
  // [b * units_per_batch(), (b + 1) * units_per_batch()).
  JF_HD int units_per_batch() const { return units_per_head * heads_q; }
  JF_HD int batch_of(int u) const { return u / units_per_batch(); }

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
