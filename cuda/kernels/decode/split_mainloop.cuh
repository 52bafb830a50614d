// What the decode split kernels share (the mma.sync one in flash_decode.cuh, the sm_90a wgmma one in
// kernels/sm90/flash_decode_wgmma_sm90.cuh): a split's key range, the cp.async loads of Q rows and of K/V tiles
// (dense or paged), the ring that streams a split's key tiles, each packed row's visible keys, the online-softmax
// step over m16n8 accumulator tiles and the split's partial results.
//
// A kernel's Traits give: kD, kBlockN, kStages, kThreads, kRows (packed query rows of the CTA); q_offset(r, col) and
// kv_offset(key, col), the element offsets of a 16-byte chunk in its Q and K/V tiles (each kernel's operand layout);
// tile_landed(), run by every thread after its copies of a tile landed and before the CTA barrier that publishes
// them (the wgmma kernel orders them before its async-proxy reads there); kReadLag, the tiles after its own whose
// compute a tile's stage is still read in (0: done when its compute returns; 1: the wgmma kernel's P V of a tile runs
// under the next tile's softmax).
#pragma once

#include <climits>
#include <cmath>

#include "flash_params.h"
#include "score_mod.h"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/l2_policy.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/decode/decode_traits.h"
#include "kernels/sm80/utils_sm80.cuh"
#include "kernels/sm90/pipeline.h"  // PipelineState: plain ring counting, no sm_90 instructions

namespace jax_flash::cuda::decode {

inline constexpr int kElems = 8;  // 16-bit elements per 16-byte chunk

// The rows and key range of one decode call for batch element b: positions of step t are base + t, base = kv_len -
// Tq; keys [lo, hi) are the ones any row may see.
struct DecodeRange {
  int kv_len;
  int base;
  int lo;
  int hi;
};
__device__ __forceinline__ DecodeRange decode_range(const FlashParams& p, int b) {
  DecodeRange r;
  r.kv_len = min(max(p.kv_lens[b], 0), p.seqlen_k);
  r.base = r.kv_len - p.seqlen_q;
  const int last = r.base + p.seqlen_q - 1;  // the last row's position
  r.lo = p.window_left >= 0 ? max(r.base - p.window_left, 0) : 0;
  r.hi = r.kv_len;
  if (p.causal) r.hi = min(r.hi, last + 1);
  if (p.window_right >= 0) r.hi = min(r.hi, last + p.window_right + 1);
  return r;
}

// The keys [*lo, *hi) packed row r (step r / group) sees. A padding row (r >= rows: zero Q, its results never
// stored) is given every key, so that it never keeps its warp on the masked softmax path.
__device__ __forceinline__ void row_keys(const FlashParams& p, const DecodeRange& range, int r, int group, int rows,
                                         int* lo, int* hi) {
  const int pos = range.base + r / group;
  *lo = p.window_left >= 0 ? pos - p.window_left : 0;
  *hi = range.kv_len;
  if (p.causal) *hi = min(*hi, pos + 1);
  if (p.window_right >= 0) *hi = min(*hi, pos + p.window_right + 1);
  if (r >= rows) {
    *lo = INT_MIN;
    *hi = INT_MAX;
  }
}

// Key tiles of kBlockN keys in a range.
template <int kBlockN>
__device__ __forceinline__ int range_tiles(const DecodeRange& r) {
  return r.hi > r.lo ? (r.hi - r.lo - 1) / kBlockN + 1 : 0;  // no wrap for ranges near INT32_MAX keys
}

// The batch element that the blocks of grid index z (blockIdx.z) compute. In launch order z is the slowest index, so
// a long sequence late in a ragged batch would start when most blocks are done and leave a tail. Where the launcher
// asks for it (FlashParams::rank_batch, decode::RankBatch) the blocks take the sequences longest first, and
// otherwise z itself. Every block ranks the batch alike from its key tiles, coarsely: a sequence of t tiles falls in
// bucket t kRankBuckets / (most + 1) of a batch whose longest has `most`, so that a bucket spans 1/kRankBuckets of
// the longest sequence (the longest-first order's error in a unit's start: at most that much); buckets are taken
// from the highest, and a bucket's sequences in batch order (so equal lengths keep it, and the order is a
// permutation). The tile counts go to shared memory, one atomic each to the buckets' histogram, then one warp scans
// the histogram for the bucket of rank z and ballots over the batch (batch / 32 steps) for its sequence. (Ranked
// pairwise, batch^2 / kThreads steps a thread, 256 sequences cost the TMA kernel ~1.5-3 us a block: NOTES, session
// 74.) Skipped when every sequence has as many tiles. Every thread calls this; `scratch` holds
// decode::RankScratchInts(batch) ints of shared memory that nothing else uses until the call returns.
template <int kBlockN, int kThreads>
__device__ __forceinline__ int batch_element(const FlashParams& p, int z, int* scratch, int tid) {
  static_assert(kThreads % kWarpSize == 0 && kThreads / kWarpSize <= kRankMaxWarps && kRankBuckets == kWarpSize);
  if (!p.rank_batch) return z;
  int* hist = scratch;                       // sequences per bucket
  int* warp_most = hist + kRankBuckets;      // each warp's longest
  int* found = warp_most + kRankMaxWarps;    // the sequence of rank z
  int* key = found + 1;                      // each sequence's tiles, then its bucket
  const int first = range_tiles<kBlockN>(decode_range(p, 0));
  bool uniform = true;
  int most = 0;
  for (int j = tid; j < p.batch; j += kThreads) {
    const int t = range_tiles<kBlockN>(decode_range(p, j));
    key[j] = t;
    uniform = uniform && t == first;
    most = max(most, t);
  }
  if (tid < kRankBuckets) hist[tid] = 0;
  most = warp_max(most);
  if (tid % kWarpSize == 0) warp_most[tid / kWarpSize] = most;
  if (__syncthreads_and(uniform)) return z;  // equal lengths: the batch order is the longest-first order
#pragma unroll
  for (int w = 0; w < kThreads / kWarpSize; ++w) most = max(most, warp_most[w]);
  for (int j = tid; j < p.batch; j += kThreads) {
    const int bucket = int(unsigned(key[j]) * kRankBuckets / (unsigned(most) + 1));  // tiles <= 2^26: no wrap
    key[j] = bucket;
    atomicAdd(&hist[bucket], 1);
  }
  __syncthreads();
  if (tid < kWarpSize) {
    // Lane l counts bucket kRankBuckets - 1 - l (the longest first): ranks [before, before + count) are its.
    const int count = hist[kRankBuckets - 1 - tid];
    int upto = count;  // ranks before the next lane's bucket
#pragma unroll
    for (int offset = 1; offset < kWarpSize; offset *= 2) {
      const int below = __shfl_up_sync(0xffffffff, upto, offset);
      if (tid >= offset) upto += below;
    }
    const int lane = __ffs(__ballot_sync(0xffffffff, z < upto)) - 1;  // z < batch = the last lane's upto
    const int bucket = kRankBuckets - 1 - lane;
    int nth = z - __shfl_sync(0xffffffff, upto - count, lane);  // z's place among its bucket's sequences
    for (int base = 0; base < p.batch; base += kWarpSize) {  // nth is warp-uniform: the warp leaves together
      const int j = base + tid;
      const bool in = j < p.batch && key[j] == bucket;
      const unsigned ins = __ballot_sync(0xffffffff, in);
      if (in && __popc(ins & ((1u << tid) - 1)) == nth) *found = j;
      if (nth < __popc(ins)) break;
      nth -= __popc(ins);
    }
  }
  __syncthreads();
  const int b = *found;
  __syncthreads();  // scratch is free again
  return b;
}

// Key tiles of kBlockN keys in a range: from r.lo (the split kernels' tiles start at the range), or kAligned, on
// the grid of key 0 (whole tiles of the cache, the TMA decode kernel's boxes), which may take one more.
template <int kBlockN, bool kAligned>
__device__ __forceinline__ int split_range_tiles(const DecodeRange& r) {
  if constexpr (kAligned) return r.hi > r.lo ? (r.hi - 1) / kBlockN - r.lo / kBlockN + 1 : 0;
  return range_tiles<kBlockN>(r);
}

// The key tiles [begin, end) of split `split` of a batch element's range (FlashParams::balance_splits): equal shares
// of its own tiles, or shares of one size across the batch, so that a ragged batch's long sequences take more
// splits than its short ones and every block streams about as many tiles. The balanced share starts at the batch's
// tiles over the blocks an equal split would run, batch x num_splits / 2 per kv head (one wave), and is raised (at
// most four times, in proportion to the excess) until the sequences' splits, sum over the batch of ceil(tiles_b /
// share), fit those blocks: rounding each sequence's count up adds up to one block per sequence, which would spill a
// few blocks into a second wave. split_share() finds the share (0 without balance_splits); its batch sums are
// block-wide: every thread calls it (before any of them returns); `scratch` holds kThreads / 32 ints of shared
// memory that nothing else uses until the call returns. split_of() is then per thread.
struct SplitTiles {
  int begin;
  int end;
};
template <int kBlockN, int kThreads, bool kAligned = false>
__device__ __forceinline__ int64_t split_share(const FlashParams& p, int* scratch, int tid) {
  if (!p.balance_splits) return 0;
  // Sum over the batch of f(tiles of element b), f returning an int64 (block-wide; lanes clamped so that a warp's
  // sum cannot wrap).
  auto batch_sum = [&](auto f) {
    int64_t mine = 0;
    for (int b = tid; b < p.batch; b += kThreads) mine += f(split_range_tiles<kBlockN, kAligned>(decode_range(p, b)));
    int part = int(min(mine, int64_t(INT32_MAX / 32)));
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) part += __shfl_xor_sync(0xffffffff, part, offset);
    if (tid % 32 == 0) scratch[tid / 32] = part;
    __syncthreads();
    int64_t total = 0;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
    __syncthreads();  // scratch is free again
    return total;
  };
  auto splits_of = [&](int64_t t, int64_t share) {  // a sequence's splits at a share (at least one)
    return min(int64_t(p.num_splits), max((t + share - 1) / share, int64_t(1)));
  };
  const int64_t total = batch_sum([](int t) { return int64_t(t); });
  const int64_t target = max(int64_t(p.batch) * p.num_splits / 2, int64_t(1));  // blocks per kv head
  int64_t share = max((total + target - 1) / target, int64_t(1));
  for (int round = 0; round < 4; ++round) {  // the first share fits unless rounding adds blocks; 1-2 rounds
    const int64_t count = batch_sum([&](int t) { return t > 0 ? splits_of(t, share) : int64_t(0); });
    if (count <= target) break;
    share = max(share + 1, (share * count + target - 1) / target);
  }
  return share;
}
template <int kBlockN, bool kAligned = false>
__device__ __forceinline__ SplitTiles split_of(const FlashParams& p, const DecodeRange& range, int split,
                                               int64_t share) {
  const int tiles = split_range_tiles<kBlockN, kAligned>(range);
  const int splits =
      share > 0 ? int(min(int64_t(p.num_splits), max((tiles + share - 1) / share, int64_t(1)))) : p.num_splits;
  const int per_split = (tiles + splits - 1) / splits;
  const int begin = split < splits ? split * per_split : tiles;
  return {begin, min(tiles, begin + per_split)};
}
// Both of the above in one call (every thread calls it, as split_share).
template <int kBlockN, int kThreads>
__device__ __forceinline__ SplitTiles split_tiles(const FlashParams& p, const DecodeRange& range, int split,
                                                  int* scratch, int tid) {
  return split_of<kBlockN>(p, range, split, split_share<kBlockN, kThreads>(p, scratch, tid));
}

// Partial outputs of split `split` for packed row r of kv head hk: O [split][b][t][h][d] float32, lse
// [split][b][h][t].
__device__ __forceinline__ float* split_o(const FlashParams& p, int split, int b, int hk, int r) {
  const int group = p.group_size();
  const int step = r / group, h = hk * group + r % group;
  const int64_t split_rows = int64_t(p.batch) * p.seqlen_q * p.heads_q;
  return p.o_partial + ((split * split_rows) + (int64_t(b) * p.seqlen_q + step) * p.heads_q + h) * p.head_dim;
}
__device__ __forceinline__ float* split_lse(const FlashParams& p, int split, int b, int hk, int r) {
  const int group = p.group_size();
  const int step = r / group, h = hk * group + r % group;
  const int64_t split_rows = int64_t(p.batch) * p.seqlen_q * p.heads_q;
  return p.lse_partial + split * split_rows + (int64_t(b) * p.heads_q + h) * p.seqlen_q + step;
}

// A split with no key tile, for packed rows [row_begin, row_end): weight 0 for each in the combine; with one split
// (no combine) their final result: O = 0, lse = +inf (a row that sees no key, as the combine kernels write
// it).
template <typename T>
__device__ __forceinline__ void mark_split_empty(const FlashParams& p, int split, int b, int hk, int row_begin,
                                                 int row_end, int tid, int threads) {
  if (p.num_splits > 1) {
    for (int r = row_begin + tid; r < row_end; r += threads) *split_lse(p, split, b, hk, r) = -INFINITY;
    return;
  }
  const int group = p.group_size();
  for (int i = tid; i < (row_end - row_begin) * p.head_dim; i += threads) {
    const int r = row_begin + i / p.head_dim, step = r / group, h = hk * group + r % group;
    static_cast<T*>(p.o)[((int64_t(b) * p.seqlen_q + step) * p.heads_q + h) * p.head_dim + i % p.head_dim] = T(0.f);
    if (i % p.head_dim == 0) p.lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + step] = INFINITY;
  }
}

// The pool row of a paged cache that holds key `key` of batch element b (thread i < kBlockN fetches a tile's key
// i's): its page-table entry clamped into the pool (nothing outside the cache is read, whatever the table holds)
// times the page size plus the key's place in its page; 0 past `hi`. The pool has fewer than 2^31 rows (checked by
// the handler).
// In two steps: page_table_entry loads the entry of key `key` (< the sequence's capacity), pool_row_of turns it
// into the pool row (a caller can issue the load well before it needs the value).
__device__ __forceinline__ int page_table_entry(const FlashParams& p, int b, int key) {
  const int index = p.page_shift >= 0 ? key >> p.page_shift : key / p.page_size;
  return p.page_table[int64_t(b) * p.max_pages + index];
}
__device__ __forceinline__ int pool_row_of(const FlashParams& p, int entry, int key) {
  const int page = min(max(entry, 0), p.num_pages - 1);
  const int in_page = p.page_shift >= 0 ? key & (p.page_size - 1) : key % p.page_size;
  return page * p.page_size + in_page;
}
__device__ __forceinline__ int fetch_pool_row(const FlashParams& p, int b, int key, int hi) {
  if (key >= hi) return 0;
  return pool_row_of(p, page_table_entry(p, b, key), key);
}

// The split kernels' dynamic shared memory: Q [kRows x kD], K and V [kStages][kBlockN x kD] (each in the kernel's
// operand layout), then the pool rows of the stages' keys [kStages][kBlockN] (int32; paged caches). Dynamic shared
// memory only: the tiles' swizzled addressing needs the base aligned (1024 bytes), which static shared memory placed
// before it would break.
template <typename T, typename Traits>
struct SplitSmem {
  static constexpr int kBytes = (Traits::kRows * Traits::kD + 2 * Traits::kStages * Traits::kBlockN * Traits::kD) *
                                    int(sizeof(T)) + Traits::kStages * Traits::kBlockN * 4;
  T* q;
  T* k;
  T* v;
  int (*pool_row)[Traits::kBlockN];
  __device__ __forceinline__ explicit SplitSmem(unsigned char* raw)
      : q(reinterpret_cast<T*>(raw)),
        k(q + Traits::kRows * Traits::kD),
        v(k + Traits::kStages * Traits::kBlockN * Traits::kD),
        pool_row(reinterpret_cast<int(*)[Traits::kBlockN]>(v + Traits::kStages * Traits::kBlockN * Traits::kD)) {}
  static_assert(Traits::kStages * Traits::kBlockN * Traits::kD * int(sizeof(T)) >= RankScratchInts(kRankMaxBatch) * 4,
                "batch_element's scratch lies in the K ring");
  __device__ __forceinline__ T* k_stage(int s) const { return k + s * Traits::kBlockN * Traits::kD; }
  __device__ __forceinline__ T* v_stage(int s) const { return v + s * Traits::kBlockN * Traits::kD; }
};

// One thread's cp.async copies of the block's kRows Q rows from packed row row_begin: packed row r is step r / G of
// query head hk G + r % G; rows past `rows` and columns past head_dim zero-filled.
template <typename T, typename Traits>
__device__ __forceinline__ void load_q_rows(T* sQ, const FlashParams& p, int b, int hk, int row_begin, int rows,
                                            int tid) {
  constexpr int kChunksPerRow = Traits::kD / kElems;
  const int group = p.group_size();
  const T* q = static_cast<const T*>(p.q);
  for (int c = tid; c < Traits::kRows * kChunksPerRow; c += Traits::kThreads) {
    const int i = c / kChunksPerRow, r = row_begin + i;
    const int col = (c % kChunksPerRow) * kElems;
    const bool pred = r < rows && col < p.head_dim;
    const int step = r / group, h = hk * group + r % group;
    const T* src = pred ? q + ((int64_t(b) * p.seqlen_q + step) * p.heads_q + h) * p.head_dim + col : q;
    cp_async_16(smem_addr(sQ + Traits::q_offset(i, col)), src, pred);
  }
}

// One thread's cp.async copies of K and V tiles (kBlockN x kD elements in 16-byte chunks): the thread copies column
// chunk tid % (kD / 8) of rows tid / (kD / 8) + j kRowStep, j < kPerThread, so its source column and the
// destinations' in-tile offsets are fixed per split and a tile costs one 64-bit row offset, a bound test and two
// copies per chunk. Keys at or past `hi` (and columns past head_dim) are zero-filled and read nothing (source size
// 0; their address is the thread's column of the first row, which for a padded head dim lies past D). Dense caches: row
// b S + key of the (B S, Hkv, D) cache; paged (kPaged): `pool_rows` (shared memory) holds the pool row of each of
// the tile's keys (fetch_pool_row: the lookup and clamp once per key, not per chunk). A split reads its keys' rows
// once: the copies mark their lines evict-first in L2 (l2_policy.cuh), except where Traits::kPagedKvEvictFirst says
// a paged kernel must not.
template <typename T, typename Traits, bool kPaged>
struct KVTileLoader {
  static constexpr int kChunksPerRow = Traits::kD / kElems;
  static constexpr int kRowStep = Traits::kThreads / kChunksPerRow;
  static constexpr int kPerThread = Traits::kBlockN / kRowStep;
  static_assert(Traits::kThreads % kChunksPerRow == 0 && Traits::kBlockN % kRowStep == 0);
  const T* k;          // this thread's column of kv head hk at cache row b S (paged: pool row 0)
  const T* v;
  int64_t row_stride;  // elements between cache rows
  int row0;            // the thread's first row in a tile
  int col;             // its column
  bool col_ok;         // the column lies inside head_dim

  static constexpr bool kEvictFirst = !kPaged || Traits::kPagedKvEvictFirst;

  __device__ __forceinline__ static void copy(uint32_t dst, const T* src, bool pred) {
    if constexpr (kEvictFirst) {
      cp_async_16(dst, src, pred, l2_evict_first_policy());
    } else {
      cp_async_16(dst, src, pred);
    }
  }

  __device__ __forceinline__ KVTileLoader(const FlashParams& p, int b, int hk, int tid) {
    row0 = tid / kChunksPerRow;
    col = (tid % kChunksPerRow) * kElems;
    col_ok = col < p.head_dim;
    row_stride = int64_t(p.heads_kv) * p.head_dim;
    const int64_t first = kPaged ? 0 : int64_t(b) * p.seqlen_k;
    k = static_cast<const T*>(p.k) + first * row_stride + int64_t(hk) * p.head_dim + col;
    v = static_cast<const T*>(p.v) + first * row_stride + int64_t(hk) * p.head_dim + col;
  }
  // The tile of keys [key0, key0 + kBlockN) into stage buffers sK, sV.
  __device__ __forceinline__ void load(T* sK, T* sV, const int* pool_rows, int key0, int hi) const {
    if constexpr (!kPaged) {
      if (key0 + Traits::kBlockN <= hi && col_ok) {  // every key in range (all tiles of a split but its last)
        // One 64-bit row offset per tile, then a fixed step per row (instead of a multiply, bound test and select
        // per copy pair: the 128-row wgmma kernel's loop issued ~100 integer instructions a tile for its copies).
        const int64_t step = int64_t(kRowStep) * row_stride;
        const int64_t off = int64_t(key0 + row0) * row_stride;
        const T* ks = k + off;
        const T* vs = v + off;
#pragma unroll
        for (int j = 0; j < kPerThread; ++j) {
          const int dst = Traits::kv_offset(row0 + j * kRowStep, col);
          copy(smem_addr(sK + dst), ks, true);
          copy(smem_addr(sV + dst), vs, true);
          ks += step;
          vs += step;
        }
        return;
      }
    }
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      const int i = row0 + j * kRowStep;
      const bool pred = col_ok && key0 + i < hi;
      const int64_t row = kPaged ? int64_t(pool_rows[i]) : int64_t(key0 + i);
      const int64_t off = pred ? row * row_stride : 0;  // nothing is read when !pred
      const int dst = Traits::kv_offset(i, col);
      copy(smem_addr(sK + dst), k + off, pred);
      copy(smem_addr(sV + dst), v + off, pred);
    }
  }
};

// Streams split tiles [tiles.begin, tiles.end) of batch element b, kv head hk through a kStages-deep cp.async ring: the
// block's Q rows (from packed row row_begin) ride in the first tile's copy group; compute(stage, key0) runs on every
// thread once the tile starting at key0 sits in stage `stage` (K in smem.k_stage(stage), V in smem.v_stage(stage)); the
// stage is rewritten once the computes of Traits::kReadLag later tiles have returned (so kStages - 1 - kReadLag tiles
// are in flight ahead of the one computed). Paged caches: the pool rows of a tile's keys sit in
// smem.pool_row[its stage] (thread i < kBlockN fetches key i's); the first kStages tiles' are read up front, each
// later tile's fetched into a register before the compute of the tile before the one that loads it and stored after
// that compute, so the table's latency hides behind it.
template <typename T, typename Traits, bool kPaged, typename Compute>
__device__ __forceinline__ void stream_split(const FlashParams& p, const DecodeRange& range, const SplitTiles& tiles,
                                             int b, int hk, int row_begin, int rows,
                                             const SplitSmem<T, Traits>& smem, int tid, Compute&& compute) {
  constexpr int kBN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kAhead = kStages - 1 - Traits::kReadLag;  // tiles loaded ahead of the one computed
  static_assert(kAhead >= 1);
  load_q_rows<T, Traits>(smem.q, p, b, hk, row_begin, rows, tid);  // in the first tile's cp.async group
  const KVTileLoader<T, Traits, kPaged> loader(p, b, hk, tid);
  auto tile_key0 = [&](int tile) { return range.lo + tile * kBN; };
  if (kPaged && tid < kBN) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      smem.pool_row[s][tid] = fetch_pool_row(p, b, tile_key0(tiles.begin + s) + tid, range.hi);
    }
  }
  __syncthreads();
  // Prologue: the first kAhead tiles in flight (one cp.async group each, empty past the split's end).
  sm90::PipelineState<kStages> read_state;  // the stage of the tile computed next
#pragma unroll
  for (int s = 0; s < kAhead; ++s) {
    if (tiles.begin + s < tiles.end) {
      loader.load(smem.k_stage(s), smem.v_stage(s), smem.pool_row[s], tile_key0(tiles.begin + s), range.hi);
    }
    cp_async_commit();
  }
  sm90::PipelineState<kStages> write_state = read_state.ahead(kAhead);
  for (int tile = tiles.begin; tile < tiles.end; ++tile) {
    cp_async_wait<kAhead - 1>();  // this tile's group (and Q) landed
    Traits::tile_landed();
    __syncthreads();  // ... for every thread; and every thread is done with the stage written next
    const int ahead = tile + kAhead;
    if (ahead < tiles.end) {
      const int w = write_state.slot();
      loader.load(smem.k_stage(w), smem.v_stage(w), smem.pool_row[w], tile_key0(ahead), range.hi);
    }
    cp_async_commit();
    write_state.advance();
    const int stage = read_state.slot();
    read_state.advance();
    // The pool rows of tile `ahead + 1`, for the stage it is loaded into (its previous tile's copies were issued
    // long before; stored after the compute below).
    const bool stash = kPaged && tid < kBN && ahead + 1 < tiles.end;
    const int next_row = stash ? fetch_pool_row(p, b, tile_key0(ahead + 1) + tid, range.hi) : 0;
    compute(stage, tile_key0(tile));
    if (stash) smem.pool_row[write_state.slot()][tid] = next_row;  // published by the next iteration's barrier
  }
  cp_async_wait<0>();
}

// One warp's online-softmax step over kNTiles m16n8 accumulator tiles of scores, s[4 nt + 2 rr + e] for row g + 8 rr
// of the warp's 16 and key key0 + 8 nt + 2 t + e (lane = 4 g + t): soft cap (kSoftCap), the rows' visible keys
// [lo[rr], hi[rr]) (kMasked), the running max (raw logits) and this lane's partial sum move on; s becomes exp2
// values. Returns the factors that rescale O's rows.
template <int kNTiles, bool kMasked, bool kSoftCap>
__device__ __forceinline__ void softmax_step(float* s, int key0, int t, const int (&lo)[2], const int (&hi)[2],
                                             const SoftCap& cap, float scale_log2, float (&row_max)[2],
                                             float (&row_sum)[2], float (&correction)[2]) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float mx = row_max[rr];
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float x = s[4 * nt + 2 * rr + e];
        if constexpr (kSoftCap) x = cap.apply(x);
        if constexpr (kMasked) {
          const int key = key0 + nt * 8 + 2 * t + e;
          x = key >= lo[rr] && key < hi[rr] ? x : -INFINITY;
        }
        s[4 * nt + 2 * rr + e] = x;
        mx = fmaxf(mx, x);
      }
    }
    mx = quad_max(mx);
    const float max_scaled = mx == -INFINITY ? 0.f : mx * scale_log2;
    // Exactly 1 when the max did not move (exp2 of the fused multiply-add's rounding residue is not: ex2.approx
    // returns 1 -+ an ulp there), so that the callers can skip the rescale of O.
    correction[rr] = mx == row_max[rr] ? 1.f : exp2f(row_max[rr] * scale_log2 - max_scaled);
    row_max[rr] = mx;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pe = exp2f(s[4 * nt + 2 * rr + e] * scale_log2 - max_scaled);
        s[4 * nt + 2 * rr + e] = pe;
        sum += pe;
      }
    }
    row_sum[rr] = row_sum[rr] * correction[rr] + sum;
  }
}

// Whether O's rows need the corrections softmax_step returned: some row of the warp had its max move (otherwise both
// corrections are exactly 1 in every lane). Warp-uniform, so that the callers skip the kD / 2 multiplies together
// (FlashAttention-4's conditional rescale, without its threshold: exact).
__device__ __forceinline__ bool warp_rows_rescale(const float (&correction)[2]) {
  return !__all_sync(0xffffffffu, correction[0] == 1.f && correction[1] == 1.f);
}

// softmax_step without mask code when every row of the warp sees all of keys [key0, key0 + 8 kNTiles) (a decision
// the whole warp takes: most tiles of a long cache), with it otherwise.
template <int kNTiles, bool kSoftCap>
__device__ __forceinline__ void softmax_tile(float* s, int key0, int t, const int (&lo)[2], const int (&hi)[2],
                                             const SoftCap& cap, float scale_log2, float (&row_max)[2],
                                             float (&row_sum)[2], float (&correction)[2]) {
  const bool visible = key0 >= max(lo[0], lo[1]) && key0 + 8 * kNTiles <= min(hi[0], hi[1]);
  if (__all_sync(0xffffffffu, visible)) {
    softmax_step<kNTiles, false, kSoftCap>(s, key0, t, lo, hi, cap, scale_log2, row_max, row_sum, correction);
  } else {
    softmax_step<kNTiles, true, kSoftCap>(s, key0, t, lo, hi, cap, scale_log2, row_max, row_sum, correction);
  }
}

// A warp's rows of the split's result, from O accumulator tiles o[4 dt + 2 rr + e] (row row0 + g + 8 rr, column
// 8 dt + 2 t + e) and the rows' max and (quad-summed) sum. Several splits: O / sum (float32) and lse into the partial
// results, lse -inf for a row that saw no key here (weight 0 in the combine). One split: the final O (in T) and lse
// with the sink, as the combine kernels compute them from one split (no combine runs). The final O leaves in
// 16-byte stores: a quad's four 4-byte pairs of column tile dt (16 contiguous bytes of the row) are transposed
// across the quad (two shuffle rounds per four tiles), so lane t stores tiles 4 j + t whole and a warp's store
// writes whole 32-byte sectors (each lane's own 4-byte pairs left half sectors, twice the L2 requests).
template <typename T, int kDTiles>
__device__ __forceinline__ void store_split_rows(const FlashParams& p, int split, int b, int hk, int rows, int row0,
                                                 int g, int t, const float* o, const float (&row_max)[2],
                                                 const float (&row_sum)[2]) {
  static_assert(kDTiles % 4 == 0, "the final O's quad transpose takes column tiles four at a time");
  const bool final = p.num_splits == 1;
  const int group = p.group_size();
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = row0 + g + 8 * rr;
    const float sum = row_sum[rr];
    const bool row_ok = r < rows;
    const bool some = sum > 0.f || sum != sum;  // nan (a nan or +inf logit) stays nan
    const float inv = some ? 1.f / sum : 0.f;
    const float lse = some ? row_max[rr] * p.scale + logf(sum) : -INFINITY;
    if (!final) {
      if (!row_ok) continue;
      float* out = split_o(p, split, b, hk, r) + 2 * t;
      auto store = [&](int dt) {
        *reinterpret_cast<float2*>(out + dt * 8) = make_float2(o[4 * dt + 2 * rr] * inv, o[4 * dt + 2 * rr + 1] * inv);
      };
      // A whole head dim (the usual case) stores every column tile without a test and branch each: this code runs
      // once per block, after the stream, and its instructions are fetched cold then (NOTES, session 68).
      if (p.head_dim == kDTiles * 8) {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) store(dt);
      } else {
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          if (dt * 8 + 2 * t < p.head_dim) store(dt);
        }
      }
      if (t == 0) *split_lse(p, split, b, hk, r) = lse;
      continue;
    }
    // One split: every lane of the warp runs the shuffles below (rows past `rows` store nothing).
    const int step = r / group, h = hk * group + r % group;
    const float sink = p.sinks != nullptr && row_ok ? p.sinks[int64_t(b) * p.heads_q + h] : -INFINITY;
    float scale = 0.f, lse_out = INFINITY;  // a row that sees no key: O = 0, lse = +inf
    if (lse != -INFINITY) {
      const float m = fmaxf(lse, sink);
      const float w = expf(lse - m);
      float total = w + (sink == -INFINITY ? 0.f : expf(sink - m));
      if (lse != lse) total = NAN;
      scale = inv * w / total;
      lse_out = m + logf(total);
    }
    T* out = static_cast<T*>(p.o) + (row_ok ? ((int64_t(b) * p.seqlen_q + step) * p.heads_q + h) * p.head_dim : 0);
    const bool odd = t & 1, high = t & 2;
#pragma unroll
    for (int j = 0; j < kDTiles / 4; ++j) {
      uint32_t x[4];  // this lane's pairs of column tiles 4 j .. 4 j + 3
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int dt = 4 * j + k;
        x[k] = ElemTraits<T>::pack(o[4 * dt + 2 * rr] * scale, o[4 * dt + 2 * rr + 1] * scale);
      }
      // Quad transpose: afterwards lane t holds lane 0..3's pairs of tile 4 j + t, in column order.
      uint32_t r0 = __shfl_xor_sync(0xffffffffu, odd ? x[0] : x[1], 1);
      uint32_t r1 = __shfl_xor_sync(0xffffffffu, odd ? x[2] : x[3], 1);
      uint32_t y[4] = {odd ? r0 : x[0], odd ? x[1] : r0, odd ? r1 : x[2], odd ? x[3] : r1};
      r0 = __shfl_xor_sync(0xffffffffu, high ? y[0] : y[2], 2);
      r1 = __shfl_xor_sync(0xffffffffu, high ? y[1] : y[3], 2);
      const uint4 z = high ? make_uint4(r0, r1, y[2], y[3]) : make_uint4(y[0], y[1], r0, r1);
      const int col = (4 * j + t) * 8;
      if (row_ok && col < p.head_dim) *reinterpret_cast<uint4*>(out + col) = z;
    }
    if (row_ok && t == 0) p.lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + step] = lse_out;
  }
}

}  // namespace jax_flash::cuda::decode
