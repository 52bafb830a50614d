// Check of cuda/kernels/tile_scheduler_fwd.cuh on the CPU: for small shapes and group sizes, walking every unit
// visits each (query block, head, batch) tile exactly once, a paired unit holds its (batch, head)'s heaviest
// remaining block first, a grid of one CTA per unit under a causal mask without a window and with min_blocks query
// blocks or more takes its units in HeavyFirstOrder (checked on its own in tile_scheduler_bwd_check.cc) while any
// other grid of one CTA per unit takes the heads one after another, and units_fit() refuses unit counts above
// INT_MAX. Prints "ok <cases>" or the first failures; exit 1 on any. Built and run by tests/test_tile_scheduler.py.
#include <climits>
#include <cstdio>
#include <vector>

#include "kernels/tile_scheduler_fwd.cuh"

using jax_flash::FlashParams;
using jax_flash::cuda::FwdTile;
using jax_flash::cuda::FwdTileScheduler;
using jax_flash::cuda::HeavyFirstOrder;

int main() {
  constexpr int kGroupUnits[] = {1, 2, 5, 512};
  long cases = 0, bad = 0;
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
  // Unit counts past INT_MAX are refused (the launch returns cudaErrorInvalidConfiguration).
  FlashParams big{};
  big.batch = 1 << 16, big.heads_q = 1 << 10, big.seqlen_q = 1 << 20;
  ++cases;
  if (FwdTileScheduler(big, 64, false).units_fit()) fail("units above INT_MAX accepted", big.batch, big.heads_q,
                                                         big.seqlen_q, 64, 0, 0);
  big.seqlen_q = 64 * 32;  // 2^16 * 2^10 * 32 = 2^31 units: one past INT_MAX
  ++cases;
  if (FwdTileScheduler(big, 64, false).units_fit()) fail("2^31 units accepted", big.batch, big.heads_q,
                                                         big.seqlen_q, 64, 0, 0);
  big.seqlen_q = 64 * 31;
  ++cases;
  if (!FwdTileScheduler(big, 64, false).units_fit()) fail("units below INT_MAX refused", big.batch, big.heads_q,
                                                          big.seqlen_q, 64, 0, 0);
  if (bad) {
    std::printf("%ld of %ld cases failed\n", bad, cases);
    return 1;
  }
  std::printf("ok %ld\n", cases);
  return 0;
}
