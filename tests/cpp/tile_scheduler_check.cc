// Check of cuda/kernels/sm90/tile_scheduler_fwd.cuh on the CPU, for small shapes and group sizes. HeavyFirstOrder:
// every (block, head) exactly once; heads in contiguous groups, the last one whole; inside a group no unit is lighter
// (higher block rank) than a later one. FwdTileScheduler: walking every unit visits each (query block, head, batch)
// tile exactly once, a paired unit holds its (batch, head)'s heaviest remaining block first, a grid of one CTA per unit
// under a causal mask without a window and with min_blocks query blocks or more takes its units in HeavyFirstOrder (in
// groups cut to the query heads whose K and V fit kHeavyFirstGroupKvBytes) while any other grid of one CTA per unit
// takes the heads one after another, and units_fit() refuses unit counts above INT_MAX / 2. PersistentWalk, plain and
// skewed: CTA c takes unit r * ctas + c of round r, or (c + r) mod ctas into it when skewed, so the CTAs' walks take
// every unit exactly once, and skip_to goes to the CTA's first unit at or after its argument (the end if none), from
// where the walk goes on as from its start. BwdTileScheduler
// (tile_scheduler_bwd.cuh): its units are every (key block, kv head, batch) exactly once, the key block fastest, except
// under a causal mask with running CTAs given: then the last tail_groups (batch, kv head)s (about kTailWaves units per
// CTA, at most all) come last with the key block slowest; each (batch, kv head)'s key blocks in increasing order either
// way; units_fit() refuses counts the work counter could overflow. Its last round: with units of equal work and running
// CTAs given, the last units mod CTAs units are handed out as 2 to kMaxParts parts each, the fewest that end the round
// soonest with shares of at least kMinPartIters iterations (every index once: whole units one part, split units each
// part once, their flags in range), and part_range splits a walk into ordered, disjoint shares that cover it. Prints
// "ok <cases>" or the first failures; exit 1 on any. Built and run by tests/test_tile_scheduler.py.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <vector>

#include "kernels/sm90/tile_scheduler_bwd.cuh"
#include "kernels/sm90/tile_scheduler_fwd.cuh"

using jax_flash::FlashParams;
using jax_flash::cuda::FwdTile;
using jax_flash::cuda::FwdTileScheduler;
using jax_flash::cuda::HeavyFirstOrder;
using jax_flash::cuda::PersistentWalk;
using jax_flash::cuda::sm90::BwdTile;
using jax_flash::cuda::sm90::BwdTileScheduler;

// The backward's units for small shapes: each (key block, kv head, batch) once, in key-block-fastest order but for
// a causal call's tail.
long check_bwd(long* bad) {
  long cases = 0;
  for (int batch = 1; batch <= 3; ++batch) {
    for (int heads_kv = 1; heads_kv <= 3; ++heads_kv) {
      for (int seqlen_k = 1; seqlen_k <= 9; ++seqlen_k) {
        for (int block_n = 1; block_n <= 4; ++block_n) {
          for (bool causal : {false, true}) {
            for (int ctas : {0, 1, 2, 5, 1000}) {
              FlashParams p{};
              p.batch = batch, p.heads_kv = heads_kv, p.seqlen_k = seqlen_k, p.causal = causal;
              const BwdTileScheduler s(p, 64, block_n, ctas);
              ++cases;
              const int n_blocks = (seqlen_k + block_n - 1) / block_n;
              const int groups = heads_kv * batch;
              auto fail = [&](const char* what) {
                if (++*bad <= 5) {
                  std::printf("%s: batch=%d heads_kv=%d seqlen_k=%d block_n=%d causal=%d ctas=%d\n", what, batch,
                              heads_kv, seqlen_k, block_n, int(causal), ctas);
                }
              };
              if (!s.units_fit() || s.units != n_blocks * groups) fail("backward unit count");
              if (!s.done(s.units) || !s.done(-1) || (s.units > 0 && (s.done(0) || s.done(s.units - 1)))) {
                fail("backward done() not exactly the indices outside [0, units)");
              }
              // The tail: every group when the CTAs' kTailWaves units each cover them, else the last few.
              const long want = (long(BwdTileScheduler::kTailWaves) * ctas + n_blocks - 1) / n_blocks;
              const int tail = causal && ctas > 0 && n_blocks > 1 ? int(want < groups ? want : groups) : 0;
              if (s.tail_groups != tail) fail("backward tail size");
              std::vector<int> seen(s.units, 0), next_block(groups, 0);
              for (int u = 0; u < s.units; ++u) {
                const BwdTile t = s.tile(u);
                if (t.n_block < 0 || t.n_block >= n_blocks || t.hk < 0 || t.hk >= heads_kv || t.b < 0 ||
                    t.b >= batch) {
                  fail("backward unit out of range");
                  break;
                }
                const int g = t.b * heads_kv + t.hk;
                const int head_units = (groups - tail) * n_blocks;
                const int expect = u < head_units ? g * n_blocks + t.n_block
                                                  : head_units + t.n_block * tail + (g - (groups - tail));
                if (expect != u || g < (u < head_units ? 0 : groups - tail)) {
                  fail("backward unit not in key-block-fastest order (tail: key block slowest)");
                  break;
                }
                if (t.n_block != next_block[g]++) fail("a (batch, kv head)'s key blocks not in increasing order");
                ++seen[g * n_blocks + t.n_block];
              }
              if (std::count(seen.begin(), seen.end(), 1) != s.units) fail("backward units not each once");
            }
          }
        }
      }
    }
  }
  // The counter runs past the last unit by up to a grid: unit counts above INT_MAX / 2 are refused.
  FlashParams big{};
  big.batch = 1 << 10, big.heads_kv = 1 << 10, big.seqlen_k = (1 << 9) * 128;  // 2^29 units
  ++cases;
  if (!BwdTileScheduler(big, 64, 128).units_fit()) std::printf("backward: 2^29 units refused\n"), ++*bad;
  big.seqlen_k = (1 << 10) * 128;  // 2^30 units
  ++cases;
  if (BwdTileScheduler(big, 64, 128).units_fit()) std::printf("backward: units above INT_MAX / 2 accepted\n"), ++*bad;
  return cases;
}

// HeavyFirstOrder on its own, for small shapes and group sizes.
long check_order(long* bad) {
  long cases = 0;
  for (int blocks = 1; blocks <= 6; ++blocks) {
    for (int heads = 1; heads <= 7; ++heads) {
      for (int group_units = 1; group_units <= 20; ++group_units) {
        const auto o = HeavyFirstOrder::make(blocks, heads, group_units);
        ++cases;
        auto fail = [&](const char* what) {
          if (++*bad <= 5) std::printf("%s: blocks=%d heads=%d group_units=%d\n", what, blocks, heads, group_units);
        };
        if (o.group < 1 || o.group > heads) fail("group size out of range");
        std::vector<int> seen(size_t(blocks) * heads, 0), head_at, block_at;
        for (int u = 0; u < blocks * heads; ++u) {
          int block, head;
          o.at(u, &block, &head);
          if (block < 0 || block >= blocks || head < 0 || head >= heads) {
            fail("unit out of range");
            break;
          }
          ++seen[size_t(head) * blocks + block];
          head_at.push_back(head), block_at.push_back(block);
        }
        if (int(head_at.size()) != blocks * heads) continue;
        for (int c : seen) {
          if (c != 1) {
            fail("a (block, head) not covered exactly once");
            break;
          }
        }
        // Groups: the first of heads % group heads (a whole group if that is 0), then whole groups; each a
        // contiguous run of all blocks of its heads, block ranks never decreasing inside it.
        const int expect_group = std::min(heads, std::max(1, (group_units + blocks - 1) / blocks));
        if (o.group != expect_group) fail("group size");
        const int first = heads % o.group ? heads % o.group : o.group;
        for (int u = 0, size = first; u < blocks * heads; u += size * blocks, size = o.group) {
          std::vector<int> count(heads, 0);
          for (int w = u; w < u + size * blocks; ++w) {
            ++count[head_at[w]];
            if (w > u && block_at[w] < block_at[w - 1]) fail("a heavier unit after a lighter one in a group");
          }
          int heads_in = 0;
          for (int c : count) heads_in += c == blocks ? 1 : 0;
          if (heads_in != size) fail("a group does not hold all blocks of its heads");
        }
      }
    }
  }
  return cases;
}

// The backward's last round: split units and their parts, for small shapes without masks.
long check_bwd_split(long* bad) {
  long cases = 0;
  auto fail = [&](const char* what, int batch, int heads_kv, int n_blocks, int ctas) {
    if (++*bad <= 5) {
      std::printf("%s: batch=%d heads_kv=%d n_blocks=%d ctas=%d\n", what, batch, heads_kv, n_blocks, ctas);
    }
  };
  for (int batch = 1; batch <= 3; ++batch) {
    for (int heads_kv = 1; heads_kv <= 3; ++heads_kv) {
      for (int n_blocks = 1; n_blocks <= 12; ++n_blocks) {
        for (int ctas : {0, 1, 2, 5, 7, 13}) {
          // 64 query rows, 2 query heads a kv head: units of 128, 32, 8 iterations (at most 7, 4, 1 parts).
          for (int block_m : {1, 4, 16}) {
            FlashParams p{};
            p.batch = batch, p.heads_kv = heads_kv, p.heads_q = 2 * heads_kv, p.seqlen_q = 64;
            p.seqlen_k = n_blocks * 4, p.window_left = -1, p.window_right = -1;
            const BwdTileScheduler s(p, block_m, 4, ctas);
            ++cases;
            const int units = n_blocks * heads_kv * batch;
            const long left = ctas > 0 && units > ctas ? units % ctas : 0;
            if (s.whole + s.split_units != units || s.units != s.whole + s.split_units * s.parts) {
              fail("split counts", batch, heads_kv, n_blocks, ctas);
              continue;
            }
            if (s.split_units != 0 && (s.split_units != left || s.parts < 2 || s.parts > BwdTileScheduler::kMaxParts)) {
              fail("split units not the last round's", batch, heads_kv, n_blocks, ctas);
            }
            // The parts: the fewest with the shortest round (ceil(left k / ctas) / k units) among those whose shares
            // keep kMinPartIters iterations.
            const int unit_iters = 64 / block_m * 2;
            int want_parts = 1;
            for (int k = 2; left > 0 && k <= BwdTileScheduler::kMaxParts; ++k) {
              if (unit_iters / k < BwdTileScheduler::kMinPartIters) break;
              const long rounds = (left * k + ctas - 1) / ctas, best = (left * want_parts + ctas - 1) / ctas;
              if (rounds * want_parts < best * k) want_parts = k;
            }
            if (s.parts != want_parts || (want_parts > 1) != (s.split_units > 0)) {
              fail("split parts not the shortest round's", batch, heads_kv, n_blocks, ctas);
            }
            std::vector<int> seen(long(units) * BwdTileScheduler::kMaxParts, 0);
            for (int u = 0; u < s.units; ++u) {
              const int unit = s.unit_of(u), part = s.part_of(u), parts = s.parts_of(u), flags = s.flags_of(u);
              const bool split = unit >= s.whole;
              if (unit < 0 || unit >= units || part < 0 || part >= parts || parts != (split ? s.parts : 1) ||
                  flags != (split ? 1 + 2 * (unit - s.whole) : -1) || flags + 2 > 1 + 2 * long(s.split_units) + 1) {
                fail("split index out of range", batch, heads_kv, n_blocks, ctas);
                break;
              }
              ++seen[long(unit) * BwdTileScheduler::kMaxParts + part];
            }
            for (int unit = 0; unit < units; ++unit) {
              for (int part = 0; part < BwdTileScheduler::kMaxParts; ++part) {
                const int want = part < (unit >= s.whole ? s.parts : 1) ? 1 : 0;
                if (seen[long(unit) * BwdTileScheduler::kMaxParts + part] != want) {
                  fail("a part not once", batch, heads_kv, n_blocks, ctas);
                }
              }
            }
          }
        }
      }
    }
  }
  for (int total = 0; total <= 60; ++total) {
    for (int parts = 1; parts <= BwdTileScheduler::kMaxParts; ++parts) {
      ++cases;
      int next = 0;
      for (int part = 0; part < parts; ++part) {
        int lo, n;
        BwdTileScheduler::part_range(total, part, parts, &lo, &n);
        if (n < 0 || (n > 0 && lo != next)) std::printf("part_range %d/%d of %d\n", part, parts, total), ++*bad;
        if (n > 0) next = lo + n;
        if (part < total && n == 0) std::printf("part_range %d/%d of %d empty\n", part, parts, total), ++*bad;
      }
      if (next != total) std::printf("part_range of %d in %d parts covers %d\n", total, parts, next), ++*bad;
    }
  }
  return cases;
}

// PersistentWalk<kSkew> for unit counts 0..40 on 1..9 CTAs.
template <bool kSkew>
long check_persistent_walk(long* bad) {
  long cases = 0;
  auto fail = [&](const char* what, int units, int ctas, int cta) {
    if (++*bad <= 5) std::printf("%s: skew=%d units=%d ctas=%d cta=%d\n", what, int(kSkew), units, ctas, cta);
  };
  for (int units = 0; units <= 40; ++units) {
    for (int ctas = 1; ctas <= 9; ++ctas) {
      ++cases;
      std::vector<int> seen(size_t(units), 0);
      for (int cta = 0; cta < ctas; ++cta) {
        std::vector<int> walked;
        for (PersistentWalk<kSkew> w(cta, ctas); w.u < units; w.advance()) {
          const int round = int(walked.size());
          if (w.u != round * ctas + (kSkew ? (cta + round) % ctas : cta)) fail("not the walk's unit", units, ctas, cta);
          walked.push_back(w.u);
          ++seen[size_t(w.u)];
        }
        for (int first = 0; first <= units + 1; ++first) {
          PersistentWalk<kSkew> w(cta, ctas);
          w.skip_to(first, units);
          const auto it = std::lower_bound(walked.begin(), walked.end(), first);
          const int want = it == walked.end() ? units : *it;
          if (w.u != want) fail("skip_to not to the first unit at or after", units, ctas, cta);
          if (w.u < units) {  // the walk goes on from there as from the start
            const size_t at = size_t(it - walked.begin());
            for (size_t i = at + 1; i < walked.size(); ++i) {
              w.advance();
              if (w.u != walked[i]) fail("walk after skip_to differs", units, ctas, cta);
            }
          }
        }
      }
      for (int n : seen) {
        if (n != 1) {
          fail("unit not taken exactly once", units, ctas, -1);
          break;
        }
      }
    }
  }
  return cases;
}

int main() {
  constexpr int kGroupUnits[] = {1, 2, 5, 512};
  long bad = 0;
  long cases = check_order(&bad);
  cases += check_bwd(&bad);
  cases += check_bwd_split(&bad);
  cases += check_persistent_walk<false>(&bad);
  cases += check_persistent_walk<true>(&bad);
  auto fail = [&](const char* what, int b, int h, int sq, int bm, int persistent, int causal) {
    if (++bad <= 5) {
      std::printf("%s: batch=%d heads=%d seqlen_q=%d block_m=%d persistent=%d causal=%d\n", what, b, h, sq, bm,
                  persistent, causal);
    }
  };
  for (int batch = 1; batch <= 3; ++batch) {
    for (int heads = 1; heads <= 3; ++heads) {
      for (int seqlen_q = 0; seqlen_q <= 9; ++seqlen_q) {
        for (int block_m = 1; block_m <= 3; ++block_m) {
          for (int persistent = 0; persistent < 2; ++persistent) {
            for (int causal = 0; causal < 2; ++causal) {
              for (int variant = 0; variant < 16; ++variant) {
                const int group_units = kGroupUnits[variant % 4];
                const int min_blocks = variant / 4 % 2 ? 3 : 1;
                const int window_left = variant / 8 ? 1 : -1;
                FlashParams p{};
                p.batch = batch, p.seqlen_q = seqlen_q, p.heads_q = heads, p.causal = causal;
                p.window_left = window_left, p.window_right = -1;
                const FwdTileScheduler s(p, block_m, persistent, group_units, min_blocks);
                ++cases;
                const int m_blocks = (seqlen_q + block_m - 1) / block_m;
                if (!s.units_fit() || s.units != s.units_wide) fail("unit count", batch, heads, seqlen_q, block_m,
                                                                    persistent, causal);
                std::vector<int> seen(size_t(m_blocks) * heads * batch, 0);
                for (int u = 0; u < s.units; ++u) {
                  for (int k = 0; k < s.tiles(u); ++k) {
                    const FwdTile t = s.tile(u, k);
                    if (t.m_block < 0 || t.m_block >= m_blocks || t.h < 0 || t.h >= heads || t.b < 0 || t.b >= batch) {
                      fail("tile out of range", batch, heads, seqlen_q, block_m, persistent, causal);
                      continue;
                    }
                    ++seen[(size_t(t.b) * heads + t.h) * m_blocks + t.m_block];
                  }
                  if (s.tiles(u) == 2 && s.tile(u, 0).m_block <= s.tile(u, 1).m_block) {
                    fail("pair not heaviest first", batch, heads, seqlen_q, block_m, persistent, causal);
                  }
                  if (!persistent) {
                    // Grouped across heads only under a causal mask without a window, min_blocks blocks or more.
                    const bool grouped = causal && window_left < 0 && m_blocks >= min_blocks;
                    int rank = u % m_blocks, hb = u / m_blocks;  // otherwise heads one after another
                    if (grouped) HeavyFirstOrder::make(m_blocks, heads * batch, group_units).at(u, &rank, &hb);
                    const FwdTile t = s.tile(u, 0);
                    if (t.m_block != m_blocks - 1 - rank || t.h != hb % heads || t.b != hb / heads) {
                      fail("not the heavy-first order", batch, heads, seqlen_q, block_m, persistent, causal);
                    }
                  }
                }
                for (int n : seen) {
                  if (n != 1) {
                    fail("tile not visited exactly once", batch, heads, seqlen_q, block_m, persistent, causal);
                    break;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  // Unit counts past INT_MAX / 2 are refused (the launch returns cudaErrorInvalidConfiguration).
  FlashParams big{};
  big.batch = 1 << 16, big.heads_q = 1 << 10, big.seqlen_q = 1 << 20;
  ++cases;
  if (FwdTileScheduler(big, 64, false).units_fit()) fail("units above INT_MAX accepted", big.batch, big.heads_q,
                                                         big.seqlen_q, 64, 0, 0);
  big.seqlen_q = 64 * 16;  // 2^16 * 2^10 * 16 = 2^30 units: one past INT_MAX / 2
  ++cases;
  if (FwdTileScheduler(big, 64, false).units_fit()) fail("2^30 units accepted", big.batch, big.heads_q,
                                                         big.seqlen_q, 64, 0, 0);
  big.seqlen_q = 64 * 15;
  ++cases;
  if (!FwdTileScheduler(big, 64, false).units_fit()) fail("units below INT_MAX / 2 refused", big.batch, big.heads_q,
                                                          big.seqlen_q, 64, 0, 0);
  // Heavy-first groups cut to the query heads whose K and V fit kHeavyFirstGroupKvBytes (16 MiB), a kv head's query
  // heads together: (seqlen, head dim, heads_q, heads_kv, block_m) -> group units of a causal grid of a CTA per unit.
  struct KvCase {
    int seqlen, head_dim, heads_q, heads_kv, block_m, units;
  };
  for (const KvCase& c : {KvCase{4096, 128, 16, 16, 192, 8 * 22},  // 2 MiB a kv head: 8 heads of 22 blocks
                          KvCase{4096, 128, 32, 8, 192, 512},      // 8 kv heads = 32 query heads: the 512 cap
                          KvCase{4096, 256, 8, 8, 128, 4 * 32},    // 4 MiB a kv head: 4 heads of 32 blocks
                          KvCase{16384, 128, 16, 16, 192, 2 * 86},
                          KvCase{1 << 20, 128, 8, 2, 64 * 1024, 4 * 16},  // past the budget: one kv head's 4 heads
                          KvCase{4096, 128, 16, 16, 1024, 0}}) {          // 4 blocks a head: not grouped
    FlashParams p{};
    p.batch = 2, p.seqlen_q = c.seqlen, p.seqlen_k = c.seqlen, p.heads_q = c.heads_q, p.heads_kv = c.heads_kv;
    p.head_dim = c.head_dim, p.causal = true, p.window_left = -1, p.window_right = -1;
    ++cases;
    const FwdTileScheduler s(p, c.block_m, false);
    if (s.group_units != c.units) {
      std::printf("kv-budget group: seqlen %d d %d heads %d/%d block_m %d: %d units, expected %d\n", c.seqlen,
                  c.head_dim, c.heads_q, c.heads_kv, c.block_m, s.group_units, c.units);
      ++bad;
    }
  }
  if (bad) {
    std::printf("%ld of %ld cases failed\n", bad, cases);
    return 1;
  }
  std::printf("ok %ld\n", cases);
  return 0;
}
