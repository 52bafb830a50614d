// Check of cuda/kernels/tile_scheduler_bwd.cuh on the CPU: for small shapes and cluster sizes 1 and 2, the grid's
// CTAs cover each (key block, kv head, batch) exactly once, a cluster's CTAs are neighbouring key blocks of one
// (batch, kv head) in rank order, key blocks never decrease with the CTA index (every lower key block, the heavier
// one under a causal mask, starts first), and fits() refuses grids above INT_MAX. Prints "ok <cases>" or the
// first failures; exit 1 on any. Built and run by tests/test_tile_scheduler.py.
#include <climits>
#include <cstdio>
#include <vector>

#include "kernels/tile_scheduler_bwd.cuh"

using jax_flash::FlashParams;
using jax_flash::cuda::BwdGrid;

template <int kCluster>
long check(long* bad) {
  long cases = 0;
  auto fail = [&](const char* what, int batch, int heads, int sk, int bn) {
    if (++*bad <= 5) {
      std::printf("%s: cluster=%d batch=%d heads_kv=%d seqlen_k=%d block_n=%d\n", what, kCluster, batch, heads, sk,
                  bn);
    }
  };
  for (int batch = 1; batch <= 3; ++batch) {
    for (int heads = 1; heads <= 3; ++heads) {
      for (int seqlen_k = 1; seqlen_k <= 9; ++seqlen_k) {
        for (int block_n = 1; block_n <= 3; ++block_n) {
          FlashParams p{};
          p.batch = batch, p.heads_kv = heads, p.seqlen_k = seqlen_k;
          const auto g = BwdGrid<kCluster>::make(p, block_n);
          ++cases;
          const int blocks = (seqlen_k + block_n - 1) / block_n;
          if (g.key_blocks % kCluster != 0 || g.key_blocks < blocks || g.key_blocks >= blocks + kCluster) {
            fail("key block count", batch, heads, seqlen_k, block_n);
          }
          if (!g.fits() || g.ctas() != int64_t(g.key_blocks) * heads * batch) {
            fail("CTA count", batch, heads, seqlen_k, block_n);
          }
          std::vector<int> seen(size_t(g.key_blocks) * heads * batch, 0);
          int prev_n = 0;
          int first_n = 0, first_hk = 0, first_b = 0;
          for (int id = 0; id < int(g.ctas()); ++id) {
            int n, hk, b;
            g.coord(id, &n, &hk, &b);
            if (n < 0 || n >= g.key_blocks || hk < 0 || hk >= heads || b < 0 || b >= batch) {
              fail("out of range", batch, heads, seqlen_k, block_n);
              continue;
            }
            ++seen[(size_t(b) * heads + hk) * g.key_blocks + n];
            if (n / kCluster < prev_n / kCluster) fail("key blocks out of order", batch, heads, seqlen_k, block_n);
            prev_n = n;
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
  const long cases = check<1>(&bad) + check<2>(&bad);
  if (bad) {
    std::printf("%ld failures in %ld cases\n", bad, cases);
    return 1;
  }
  std::printf("ok %ld\n", cases);
  return 0;
}
