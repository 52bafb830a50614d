// Exhaustive check of cuda/mask.h on small shapes: every derived range agrees with AttentionMask::visible(), the
// definition every kernel's per-element mask must match. Prints "ok <cases>" or the first disagreements; exit 1 on
// any. Built and run by tests/test_mask.py.
#include <cstdio>
#include <initializer_list>
#include <vector>

#include "mask.h"

using jax_flash::AttentionMask;

int main() {
  long cases = 0, bad = 0;
  auto fail = [&](const char* what, int causal, int left, int right, int q_len, int kv_len, int i, int j) {
    if (++bad <= 5) {
      std::printf("%s: causal=%d window=(%d,%d) q_len=%d kv_len=%d row=%d key=%d\n", what, causal, left, right,
                  q_len, kv_len, i, j);
    }
  };
  constexpr int kRows = 12, kKeys = 12;
  // Every range a kernel derives from `mask` agrees with mask.visible() on the kRows x kKeys positions.
  auto check_ranges = [&](const AttentionMask& mask, int causal, int left, int right, int q_len, int kv_len) {
    for (int j = -1; j < kKeys; ++j) {
      int row_lo, row_hi;
      mask.rows_seeing_key(j, &row_lo, &row_hi);
      for (int i = 0; i < kRows; ++i) {
        ++cases;
        const bool visible = j >= 0 && mask.visible(i, j);
        if (visible != (i >= row_lo && i < row_hi)) {
          fail("rows_seeing_key", causal, left, right, q_len, kv_len, i, j);
        }
      }
    }
    // key_range / row_range over-approximate: every visible (row, key) lies inside them.
    for (int i = 0; i < kRows; ++i) {
      int key_begin, key_end;
      mask.key_range(i, i + 1, &key_begin, &key_end);
      for (int j = 0; j < kKeys; ++j) {
        if (mask.visible(i, j) && (j < key_begin || j >= key_end)) {
          fail("key_range", causal, left, right, q_len, kv_len, i, j);
        }
      }
    }
    // interval_key_end bounds the keys any row of a range sees (the forward's per-warpgroup key tiles).
    for (int row_begin = 0; row_begin < kRows; ++row_begin) {
      for (int row_end = row_begin; row_end <= kRows; ++row_end) {
        const int key_end = mask.interval_key_end(row_begin, row_end);
        for (int i = row_begin; i < row_end; ++i) {
          for (int j = 0; j < kKeys; ++j) {
            ++cases;
            if (mask.visible(i, j) && j >= key_end) {
              fail("interval_key_end", causal, left, right, q_len, kv_len, i, j);
            }
          }
        }
      }
    }
    for (int j = 0; j < kKeys; ++j) {
      int row_begin, row_end;
      mask.row_range(j, j + 1, &row_begin, &row_end);
      for (int i = 0; i < kRows; ++i) {
        if (mask.visible(i, j) && (i < row_begin || i >= row_end)) {
          fail("row_range", causal, left, right, q_len, kv_len, i, j);
        }
      }
    }
    // unmasked_blocks: inside [n_begin, n_end), every (row, key) of its blocks visible, and exactly the
    // blocks tile_fully_visible accepts.
    for (int block_n = 1; block_n <= 4; ++block_n) {
      for (int row_begin = 0; row_begin < kRows; row_begin += 2) {
        for (int rows = 1; rows <= 5; rows += 2) {
          for (int n_begin = 0; n_begin * block_n <= kKeys; ++n_begin) {
            for (int n_end = n_begin; n_end * block_n <= kKeys + block_n; ++n_end) {
              const int row_end = row_begin + rows, row_limit = kRows - 1;
              int full_begin, full_end;
              mask.unmasked_blocks(row_begin, row_end, row_limit, block_n, n_begin, n_end, &full_begin,
                                   &full_end);
              ++cases;
              if (full_begin < n_begin || full_end > n_end || full_end < full_begin) {
                fail("unmasked_blocks range", causal, left, right, q_len, kv_len, row_begin, n_begin);
              }
              for (int n = n_begin; n < n_end; ++n) {
                const bool inside = n >= full_begin && n < full_end;
                if (inside != mask.tile_fully_visible(row_begin, row_end, n * block_n, (n + 1) * block_n,
                                                      row_limit)) {
                  fail("unmasked_blocks vs tile_fully_visible", causal, left, right, q_len, kv_len,
                       row_begin, n * block_n);
                }
                for (int i = row_begin; inside && i < row_end && i < row_limit; ++i) {
                  for (int j = n * block_n; j < (n + 1) * block_n; ++j) {
                    if (!mask.visible(i, j)) {
                      fail("unmasked_blocks", causal, left, right, q_len, kv_len, i, j);
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  };
  for (int causal = 0; causal < 2; ++causal) {
    for (int left = -1; left < 6; ++left) {
      for (int right = -1; right < 6; ++right) {
        for (int q_len = 0; q_len <= kRows; q_len += 3) {
          for (int kv_len = 0; kv_len <= kKeys; kv_len += 4) {
           for (int shift : {-7, -3, 0, 2, 5}) {  // the diagonal shift of a part of a longer sequence
            check_ranges(AttentionMask(causal, left, right, q_len, kv_len, shift), causal, left, right, q_len,
                         kv_len);
           }
          }
        }
      }
    }
  }
  // Segment ids as runs (RunPolicy: the per-position bounds the segment_operands target gives ids whose every id is
  // one run on each side, in the same order): visible() is "same id" and the other masks, and every range agrees.
  {
    const std::vector<std::vector<int>> q_docs = {{12}, {3, 5, 4}, {1, 1, 4, 6}, {5, 2, 5}};  // run lengths
    const std::vector<std::vector<int>> kv_docs = {{12}, {2, 6, 4}, {4, 1, 2, 5}, {1, 10, 1}};
    for (size_t l = 0; l < q_docs.size(); ++l) {
      std::vector<int> q_id, kv_id;
      for (size_t d = 0; d < q_docs[l].size(); ++d) q_id.insert(q_id.end(), q_docs[l][d], int(d));
      for (size_t d = 0; d < kv_docs[l].size(); ++d) kv_id.insert(kv_id.end(), kv_docs[l][d], int(d));
      auto runs_of = [](const std::vector<int>& mine, const std::vector<int>& other) {
        std::vector<int32_t> run;
        for (int x : mine) {
          int first = -1, last = -1;
          for (int o = 0; o < int(other.size()); ++o) {
            if (other[o] == x) {
              if (first < 0) first = o;
              last = o;
            }
          }
          run.push_back(first);
          run.push_back(last + 1);
        }
        return run;
      };
      const std::vector<int32_t> q_run = runs_of(q_id, kv_id), kv_run = runs_of(kv_id, q_id);
      jax_flash::RunPolicy run;
      run.q_run = q_run.data();
      run.kv_run = kv_run.data();
      for (int causal = 0; causal < 2; ++causal) {
        for (int left = -1; left < 6; left += 2) {
          for (int right = -1; right < 6; right += 3) {
            for (int q_len = 0; q_len <= kRows; q_len += 4) {
              for (int kv_len = 0; kv_len <= kKeys; kv_len += 5) {
                for (int shift : {-3, 0, 2}) {
                  const AttentionMask base(causal, left, right, q_len, kv_len, shift);
                  const AttentionMask mask(causal, left, right, q_len, kv_len, shift, jax_flash::SegmentPolicy{}, run);
                  for (int i = 0; i < kRows; ++i) {
                    for (int j = 0; j < kKeys; ++j) {
                      ++cases;
                      if (mask.visible(i, j) != (base.visible(i, j) && q_id[i] == kv_id[j])) {
                        fail("runs visible", causal, left, right, q_len, kv_len, i, j);
                      }
                    }
                  }
                  check_ranges(mask, causal, left, right, q_len, kv_len);
                }
              }
            }
          }
        }
      }
    }
  }
  // mask_for_batch against the definition at global positions: local row i is global i + q_off, local key j global
  // j + kv_off; lengths are global.
  for (int causal = 0; causal < 2; ++causal) {
    for (int left = -1; left < 5; ++left) {
      for (int right = -1; right < 5; ++right) {
        for (int q_off = 0; q_off < 20; q_off += 3) {
          for (int kv_off = 0; kv_off < 20; kv_off += 4) {
            for (int q_len_g = 0; q_len_g < 30; q_len_g += 7) {
              for (int kv_len_g = 0; kv_len_g < 30; kv_len_g += 5) {
                const int32_t q_lens[1] = {q_len_g}, kv_lens[1] = {kv_len_g};
                const int32_t q_offs[1] = {q_off}, kv_offs[1] = {kv_off};
                jax_flash::FlashParams p{};
                p.seqlen_q = kRows;
                p.seqlen_k = kKeys;
                p.causal = causal;
                p.window_left = left;
                p.window_right = right;
                p.q_lens = q_lens;
                p.kv_lens = kv_lens;
                p.q_offsets = q_offs;
                p.kv_offsets = kv_offs;
                const AttentionMask mask = jax_flash::mask_for_batch(p, 0);
                for (int i = 0; i < kRows; ++i) {
                  for (int j = 0; j < kKeys; ++j) {
                    ++cases;
                    const int gi = i + q_off, gj = j + kv_off;
                    const bool visible = gi < q_len_g && gj < kv_len_g && (!causal || gj <= gi) &&
                                         (left < 0 || gj >= gi - left) && (right < 0 || gj <= gi + right);
                    if (visible != mask.visible(i, j)) fail("mask_for_batch", causal, left, right, q_off, kv_off, i, j);
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  // Decode's packed rows (PackedRowsMask, decode_mask_for_batch): row r is step r / group at position kv_len - Tq +
  // r / group; its interval, the tile tests and unmasked_blocks agree with the definition for every row below the
  // packed rows (rows past them, a tile's padding, are never stored).
  for (int causal = 0; causal < 2; ++causal) {
    for (int left = -1; left < 5; ++left) {
      for (int right = -1; right < 3; ++right) {
        for (int group : {1, 2, 3, 5}) {
          for (int tq = 1; tq <= 4; ++tq) {
            for (int kv_len = 0; kv_len <= kKeys; ++kv_len) {
              const int32_t lens[1] = {kv_len};
              jax_flash::FlashParams p{};
              p.batch = 1;
              p.seqlen_q = tq;
              p.seqlen_k = kKeys;
              p.heads_q = group;
              p.heads_kv = 1;
              p.causal = causal;
              p.window_left = left;
              p.window_right = right;
              p.kv_lens = lens;
              const jax_flash::PackedRowsMask mask = jax_flash::decode_mask_for_batch(p, 0);
              const int rows = group * tq;
              auto visible = [&](int r, int j) {
                const int pos = kv_len - tq + r / group;
                return j >= 0 && j < kv_len && (!causal || j <= pos) && (left < 0 || j >= pos - left) &&
                       (right < 0 || j <= pos + right);
              };
              const int tag = tq * 100 + group;  // Tq and group in the report's q_len column
              for (int r = 0; r < rows; ++r) {
                for (int j = 0; j < kKeys; ++j) {
                  ++cases;
                  if (visible(r, j) != (j >= mask.lo(r) && j < mask.hi(r))) {
                    fail("packed rows lo/hi", causal, left, right, tag, kv_len, r, j);
                  }
                }
              }
              for (int block_n = 1; block_n <= 4; ++block_n) {
                for (int row_begin = 0; row_begin < rows + 2; row_begin += 2) {
                  const int row_end = row_begin + 3;
                  for (int n = 0; n * block_n < kKeys; ++n) {
                    bool all = true;
                    for (int r = row_begin; r < row_end && r < rows; ++r) {
                      for (int j = n * block_n; j < (n + 1) * block_n; ++j) all = all && visible(r, j);
                    }
                    ++cases;
                    const bool none = mask.tile_masking_warp(row_begin, row_end, n * block_n, (n + 1) * block_n,
                                                             tq) == jax_flash::TileMasking::kNone;
                    if (none != all) fail("packed rows tile masking", causal, left, right, tag, kv_len, row_begin,
                                          n * block_n);
                  }
                  const int n_end = (kKeys + block_n - 1) / block_n;
                  int full_begin, full_end;
                  mask.unmasked_blocks(row_begin, row_end, tq, block_n, 0, n_end, &full_begin, &full_end);
                  if (full_begin < 0 || full_end > n_end || full_end < full_begin) {
                    fail("packed rows unmasked_blocks range", causal, left, right, tag, kv_len, row_begin,
                         full_begin);
                  }
                  for (int n = full_begin; n < full_end; ++n) {
                    for (int r = row_begin; r < row_end && r < rows; ++r) {
                      for (int j = n * block_n; j < (n + 1) * block_n; ++j) {
                        if (!visible(r, j)) fail("packed rows unmasked_blocks", causal, left, right, tag, kv_len, r, j);
                      }
                    }
                  }
                }
              }
            }
          }
        }
      }
    }
  }
  if (bad) {
    std::printf("%ld of %ld disagree\n", bad, cases);
    return 1;
  }
  std::printf("ok %ld\n", cases);
  return 0;
}
