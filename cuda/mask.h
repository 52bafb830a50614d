// Attention masks as small policy structs, shared by the CPU and CUDA kernels.
//
// Every mask jax.nn.dot_product_attention can express without a dense array (causal, local window, query and
// key/value lengths) leaves each query row i a contiguous interval of visible keys [lo(i), hi(i)) whose ends never
// decrease as i grows. Rows and keys are local indices; when a call holds a part of a longer sequence (sharding,
// ring attention), local row i is global position i + q_offset and local key j global position j + kv_offset, and
// the masks apply to global positions: causal and window masks through the diagonal shift q_offset - kv_offset,
// lengths (global) through the local lengths mask_for_batch derives. Each policy below exposes the same hooks:
//   lo(i), hi(i)          visible keys of row i are [lo(i), hi(i)); empty when hi(i) <= lo(i)
//   first_row(c)          the smallest row that can see key c or a later key
//   last_row(c)           one past the largest row that can see a key below c
// and AttentionMask intersects them. Kernels ask the composite for the key blocks a query block needs (forward),
// the query rows a key block needs (backward), and whether a tile (or which run of key blocks) is entirely
// visible (no per-element masking).
//
// Segment ids (packed sequences) are the one mask that is not an interval: row i sees key j only if
// q_ids[i] == kv_ids[j]. SegmentPolicy narrows the block ranges above with per-16-position chunk metadata (the id
// range of each chunk, and the keys / rows whose chunks' id ranges meet it: no static number of segments), calls a
// tile fully visible only when every id in it is one value, and leaves the kernels one per-element test (same()).
// Packed training data usually has a simpler shape: each id is one contiguous run of positions, in the same order for
// queries and keys. Then row i sees exactly the keys of its own run, an interval whose ends never decrease with i, and
// RunPolicy hands the kernels the ids as that interval (per-row bounds from the segment_operands target): they take
// such a batch element as they take a window, with whole runs of unmasked key tiles and no id tests at all.
#pragma once

#include <climits>
#include <cstdint>
#include <type_traits>

#include "flash_params.h"  // JF_HD

namespace jax_flash {

JF_HD int imin(int a, int b) { return a < b ? a : b; }
JF_HD int imax(int a, int b) { return a > b ? a : b; }

// Key j visible to query i iff j <= i + shift (jax.nn: top-left aligned tril at global positions).
struct CausalPolicy {
  bool enabled;
  int shift;
  JF_HD int lo(int) const { return 0; }
  JF_HD int hi(int i) const { return enabled ? i + shift + 1 : INT_MAX; }
  // Smallest row that sees key c (rows seeing key c or later keys start here).
  JF_HD int first_row(int c) const { return enabled ? c - shift : 0; }
  // One past the largest row that sees a key below c.
  JF_HD int last_row(int) const { return INT_MAX; }
};

// Key j visible to query i iff i + shift - left <= j <= i + shift + right; a negative bound is unbounded.
struct WindowPolicy {
  int left;
  int right;
  int shift;
  JF_HD int lo(int i) const { return left >= 0 ? i + shift - left : 0; }
  JF_HD int hi(int i) const { return right >= 0 ? i + shift + right + 1 : INT_MAX; }
  JF_HD int first_row(int c) const { return right >= 0 ? c - shift - right : 0; }
  JF_HD int last_row(int c) const { return left >= 0 ? c - shift + left : INT_MAX; }
};

// Keys >= kv_len are masked; rows >= q_len see nothing (their output is zero).
struct LengthPolicy {
  int q_len;
  int kv_len;
  JF_HD int lo(int) const { return 0; }
  JF_HD int hi(int) const { return kv_len; }
  JF_HD int first_row(int) const { return 0; }
  JF_HD int last_row(int) const { return q_len; }
};

// Row i sees key j only if q_ids[i] == kv_ids[j] (disabled when q_ids is null). Chunk c of the query rows (rows
// [16 c, 16 c + 16)) has metadata q_meta[4 c ..]: {id min, id max, first key, end key}, the keys [first, end) being
// the hull of the key chunks whose id ranges meet the chunk's; kv_meta likewise for key chunks, with rows. Built by
// the segment_operands target (segment_operands.h). Callers pass rows below seqlen_q and keys below seqlen_k to same().
inline constexpr int kSegmentChunk = 16;
struct SegmentPolicy {
  const int32_t* q_ids = nullptr;  // [seqlen_q] of one batch element
  const int32_t* kv_ids = nullptr;  // [seqlen_k]
  const int32_t* q_meta = nullptr;  // [ceil(seqlen_q / 16)][4]
  const int32_t* kv_meta = nullptr;  // [ceil(seqlen_k / 16)][4]
  int q_chunks = 0;
  int kv_chunks = 0;

  JF_HD bool enabled() const { return q_ids != nullptr; }
  JF_HD bool same(int i, int j) const { return q_ids[i] == kv_ids[j]; }
  // The hull, over the chunks meeting [begin, end) (clamped to the `chunks` there are), of meta fields f, f + 1:
  // [*lo, *hi) (empty when end <= begin).
  JF_HD static void hull(const int32_t* meta, int chunks, int begin, int end, int f, int* lo, int* hi) {
    *lo = INT_MAX;
    *hi = INT_MIN;
    const int c1 = imin((end + kSegmentChunk - 1) / kSegmentChunk, chunks);
    for (int c = imax(begin, 0) / kSegmentChunk; c < c1; ++c) {
      *lo = imin(*lo, meta[4 * c + f]);
      *hi = imax(*hi, meta[4 * c + f + 1]);
    }
  }
#if defined(__CUDACC__)
  // hull() by the lanes of a warp that call it together with the same arguments (__activemask(): a thread alone
  // works too), a chunk per lane and round: one load deep where hull() walks the chunks one after another (a
  // kernel's block ranges sit on the path to its first load).
  __device__ __forceinline__ static void hull_lanes(const int32_t* meta, int chunks, int begin, int end, int f, int* lo,
                                                    int* hi) {
    const unsigned active = __activemask();
    const int lanes = __popc(active);
    const int rank = __popc(active & ((1u << (threadIdx.x % 32)) - 1u));
    int l = INT_MAX, h = INT_MIN;
    const int c1 = imin((end + kSegmentChunk - 1) / kSegmentChunk, chunks);
    for (int c = imax(begin, 0) / kSegmentChunk + rank; c < c1; c += lanes) {
      const int2 range = *reinterpret_cast<const int2*>(meta + 4 * c + f);
      l = imin(l, range.x);
      h = imax(h, range.y);
    }
    *lo = __reduce_min_sync(active, l);
    *hi = __reduce_max_sync(active, h);
  }
#endif
  // Keys that some row of [row_begin, row_end) may see: [*key_begin, *key_end) (a superset). kLanes: the lanes that
  // call together pass the same arguments (hull_lanes), device code only.
  template <bool kLanes = false>
  JF_HD void key_range(int row_begin, int row_end, int* key_begin, int* key_end) const {
#if defined(__CUDA_ARCH__)
    if constexpr (kLanes) return hull_lanes(q_meta, q_chunks, row_begin, row_end, 2, key_begin, key_end);
#endif
    hull(q_meta, q_chunks, row_begin, row_end, 2, key_begin, key_end);
  }
  // Rows that may see some key of [key_begin, key_end) (kLanes as for key_range).
  template <bool kLanes = false>
  JF_HD void row_range(int key_begin, int key_end, int* row_begin, int* row_end) const {
#if defined(__CUDA_ARCH__)
    if constexpr (kLanes) return hull_lanes(kv_meta, kv_chunks, key_begin, key_end, 2, row_begin, row_end);
#endif
    hull(kv_meta, kv_chunks, key_begin, key_end, 2, row_begin, row_end);
  }
  // True when every row of [row_begin, row_end) and every key of [key_begin, key_end) has one and the same id.
  JF_HD bool uniform(int row_begin, int row_end, int key_begin, int key_end) const {
    int qlo, qhi, klo, khi;
    hull(q_meta, q_chunks, row_begin, row_end, 0, &qlo, &qhi);
    hull(kv_meta, kv_chunks, key_begin, key_end, 0, &klo, &khi);
    return qlo == qhi && klo == khi && qlo == klo;
  }
#if defined(__CUDACC__)
  // uniform() by a whole warp (every lane calls it with the same arguments): lanes 0-15 read a query chunk's id
  // range each, lanes 16-31 a key chunk's, and two warp reductions compare them, one load deep instead of a serial
  // walk over the chunks (a kernel's tile check sits between its S product and the softmax). Spans of more than
  // 16 chunks a side take uniform().
  __device__ __forceinline__ bool uniform_warp(int row_begin, int row_end, int key_begin, int key_end) const {
    const int q0 = imax(row_begin, 0) / kSegmentChunk;
    const int q1 = imin((row_end + kSegmentChunk - 1) / kSegmentChunk, q_chunks);
    const int k0 = imax(key_begin, 0) / kSegmentChunk;
    const int k1 = imin((key_end + kSegmentChunk - 1) / kSegmentChunk, kv_chunks);
    if (q1 <= q0 || k1 <= k0) return false;  // as uniform(): an empty side is not uniform
    if (q1 - q0 > 16 || k1 - k0 > 16) return uniform(row_begin, row_end, key_begin, key_end);
    const int lane = threadIdx.x % 32;
    const int c = lane < 16 ? q0 + lane : k0 + lane - 16;
    int lo = INT_MAX, hi = INT_MIN;
    if (c < (lane < 16 ? q1 : k1)) {
      const int2 range = *reinterpret_cast<const int2*>((lane < 16 ? q_meta : kv_meta) + 4 * c);  // {min, max}
      lo = range.x;
      hi = range.y;
    }
    return __reduce_min_sync(0xffffffffu, lo) == __reduce_max_sync(0xffffffffu, hi);
  }
#endif
};

// Segment ids whose every id is one contiguous run of positions on each side, the runs in the same order (checked
// per batch element by the segment_operands target): row i sees key j only if j lies in [q_run[i].x, q_run[i].y),
// the keys whose id is row i's, and key j is seen only by rows [kv_run[j].x, kv_run[j].y). Both bounds never
// decrease along the positions, so this is an interval policy like the ones above and replaces SegmentPolicy for
// such a batch element (disabled when q_run is null). Arrays of {x, y} int32 pairs. AttentionMask asks with its
// lengths as the bound n: a row at or past q_len (a key at or past kv_len) reads the last valid pair, whose value
// the other masks then discard (no pointers past the policy's two: the sm_90a forward's consumers have no register
// to spare).
struct RunPolicy {
  const int32_t* q_run = nullptr;  // [seqlen_q][2] of one batch element
  const int32_t* kv_run = nullptr;  // [seqlen_k][2]

  JF_HD bool enabled() const { return q_run != nullptr; }
  // Pair i of `run` (i clamped to [0, n), n <= the array's length; index 0 when n <= 0): one 8-byte load on the
  // device.
  JF_HD static void pair(const int32_t* run, int i, int n, int* x, int* y) {
    i = imax(imin(i, n - 1), 0);
#if defined(__CUDA_ARCH__)
    const int2 v = *reinterpret_cast<const int2*>(run + 2 * i);
    *x = v.x;
    *y = v.y;
#else
    *x = run[2 * i];
    *y = run[2 * i + 1];
#endif
  }
  JF_HD void keys_of_row(int i, int q_len, int* lo, int* hi) const { pair(q_run, i, q_len, lo, hi); }
  JF_HD void rows_of_key(int j, int kv_len, int* lo, int* hi) const { pair(kv_run, j, kv_len, lo, hi); }
  // The smallest row that sees key c or a later key (0 <= c < kv_len).
  JF_HD int first_row(int c, int kv_len) const {
    int lo, hi;
    rows_of_key(c, kv_len, &lo, &hi);
    return lo;
  }
  // One past the largest row that sees a key below c (c <= kv_len).
  JF_HD int last_row(int c, int kv_len) const {
    if (c <= 0) return 0;
    int lo, hi;
    rows_of_key(c - 1, kv_len, &lo, &hi);
    return hi;
  }
};

// True when batch element b's segment ids are contiguous runs (RunPolicy): the segment_operands target marks a batch
// element whose ids are not with -1 in its first row's first bound.
JF_HD bool segment_runs_exact(const FlashParams& p, int b) {
  return p.q_segment_runs != nullptr && p.q_segment_runs[int64_t(b) * p.seqlen_q * 2] >= 0;
}

// How a tile has to be masked: not at all; by the intervals alone (no segment ids, or every id in the tile one
// value); or per element, segment ids included.
enum class TileMasking { kNone, kInterval, kIds };

struct AttentionMask {
  CausalPolicy causal;
  WindowPolicy window;
  LengthPolicy length;
  SegmentPolicy segments;
  RunPolicy runs;

  // shift: the global position of local row 0 minus that of local key 0 (0 for a whole sequence).
  JF_HD AttentionMask(bool is_causal, int window_left, int window_right, int q_len, int kv_len, int shift = 0,
                      SegmentPolicy seg = SegmentPolicy{}, RunPolicy run = RunPolicy{})
      : causal{is_causal, shift},
        window{window_left, window_right, shift},
        length{q_len, kv_len},
        segments(seg),
        runs(run) {}

  JF_HD bool row_valid(int i) const { return i < length.q_len; }
  // lo(i), hi(i): the interval the masks other than segment ids (SegmentPolicy) leave row i.
  JF_HD int lo(int i) const {
    int l = imax(imax(causal.lo(i), window.lo(i)), imax(length.lo(i), 0));
    if (runs.enabled()) {
      int rl, rh;
      runs.keys_of_row(i, length.q_len, &rl, &rh);
      l = imax(l, rl);
    }
    return l;
  }
  JF_HD int hi(int i) const {
    if (!row_valid(i)) return 0;
    int h = imin(imin(causal.hi(i), window.hi(i)), length.hi(i));
    if (runs.enabled()) {
      int rl, rh;
      runs.keys_of_row(i, length.q_len, &rl, &rh);
      h = imin(h, rh);
    }
    return h;
  }
  JF_HD bool visible(int i, int j) const {
    return j >= lo(i) && j < hi(i) && (!segments.enabled() || segments.same(i, j));
  }
  // Rows that key j's interval admits, the transpose of lo()/hi(): *row_lo <= i < *row_hi (segment ids are
  // tested apart, with segments.same()).
  JF_HD void rows_seeing_key(int j, int* row_lo, int* row_hi) const {
    *row_lo = imax(causal.enabled ? j - causal.shift : 0, window.right >= 0 ? j - window.shift - window.right : 0);
    *row_lo = imax(*row_lo, 0);
    *row_hi = imin(length.q_len, window.left >= 0 ? j - window.shift + window.left + 1 : INT_MAX);
    if (runs.enabled()) {
      int rl, rh;
      runs.rows_of_key(j, length.kv_len, &rl, &rh);
      *row_lo = imax(*row_lo, rl);
      *row_hi = imin(*row_hi, rh);
    }
    if (j < 0 || j >= length.kv_len) *row_hi = *row_lo;
  }

  // Keys that any row of [row_begin, row_end) can see: [*key_begin, *key_end) (empty if end <= begin). kLanes: as
  // for SegmentPolicy::key_range.
  template <bool kLanes = false>
  JF_HD void key_range(int row_begin, int row_end, int* key_begin, int* key_end) const {
    const int last = imin(row_end, length.q_len) - 1;
    if (last < row_begin) {
      *key_begin = 0;
      *key_end = 0;
      return;
    }
    *key_begin = lo(row_begin);
    *key_end = hi(last);
    if (segments.enabled()) {
      int b, e;
      segments.template key_range<kLanes>(row_begin, last + 1, &b, &e);
      *key_begin = imax(*key_begin, b);
      *key_end = imin(*key_end, e);
    }
  }

  // One past the last key that the causal, window and length masks let some row of [row_begin, row_end) see (0 if
  // no row is valid): an end of key_range's keys that reads no memory (segment ids and runs only take keys away).
  JF_HD int interval_key_end(int row_begin, int row_end) const {
    const int last = imin(row_end, length.q_len) - 1;
    return last < row_begin ? 0 : imin(imin(causal.hi(last), window.hi(last)), length.hi(last));
  }

  // Rows that can see some key of [key_begin, key_end): [*row_begin, *row_end) (kLanes as for key_range).
  template <bool kLanes = false>
  JF_HD void row_range(int key_begin, int key_end, int* row_begin, int* row_end) const {
    if (key_begin >= length.kv_len) {
      *row_begin = 0;
      *row_end = 0;
      return;
    }
    *row_begin = imax(imax(causal.first_row(key_begin), window.first_row(key_begin)), 0);
    *row_end = imin(imin(causal.last_row(key_end), window.last_row(key_end)), length.last_row(key_end));
    if (runs.enabled()) {
      *row_begin = imax(*row_begin, runs.first_row(imax(key_begin, 0), length.kv_len));
      *row_end = imin(*row_end, runs.last_row(imin(key_end, length.kv_len), length.kv_len));
    }
    if (segments.enabled()) {
      int b, e;
      segments.template row_range<kLanes>(key_begin, imin(key_end, length.kv_len), &b, &e);
      *row_begin = imax(*row_begin, b);
      *row_end = imin(*row_end, e);
    }
  }

  // True when every (row, key) of the tile with row < row_limit is visible, so the kernel may skip per-element
  // masking. row_limit is the number of rows the kernel stores (seqlen_q); rows past it are never written.
  JF_HD bool tile_fully_visible(int row_begin, int row_end, int key_begin, int key_end, int row_limit) const {
    return intervals_cover(row_begin, row_end, key_begin, key_end, row_limit) &&
           (!segments.enabled() ||
            segments.uniform(row_begin, imin(row_end, row_limit), key_begin, key_end));
  }
  // The interval masks' part of tile_fully_visible: every row below row_limit sees the whole key range.
  JF_HD bool intervals_cover(int row_begin, int row_end, int key_begin, int key_end, int row_limit) const {
    const int last = imin(row_end, row_limit) - 1;
    if (last >= length.q_len) return false;
    return lo(last) <= key_begin && hi(row_begin) >= key_end;
  }
#if defined(__CUDACC__)
  // What the tile needs (tile_fully_visible's question, split by mask kind), asked by a whole warp with the same
  // arguments in every lane (SegmentPolicy::uniform_warp). The sm_90a forward asks before it waits for the tile's
  // scores, so the id loads overlap the product (the backward asks after, where that spilled less).
  __device__ __forceinline__ TileMasking tile_masking_warp(int row_begin, int row_end, int key_begin, int key_end,
                                                           int row_limit) const {
    if (segments.enabled() && !segments.uniform_warp(row_begin, imin(row_end, row_limit), key_begin, key_end)) {
      return TileMasking::kIds;
    }
    return intervals_cover(row_begin, row_end, key_begin, key_end, row_limit) ? TileMasking::kNone
                                                                               : TileMasking::kInterval;
  }
#endif

  // Key blocks of block_n keys, among blocks [n_begin, n_end), that every row of [row_begin, row_end) below
  // row_limit sees entirely (tile_fully_visible for each): [*full_begin, *full_end), inside [n_begin, n_end),
  // empty when *full_end == *full_begin. Blocks outside it need per-element masking. The range is contiguous
  // because lo() and hi() never decrease.
  JF_HD void unmasked_blocks(int row_begin, int row_end, int row_limit, int block_n, int n_begin, int n_end,
                             int* full_begin, int* full_end) const {
    const int last = imin(row_end, row_limit) - 1;
    if (last < row_begin || last >= length.q_len || segments.enabled()) {  // segments: tile_fully_visible per tile
      *full_begin = *full_end = n_end;
      return;
    }
    *full_begin = imin(imax((lo(last) + block_n - 1) / block_n, n_begin), n_end);  // lo() >= 0
    *full_end = imax(imin(hi(row_begin) / block_n, n_end), *full_begin);
  }
};

// The decode kernels' mask over packed query rows (query heads per kv head x Tq, row r = step r / group of query
// head hk * group + r % group): every step is a row of `steps`, an AttentionMask over Tq rows whose diagonal is
// shifted to the bottom right (step t at position kv_len - Tq + t), and packed row r takes the keys of step
// r / group. The hooks are the ones the sm_90a forward's main loop asks (lo, hi, tile_masking_warp,
// unmasked_blocks, segments), with its row limit (FlashParams::seqlen_q, Tq for decode) counted in steps: rows at
// or past step_limit x group, padding of the tile, see nothing and never force masking. Since r / group never
// decreases with r, lo() and hi() never decrease either.
struct PackedRowsMask {
  AttentionMask steps;
  int group;
  SegmentPolicy segments;  // none: decode has no segment ids

  JF_HD int lo(int r) const { return steps.lo(r / group); }
  JF_HD int hi(int r) const { return steps.hi(r / group); }
  // Every packed row of [row_begin, row_end) below step_limit x group sees all of [key_begin, key_end) (true when
  // there is no such row).
  JF_HD bool intervals_cover(int row_begin, int row_end, int key_begin, int key_end, int step_limit) const {
    const int last = imin(row_end, step_limit * group) - 1;
    if (last < row_begin) return true;
    return steps.intervals_cover(row_begin / group, last / group + 1, key_begin, key_end, steps.length.q_len);
  }
  JF_HD TileMasking tile_masking_warp(int row_begin, int row_end, int key_begin, int key_end, int step_limit) const {
    return intervals_cover(row_begin, row_end, key_begin, key_end, step_limit) ? TileMasking::kNone
                                                                                : TileMasking::kInterval;
  }
  JF_HD void unmasked_blocks(int row_begin, int row_end, int step_limit, int block_n, int n_begin, int n_end,
                             int* full_begin, int* full_end) const {
    const int last = imin(row_end, step_limit * group) - 1;
    if (last < row_begin) {
      *full_begin = n_begin;
      *full_end = n_end;
      return;
    }
    steps.unmasked_blocks(row_begin / group, last / group + 1, steps.length.q_len, block_n, n_begin, n_end,
                          full_begin, full_end);
  }
};

// Decode's mask of batch element b (FlashParams' decode fields: seqlen_q is Tq, kv_lens the valid keys clamped to
// the capacity seqlen_k): the steps at positions kv_len - Tq + t, with the window bounds mask_for_batch would
// leave them. Row r of `group` packed rows per step.
JF_HD PackedRowsMask decode_mask_for_batch(const FlashParams& p, int b) {
  const int kv_len = imin(imax(p.kv_lens[b], 0), p.seqlen_k);
  const int q_len = p.seqlen_q;
  const int shift = kv_len - q_len;
  const int left = p.window_left >= 0 && q_len - 1 + shift - p.window_left <= 0 ? -1 : p.window_left;
  const int right = p.window_right >= 0 && shift + p.window_right >= kv_len - 1 ? -1 : p.window_right;
  return PackedRowsMask{AttentionMask(p.causal, left, right, q_len, kv_len, shift), p.group_size(), SegmentPolicy{}};
}

// How a mask takes a call's segment ids: not at all (kNone, for a caller launched only when the call has none);
// as ids (kIds: SegmentPolicy); as runs (kRuns: RunPolicy, for a batch element whose ids segment_runs_exact says
// are runs); or as runs where they are and as ids elsewhere (kAuto).
enum class SegmentMode { kNone, kIds, kRuns, kAuto };

// The mask of batch element b in local indices: the global lengths less the offsets, clamped to [0, seqlen]; the
// diagonal shifted by q_offset - kv_offset. A window side that no (row, key) pair of the call can reach becomes
// unbounded, so such calls take the kernels' unmasked paths. The segment ids as kMode says (none if the call has
// none). A fixed kMode lets a kernel compile only its policy's tests: the other policy's pointers stay null at
// compile time (the ids' pointers and chunk counts live across a main loop spilled the sm_90a d128 kernels by
// 112-460 bytes).
template <SegmentMode kMode = SegmentMode::kIds>
JF_HD AttentionMask mask_for_batch(const FlashParams& p, int b) {
  const int q_off = p.q_offsets[b];
  const int kv_off = p.kv_offsets[b];
  const int q_len = imin(imax(p.q_lens[b] - q_off, 0), p.seqlen_q);
  const int kv_len = imin(imax(p.kv_lens[b] - kv_off, 0), p.seqlen_k);
  const int shift = q_off - kv_off;
  // Row i >= 0's window starts at i + shift - left: at or below key 0 for every row below q_len when
  // q_len - 1 + shift - left <= 0; it ends at i + shift + right, at or past the last key for every row when
  // shift + right >= kv_len - 1.
  const int left = p.window_left >= 0 && q_len - 1 + shift - p.window_left <= 0 ? -1 : p.window_left;
  const int right = p.window_right >= 0 && shift + p.window_right >= kv_len - 1 ? -1 : p.window_right;
  SegmentPolicy seg;
  RunPolicy run;
  if (kMode != SegmentMode::kNone && p.q_segment_ids != nullptr) {
    const bool runs = kMode == SegmentMode::kRuns || (kMode == SegmentMode::kAuto && segment_runs_exact(p, b));
    if (runs) {
      run.q_run = p.q_segment_runs + int64_t(b) * p.seqlen_q * 2;
      run.kv_run = p.kv_segment_runs + int64_t(b) * p.seqlen_k * 2;
    } else {
      seg.q_chunks = (p.seqlen_q + kSegmentChunk - 1) / kSegmentChunk;
      seg.kv_chunks = (p.seqlen_k + kSegmentChunk - 1) / kSegmentChunk;
      seg.q_ids = p.q_segment_ids + int64_t(b) * p.seqlen_q;
      seg.kv_ids = p.kv_segment_ids + int64_t(b) * p.seqlen_k;
      seg.q_meta = p.q_segment_meta + int64_t(b) * seg.q_chunks * 4;
      seg.kv_meta = p.kv_segment_meta + int64_t(b) * seg.kv_chunks * 4;
    }
  }
  return AttentionMask(p.causal, left, right, q_len, kv_len, shift, seg, run);
}

#if defined(__CUDACC__)
// For a kernel launched with kSegments exactly when the call has segment ids (the sm_90a kernels): calls
// fn(mode) with mode a std::integral_constant<SegmentMode, ...>: kNone without ids, else kRuns or kIds as batch
// element b's ids are runs or not. fn's body is compiled once per mode, so each copy carries one policy's code only.
template <bool kSegments, typename Fn>
__device__ __forceinline__ void with_segment_mode(const FlashParams& p, int b, Fn&& fn) {
  using Mode = SegmentMode;
  if constexpr (!kSegments) {
    fn(std::integral_constant<Mode, Mode::kNone>{});
  } else if (segment_runs_exact(p, b)) {
    fn(std::integral_constant<Mode, Mode::kRuns>{});
  } else {
    fn(std::integral_constant<Mode, Mode::kIds>{});
  }
}

// For a kernel compiled for one segment mode and launched once per mode (the sm_90a forward's persistent grids):
// whether it takes batch element b (kNone: every one).
template <SegmentMode kMode>
JF_HD bool segment_mode_takes(const FlashParams& p, int b) {
  if constexpr (kMode == SegmentMode::kRuns) return segment_runs_exact(p, b);
  if constexpr (kMode == SegmentMode::kIds) return !segment_runs_exact(p, b);
  return true;
}

// mask_for_batch in a kernel compiled for one segment mode (with_segment_mode's fn, or segment_mode_takes): there the
// compiler may also take the mode's policy as enabled, so its tests carry no null checks (the other policy's fold
// away).
template <SegmentMode kMode>
__device__ __forceinline__ AttentionMask kernel_mask_for_batch(const FlashParams& p, int b) {
  const AttentionMask mask = mask_for_batch<kMode>(p, b);
  if constexpr (kMode == SegmentMode::kIds) __builtin_assume(mask.segments.q_ids != nullptr);
  if constexpr (kMode == SegmentMode::kRuns) __builtin_assume(mask.runs.q_run != nullptr);
  return mask;
}
#endif

}  // namespace jax_flash
