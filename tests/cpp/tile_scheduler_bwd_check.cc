// Check of cuda/kernels/tile_scheduler_{common,bwd}.cuh on the CPU. HeavyFirstOrder, for small shapes and group sizes:
// every (block, head) exactly once; heads in contiguous groups, the last one whole; inside a group no unit is lighter
// (higher block rank) than a later one. BwdGrid, for cluster sizes 1 and 2, with and without a causal mask and a
// window: every (key block, kv head, batch) exactly once, heads grouped (HeavyFirstOrder) only under a causal mask
// without a window with enough key-block clusters per head, else one after another, a cluster's CTAs neighbouring key
// blocks of one (batch, kv head) in rank order, each (batch, kv head)'s key blocks in increasing order (the
// deterministic dQ order needs it), and grids above INT_MAX refused. Prints "ok <cases>" or the first failures; exit 1
// on any. Built and run by tests/test_tile_scheduler.py.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <vector>

#include "kernels/tile_scheduler_bwd.cuh"

using jax_flash::FlashParams;
using jax_flash::cuda::BwdGrid;
using jax_flash::cuda::HeavyFirstOrder;

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

template <int kCluster>
long check(long* bad) {
  long cases = 0;
  int variant = 0;  // (causal, window, min_blocks) of the case, for the failure message
  auto fail = [&](const char* what, int batch, int heads, int sk, int bn) {
    if (++*bad <= 5) {
      std::printf("%s: cluster=%d batch=%d heads_kv=%d seqlen_k=%d block_n=%d variant=%d\n", what, kCluster, batch,
                  heads, sk, bn, variant);
    }
  };
  for (int batch = 1; batch <= 3; ++batch) {
    for (int heads = 1; heads <= 3; ++heads) {
      for (int seqlen_k = 1; seqlen_k <= 9; ++seqlen_k) {
        for (int v = 0; v < 3 * 8; ++v) {
          const int block_n = 1 + v % 3;
          variant = v / 3;
          const bool causal = variant % 2;
          const int window_left = variant / 2 % 2 ? 1 : -1;
          const int min_blocks = variant / 4 ? 3 : 1;
          const int group_units = 4;
          FlashParams p{};
          p.batch = batch, p.heads_kv = heads, p.seqlen_k = seqlen_k;
          p.causal = causal, p.window_left = window_left, p.window_right = -1;
          const auto g = BwdGrid<kCluster>::make(p, block_n, group_units, min_blocks);
          ++cases;
          const int blocks = (seqlen_k + block_n - 1) / block_n;
          if (g.key_blocks % kCluster != 0 || g.key_blocks < blocks || g.key_blocks >= blocks + kCluster) {
            fail("key block count", batch, heads, seqlen_k, block_n);
          }
          if (!g.fits() || g.ctas() != int64_t(g.key_blocks) * heads * batch) {
            fail("CTA count", batch, heads, seqlen_k, block_n);
          }
          std::vector<int> seen(size_t(g.key_blocks) * heads * batch, 0);
          std::vector<int> last_block(size_t(heads) * batch, -1);
          int first_n = 0, first_hk = 0, first_b = 0;
          for (int id = 0; id < int(g.ctas()); ++id) {
            int n, hk, b;
            g.coord(id, &n, &hk, &b);
            if (n < 0 || n >= g.key_blocks || hk < 0 || hk >= heads || b < 0 || b >= batch) {
              fail("out of range", batch, heads, seqlen_k, block_n);
              continue;
            }
            ++seen[(size_t(b) * heads + hk) * g.key_blocks + n];
            // HeavyFirstOrder over clusters of key blocks and (batch, kv head) pairs, grouped across heads only
            // under a causal mask without a window with min_blocks clusters or more, else head after head.
            const int clusters = int(g.key_blocks / kCluster);
            const bool grouped = causal && window_left < 0 && clusters >= min_blocks;
            int rank = id / kCluster % clusters, head = id / kCluster / clusters;
            if (grouped) HeavyFirstOrder::make(clusters, heads * batch, group_units).at(id / kCluster, &rank, &head);
            if (n != rank * kCluster + id % kCluster || hk != head % heads || b != head / heads) {
              fail("not the heavy-first order", batch, heads, seqlen_k, block_n);
            }
            int& last = last_block[size_t(b) * heads + hk];
            if (n <= last) fail("a key block before a lower one", batch, heads, seqlen_k, block_n);
            last = n;
            if (id % kCluster == 0) {
              first_n = n, first_hk = hk, first_b = b;
              if (n % kCluster != 0) fail("cluster not aligned", batch, heads, seqlen_k, block_n);
            } else if (n != first_n + id % kCluster || hk != first_hk || b != first_b) {
              fail("cluster members are not neighbours", batch, heads, seqlen_k, block_n);
            }
          }
          for (int c : seen) {
            if (c != 1) {
              fail("a key block not covered exactly once", batch, heads, seqlen_k, block_n);
              break;
            }
          }
        }
      }
    }
  }
  FlashParams big{};
  big.batch = 65535, big.heads_kv = 65535, big.seqlen_k = 1;
  ++cases;
  if (BwdGrid<kCluster>::make(big, 1).fits()) fail("a grid above INT_MAX accepted", 65535, 65535, 1, 1);
  big.batch = 1, big.heads_kv = 1, big.seqlen_k = INT_MAX;
  ++cases;
  const auto whole = BwdGrid<kCluster>::make(big, 1);  // INT_MAX key blocks (+1 for whole clusters)
  if (whole.key_blocks != (int64_t(INT_MAX) + kCluster - 1) / kCluster * kCluster || whole.fits() != (kCluster == 1)) {
    fail("INT_MAX key blocks miscounted", 1, 1, INT_MAX, 1);
  }
  ++cases;
  if (!BwdGrid<kCluster>::make(big, 64).fits()) fail("a grid below INT_MAX refused", 1, 1, INT_MAX, 64);
  return cases;
}

int main() {
  long bad = 0;
  const long cases = check_order(&bad) + check<1>(&bad) + check<2>(&bad);
  if (bad) {
    std::printf("%ld failures in %ld cases\n", bad, cases);
    return 1;
  }
  std::printf("ok %ld\n", cases);
  return 0;
}
