// The sm_90a decode split kernel for 65-128 packed rows (query heads per kv head x Tq) over a dense or paged cache, at
// head dims up to 128: the forward's machinery (flash_fwd_sm90_tma_wgmma_ws.cuh) with decode's tiles. At these rows a
// K/V byte carries 130-256 FLOP, so the stream is bound by the tensor cores as much as by memory, and what paces it is
// how busy the kernel keeps them: here a producer thread issues every load with TMA (a paged cache's K/V tiles: the
// producer warpgroup gathers them with cp.async, PagedKVGather), two consumer warpgroups (64 packed rows each) take
// turns issuing their products (ping-pong) and each runs a tile's softmax under its own previous P V (the forward's
// main loop, FwdMainloop::mma). The cp.async wgmma kernel (flash_decode_wgmma_sm90.cuh) keeps up to 64 rows.
//
// What differs from the forward:
//   - a CTA per work unit (split, kv head, batch element), or a persistent grid taking them from a work counter for
//     many waves of units (DecodeTmaGrid): units of unequal length (a ragged batch) balance as CTAs or the counter
//     hand them to SMs that free up; each unit's key tiles are its split of the sequence's range
//     (decode/split_mainloop.cuh split_of, on the grid of whole 128-key tiles of the cache; balanced splits share
//     one size across the batch, found block-wide before the roles part);
//   - Q comes as one 5-d TMA box per 64-column block, (64 columns, group heads, Tq steps) of kv head hk of batch
//     element b, which lands row-major: packed row r = step r / group of query head hk group + r % group, as the
//     decode kernels pack them; rows past group x Tq stay zero (written once before the loop);
//   - the mask is PackedRowsMask (bottom-right causal rows and windows per step);
//   - keys outside the range that the first or last tile's box holds (past kv_len the cache may hold anything, a nan
//     among it: 0 x nan is nan in P V) are zeroed in the V tile by the consumers before its P V product (a paged
//     gather zero-fills them instead);
//   - the epilogue writes each row's float32 partial O and lse for the combine kernel (decode/combine.cuh), or the
//     final O and lse with one split (decode/split_mainloop.cuh store_split_rows).
#pragma once

#include "flash_params.h"
#include "kernels/common/l2_policy.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/decode/split_mainloop.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/mainloop_fwd_sm90.cuh"
#include "kernels/sm90/named_barriers.h"
#include "kernels/sm90/utils_sm90.cuh"
#include "kernels/sm90/work_counter.cuh"
#include "mask.h"

namespace jax_flash::cuda::sm90 {

// A decode work unit, and the grid's order (CTA u takes unit u, and the hardware starts CTAs in that order; a
// persistent grid takes them in that order too): the kv head fastest, the split slowest, so a balanced grid's splits
// past those a sequence needs (half of it at equal lengths) come last and exit at once; where the launcher ranks
// the batch (FlashParams::rank_batch), the sequences come longest first (decode::batch_element: every thread calls
// this; `scratch` as that function's).
struct DecodeTile {
  int split;
  int hk;
  int b;
};
template <int kBlockN, int kThreads>
__device__ __forceinline__ DecodeTile decode_tile(const FlashParams& p, int u, int* scratch, int tid) {
  const int per_split = p.heads_kv * p.batch;
  const int z = (u % per_split) / p.heads_kv;
  return {u / per_split, u % p.heads_kv, decode::batch_element<kBlockN, kThreads>(p, z, scratch, tid)};
}
// The same without the ranking (the persistent grids, which the launcher never ranks): unit u is kv head u % Hkv of
// batch element (u % (Hkv B)) / Hkv, split u / (Hkv B).
__device__ __forceinline__ DecodeTile unranked_decode_tile(const FlashParams& p, int u) {
  const int per_split = p.heads_kv * p.batch;
  return {u / per_split, u % p.heads_kv, (u % per_split) / p.heads_kv};
}
// And at one split (the kEarly grids, never ranked either): kv head u % Hkv of batch element u / Hkv, without the
// general form's two further divisions ahead of the early loads.
__device__ __forceinline__ DecodeTile unranked_one_split_tile(const FlashParams& p, int u) {
  return {0, u % p.heads_kv, u / p.heads_kv};
}

// A unit's key range and its key tiles [n_begin, n_begin + n_tiles) on the grid of whole tiles (every thread alike,
// so the roles agree on them; `share` from decode::split_share). The unit and the tiles pass through warp_uniform:
// read from shared memory, they would not be uniform by construction, and the main loop's state and wgmma
// descriptors, which derive from them, would leave the uniform datapath (NOTES, sessions 26 and 31).
struct DecodeUnitKeys {
  DecodeTile unit;
  decode::DecodeRange range;
  int n_begin;
  int n_tiles;
};
template <int kBlockN>
__device__ __forceinline__ DecodeUnitKeys decode_unit_keys(const FlashParams& p, const DecodeTile& u, int64_t share) {
  const DecodeTile unit{warp_uniform(u.split), warp_uniform(u.hk), warp_uniform(u.b)};
  const decode::DecodeRange range = decode::decode_range(p, unit.b);
  const decode::SplitTiles st = decode::split_of<kBlockN, true>(p, range, unit.split, share);
  return {unit, range, warp_uniform(range.lo / kBlockN + st.begin), warp_uniform(imax(st.end - st.begin, 0))};
}

// How a grid of the TMA decode kernel takes its units (launch_decode_tma's choice):
//   kUnit: a CTA per unit; the hardware starts them in grid order, one resident an SM, and hands the next unit to
//     whichever SM frees up, which balances a ragged batch (ranked longest first where the launcher asks);
//   kUnitEarly: the same, with Q and the unit's first key tile loaded before the set-up (dense caches of one split
//     a sequence, unranked; the kernel's comment says why);
//   kPersistent: one CTA per resident slot (an SM), each taking unit blockIdx.x first and then the next unit not
//     yet taken, gridDim.x + a count of FlashParams::decode_counter (the order and the dynamic balance of a CTA per
//     unit). The producer takes a unit and issues its loads as soon as the ring has room, so one unit's Q and first
//     tiles land while the consumers finish the previous unit's last products and store it, where a CTA per unit
//     asks for nothing between one unit's last load and the next CTA's first (~1.2 us of set-up and ~1.7 us to the
//     first tile of an 18.9 us unit at 64/8 Tq 16 256 x 1024: NOTES, session 70). Grids of many waves, unranked.
enum class DecodeTmaGrid { kUnit, kUnitEarly, kPersistent };

// A paged cache's K or V tile gathered by the producer warpgroup with cp.async (TMA boxes of one page each starved
// the ring at small pages: one thread issued 16 boxes of 2 KB a tile after eight dependent page-table loads; NOTES,
// session 30). Thread t copies chunk t % 8 of keys 8 (t / 8) + i, i < 8, in every 64-column block: eight
// consecutive lanes one key's 128-byte row, so a warp's copy reads four whole lines at head dims that are multiples
// of 64 (the lane-pair gather this replaced read 16 lines of one sector each per warp copy, which asked more of the
// L2 per byte than FlashAttention-3's gather: paged 16 1.10-1.15x faster since; NOTES, session 32). A thread's eight
// keys lie in one page when the page size is a multiple of 8, so one page-table lookup a tile gives their pool rows
// (consecutive); other page sizes look each key up (copy_by_key). The producer loads a tile's lookup (entry()) before
// the previous tile's K copy and turns it into the first key's pool row when the tile's K copy starts (first_row()).
// A key's place in the stage is the thread's place XOR a constant plus an immediate (the eight keys are one swizzle
// period). At a whole head dim, a thread whose eight keys are all in range copies them unpredicated, each key's
// source a pointer step from the last (the predicated form cost ~10 instructions a key: session 69). Keys outside
// the unit's range [lo, hi) and chunks past head_dim are zero-filled and read nothing, so no tile of a paged call
// needs the V zeroing.
template <typename T, typename Traits>
struct PagedKVGather {
  static constexpr int kRowThreads = kSwizzleBytes / kSwizzleChunkBytes;  // lanes per 128-byte row: 8
  static constexpr int kRows = kSwizzleRows;              // consecutive keys a thread copies in a tile: 8
  static_assert(kWarpgroupThreads / kRowThreads * kRows == Traits::kBlockN);

  const FlashParams& p;
  const T* k;           // this thread's chunk of kv head hk in pool row 0
  const T* v;
  int64_t row_stride;   // elements between pool rows
  int key0;             // the thread's first key in a tile
  uint32_t place;       // byte offset of the thread's chunk of row key0 in a stage's first column block
  uint32_t col_blocks;  // column blocks whose chunk lies inside head_dim (a bit each)
  bool page_runs;       // the page size is a multiple of kRows: a thread's keys share a page

  __device__ __forceinline__ PagedKVGather(const FlashParams& p_, int hk, int ptid) : p(p_) {
    const int chunk = ptid % kRowThreads;
    key0 = ptid / kRowThreads * kRows;
    row_stride = int64_t(p.heads_kv) * p.head_dim;
    k = static_cast<const T*>(p.k) + int64_t(hk) * p.head_dim + chunk * 8;
    v = static_cast<const T*>(p.v) + int64_t(hk) * p.head_dim + chunk * 8;
    place = uint32_t(key0 * kSwizzleBytes + chunk * kSwizzleChunkBytes);  // row key0 % 8 == 0: no XOR
    col_blocks = 0;
#pragma unroll
    for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
      if (cb * kColBlock + chunk * 8 < p.head_dim) col_blocks |= 1u << cb;
    }
    page_runs = p.page_size % kRows == 0;
  }
  __device__ __forceinline__ static bool in_range(int key, const decode::DecodeRange& range) {
    return key >= range.lo && key < range.hi;
  }
  // The page-table entry of the thread's first key in range in the tile from key n0 (a load; 0 when none is, or
  // when the page size takes copy_by_key's lookups). (first - (n0 + key0) < kRows: no n0 + key0 + kRows, which may
  // pass INT_MAX at the last tile of a cache near 2^31 keys.)
  __device__ __forceinline__ int entry(int b, int n0, const decode::DecodeRange& range) const {
    if (!page_runs) return 0;
    const int first = imax(n0 + key0, range.lo);
    return first < range.hi && first - (n0 + key0) < kRows ? decode::page_table_entry(p, b, first) : 0;
  }
  // The pool row of key n0 + key0 as if it shared that key's page (only keys in range are read).
  __device__ __forceinline__ int first_row(int e, int n0, const decode::DecodeRange& range) const {
    const int first = imax(n0 + key0, range.lo);
    return decode::pool_row_of(p, e, first) - (first - (n0 + key0));
  }
  // Key i of the thread's eight, from `src`, into its place in the stage at `dst`: zero-filled unless `ok` and the
  // column block lies inside head_dim; kWhole (the key in range at a whole head dim): no predicate.
  template <bool kWhole = false>
  __device__ __forceinline__ void copy_row(uint32_t dst, const T* src, int i, bool ok) const {
#pragma unroll
    for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
      cp_async_16((dst ^ uint32_t(i * kSwizzleChunkBytes)) + i * kSwizzleBytes + cb * Traits::kBlockN * kSwizzleBytes,
                  src + cb * kColBlock, kWhole || (ok && (col_blocks >> cb & 1u)), l2_evict_first_policy());
    }
  }
  // One tensor's tile from key n0 into `stage`; row0 = first_row() of the tile.
  __device__ __forceinline__ void copy(T* stage, bool value, int b, int n0, const decode::DecodeRange& range,
                                       int row0) const {
    const T* col = value ? v : k;
    const uint32_t dst = smem_addr(stage) + place;
    const int first = n0 + key0;
    if (page_runs && first >= range.lo && range.hi - first >= kRows && p.head_dim == Traits::kHeadDim) {
      // The thread's eight keys in range, in one page, at a whole head dim (nearly every tile): no predicates, each
      // key's source one pointer step from the last. (The head dim, not the thread's column blocks: at padded head
      // dims every lane of a warp takes the path below, not some of them each path.)
      const T* src = col + int64_t(row0) * row_stride;
#pragma unroll
      for (int i = 0; i < kRows; ++i, src += row_stride) copy_row<true>(dst, src, i, true);
    } else if (page_runs) {
      const T* src = col + int64_t(row0) * row_stride;
#pragma unroll
      for (int i = 0; i < kRows; ++i) {
        const bool ok = in_range(n0 + key0 + i, range);
        copy_row(dst, ok ? src + i * row_stride : col, i, ok);
      }
    } else {
      copy_by_key(dst, col, b, n0, range);
    }
  }
  // Page sizes that are no multiple of kRows: each key's own lookup.
  __device__ __noinline__ void copy_by_key(uint32_t dst, const T* col, int b, int n0,
                                           const decode::DecodeRange& range) const {
#pragma unroll 1
    for (int i = 0; i < kRows; ++i) {
      const int key = n0 + key0 + i;
      const bool ok = in_range(key, range);
      copy_row(dst, ok ? col + int64_t(decode::fetch_pool_row(p, b, key, range.hi)) * row_stride : col, i, ok);
    }
  }
};

// kPaged: the caches are paged (gathered by the producer warpgroup, PagedKVGather; else TMA boxes of the dense
// caches); kSoftCap: the call has a logit soft cap; kGrid: how the grid takes its units (DecodeTmaGrid). tm_q: q
// [B, Tq, Hq, D] as (D, group, Tq, Hkv, B) in boxes of (64, group, Tq, 1, 1); tm_k, tm_v (dense caches only):
// [B, S, Hkv, D] as (D, S, Hkv, B) in boxes of 64 columns x kBlockN keys.
template <typename T, typename Traits, bool kPaged, bool kSoftCap, DecodeTmaGrid kGrid>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_decode_tma_kernel(const __grid_constant__ FlashParams p, const __grid_constant__ CUtensorMap tm_q,
                            const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v) {
#if defined(JAX_FLASH_SM90A)
  using Mainloop = FwdMainloop<T, Traits, kSoftCap>;
  using Storage = typename Traits::SharedStorage;
  using KVState = typename Mainloop::KVState;
  using QState = typename Mainloop::QState;
  using UnitState = typename Traits::UnitState;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kConsumerThreads = Traits::kConsumerWarpgroups * kWarpgroupThreads;
  constexpr bool kEarly = kGrid == DecodeTmaGrid::kUnitEarly;
  constexpr bool kPersistent = kGrid == DecodeTmaGrid::kPersistent;
  static_assert(!kPersistent || Traits::kWorkCounter, "a persistent grid publishes its units in smem.unit");
  // setmaxnreg moves registers between the warpgroups inside what the CTA was launched with (the register file
  // over its threads, 168 each): 24 + 2 x 240 per thread slot. The gather's copies spill below 56 (ptxas; and the
  // spill code slows the gather: session 31); with its unpredicated path for whole tiles, ptxas spilled values the
  // roles share (d64 at 56 + 2 x 224), and at 64 + 2 x 216 neither role spills. (An increase past what the CTA holds
  // never returns: 32 + 2 x 240 hung.) A persistent producer also carries its unit walk across the tiles: at 24
  // (dense) and 64 (paged) ptxas spilled 116-128 and 24-36 B, in the dense producer around every tile's loads; the
  // consumers give 8 each (the paged ones computed at 216 without spills). Left: 8-12 B in the dense producer's
  // per-unit code (not its tile loop).
  constexpr int kProducerRegs = kPaged ? (kPersistent ? 72 : 64) : (kPersistent ? 40 : Traits::kProducerRegs);
  constexpr int kConsumerRegs = kPaged ? 216 : (kPersistent ? 232 : Traits::kConsumerRegs);
  constexpr int kLaunchRegs = 64 * 1024 / Traits::kThreads / 8 * 8;
  static_assert((kProducerRegs + Traits::kConsumerWarpgroups * kConsumerRegs) * kWarpgroupThreads <=
                kLaunchRegs * Traits::kThreads);

  Storage& smem = shared_storage<Storage>();
  const Mainloop mainloop{p, smem};
  const int tid = threadIdx.x;
  const int group = p.group_size();
  const int rows = group * p.seqlen_q;  // packed rows (65-128), all in the block's 128

  // kEarly: a dense call of one split per sequence, without a left window and without the longest-first ranking
  // (so that a unit's first key tile is tile 0 of the sequence of its grid index whatever the lengths;
  // launch_decode_tma checks it) has the producer thread issue Q and tile 0's K and V as soon as the barriers exist,
  // before the unit's range is read: the length's load and the block's set-up took ~1.2 us of an 18.9 us unit at
  // 64/8 Tq 16 256 x 1024, before which no byte of the unit was asked for (256 x 1024 rows x1.02-1.06; NOTES,
  // session 70). The tile is in the cache whatever the length (TMA zero-fills past its end); keys outside the range
  // are masked and zeroed in V as for any first tile, and a unit found to have no keys waits for these loads before
  // it exits. Its own instantiation, so that the calls which cannot take it run the kernel they ran before. (Not
  // for splits: only split 0's units would take it; nor paged caches: an early gather of tile 0 by the producer
  // warpgroup measured x0.98 over the paged rows.)
  static_assert(!(kEarly && kPaged), "the early first tile is the dense TMA loads' (launch_decode_tma)");
  const uint32_t q_bytes = uint32_t(rows) * Traits::kHeadDim * sizeof(T);  // whole boxes, zeros past head_dim
  auto init_barriers = [&] {
    mainloop.init_barriers(kPaged ? kWarpgroupThreads : 1);
    // A persistent grid's published units: released by every consumer thread and, paged, by the producer
    // warpgroup's other threads (they gather too).
    if constexpr (kPersistent) smem.unit_ring.init(kConsumerThreads + (kPaged ? kWarpgroupThreads - 1 : 0));
    mbar_init_fence();
  };
  if (kEarly && tid == 0) {  // (the barriers are fresh: no slot to wait for; a short copy of the loads' code)
    init_barriers();
    const auto [split, hk, b] = unranked_one_split_tile(p, blockIdx.x);
    const QState q;
    const KVState kv;
    mbar_arrive_expect_tx(smem.q_ring.full_barrier(q), q_bytes);
    mbar_arrive_expect_tx(smem.k_ring.full_barrier(kv), Traits::kKVBytes);
    mbar_arrive_expect_tx(smem.v_ring.full_barrier(kv), Traits::kKVBytes);
#pragma unroll
    for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
      tma_load_5d(smem.q + cb * Traits::kBlockM * kColBlock, &tm_q, smem.q_ring.full_barrier(q), cb * kColBlock, 0, 0,
                  hk, b);
      tma_load_4d(smem.k[0] + cb * kBN * kColBlock, &tm_k, smem.k_ring.full_barrier(kv), cb * kColBlock, 0, hk, b,
                  l2_evict_first_policy());
      tma_load_4d(smem.v[0] + cb * kBN * kColBlock, &tm_v, smem.v_ring.full_barrier(kv), cb * kColBlock, 0, hk, b,
                  l2_evict_first_policy());
    }
  }

  // Q rows past the packed ones are never written by the loads: zeros, once (generic proxy writes, read by wgmma).
  for (int i = rows * kColBlock + tid * 8; i < Traits::kBlockM * kColBlock; i += Traits::kThreads * 8) {
#pragma unroll
    for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
      *reinterpret_cast<uint4*>(smem.q + cb * Traits::kBlockM * kColBlock + i) = make_uint4(0, 0, 0, 0);
    }
  }
  // The CTA's unit (a CTA per unit), the balanced splits' share (block-wide, in `scratch`, free until its slot's
  // load) and from them the unit's keys (DecodeUnitKeys); a persistent CTA finds each unit's keys as it takes it.
  static_assert(Traits::kStages >= 2, "kEarly's scratch is a V slot that tile 0 does not use");
  static_assert(sizeof(smem.k[0]) >= decode::RankScratchInts(decode::kRankMaxBatch) * sizeof(int),
                "batch_element's scratch");
  int* scratch = reinterpret_cast<int*>(kEarly ? smem.v[Traits::kStages - 1] : smem.k[0]);  // not an early load's
  // (kEarly and persistent calls are never ranked: the launcher takes those forms only without rank_batch.)
  DecodeTile u{};
  if constexpr (kEarly) {
    u = unranked_one_split_tile(p, blockIdx.x);
  } else if constexpr (!kPersistent) {
    u = decode_tile<kBN, Traits::kThreads>(p, blockIdx.x, scratch, tid);
  }
  const int64_t share = decode::split_share<kBN, Traits::kThreads, true>(p, scratch, tid);
  DecodeUnitKeys first{};
  if constexpr (!kPersistent) first = decode_unit_keys<kBN>(p, u, share);
  // The generic-proxy writes above (Q's zero rows, the scratch in the ring) ordered before the async proxy's: wgmma
  // reads Q, TMA (or the gather's cp.async) rewrites the ring.
  fence_proxy_async_smem();
  if (!kEarly && tid == 0) init_barriers();
  __syncthreads();

  const int warpgroup = warp_uniform(tid / kWarpgroupThreads);
  if (warpgroup == 0) {  // producer: Q and each unit's K/V tiles
    setmaxnreg_dec<kProducerRegs>();
    KVState kv;
    QState q;
    // Q and the unit's key tiles (n_tiles > 0; `early`: Q and tile 0 are already asked for). Dense: the producer
    // thread alone (the others never call this); paged: the whole warpgroup. A persistent grid's Q slot frees only
    // after the previous unit's last S, and its first tile's K slot one tile earlier: there tile 0 (dense: K and V;
    // paged: K) goes first and Q after it (its wait depends on no load of this unit); a CTA per unit starts with
    // empty rings and asks for Q first.
    auto load_q = [&](const DecodeTile& unit) {
      if (tid == 0) {
        smem.q_ring.producer_acquire(q, q_bytes);  // the consumers are done with the previous unit's Q
#pragma unroll
        for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
          tma_load_5d(smem.q + cb * Traits::kBlockM * kColBlock, &tm_q, smem.q_ring.full_barrier(q), cb * kColBlock,
                      0, 0, unit.hk, unit.b);
        }
      }
      q.advance();
    };
    auto load_unit = [&](const DecodeUnitKeys& keys, bool early) {
      const DecodeTile& unit = keys.unit;
      if (!kPersistent && !early) load_q(unit);
      if (early) q.advance();
      if constexpr (!kPaged) {  // one thread issues every load (tile 0's already, when early)
        if (early) kv.advance();
        for (int i = early ? 1 : 0; i < keys.n_tiles; ++i, kv.advance()) {
          mainloop.load_kv_tile(&tm_k, &tm_v, kv, (keys.n_begin + i) * kBN, unit.hk, unit.b);
          if (kPersistent && i == 0) load_q(unit);
        }
      } else {
        // The whole warpgroup gathers each tile, each copy once its slot is free, K one tile ahead of V (K(i + 1),
        // then V(i): the consumers' next S = Q K^T is issued before this tile's P V, and K's copy does not wait for
        // V's slot); from the third tile on, a tile's page-table lookup is loaded two copies before its K copy
        // needs it.
        const decode::DecodeRange range = keys.range;  // a copy, out of local memory (docs/design.md, "Decode")
        const PagedKVGather<T, Traits> gather(p, unit.hk, tid);
        auto n0_of = [&](int i) { return (keys.n_begin + i) * kBN; };
        auto copy_k = [&](const KVState& at, int i, int row0) {
          smem.k_ring.producer_wait_empty(at);
          gather.copy(smem.k[at.slot()], false, unit.b, n0_of(i), range, row0);
          cp_async_mbar_arrive(smem.k_ring.full_barrier(at));
        };
        int row_k = gather.first_row(gather.entry(unit.b, n0_of(0), range), n0_of(0), range);  // tile 0's
        int entry = keys.n_tiles > 1 ? gather.entry(unit.b, n0_of(1), range) : 0;             // tile 1's
        copy_k(kv, 0, row_k);
        if constexpr (kPersistent) load_q(unit);  // (after this thread's K copy: the K tile waits on every thread's)
        for (int i = 0; i < keys.n_tiles; ++i, kv.advance()) {
          const int row_v = row_k;  // tile i's
          if (i + 1 < keys.n_tiles) {
            row_k = gather.first_row(entry, n0_of(i + 1), range);
            if (i + 2 < keys.n_tiles) entry = gather.entry(unit.b, n0_of(i + 2), range);
            copy_k(kv.ahead(1), i + 1, row_k);
          }
          smem.v_ring.producer_wait_empty(kv);
          gather.copy(smem.v[kv.slot()], true, unit.b, n0_of(i), range, row_v);
          cp_async_mbar_arrive(smem.v_ring.full_barrier(kv));
        }
      }
    };
    if (!kEarly && tid == 0) {
      prefetch_tensor_map(&tm_q);
      if constexpr (!kPaged) {
        prefetch_tensor_map(&tm_k);
        prefetch_tensor_map(&tm_v);
      }
    }
    if constexpr (kPersistent) {
      if (!kPaged && tid != 0) return;
      const int units = p.num_splits * p.heads_kv * p.batch;  // (launch_decode_tma: at most INT_MAX)
      for (UnitState us;; us.advance()) {
        FwdTile published;  // (split, kv head, batch element) in FwdTile's (m_block, h, b); m_block -1: none left
        if (tid == 0) {  // takes the next unit once its slot is free to publish it
          smem.unit_ring.producer_wait_empty(us);
          const int next = next_counted_unit(us.count, p.decode_counter);
          const DecodeTile t = next < units ? unranked_decode_tile(p, next) : DecodeTile{-1, 0, 0};
          published = FwdTile{t.split, t.hk, t.b};
          smem.unit[us.slot()] = published;
          mbar_arrive(smem.unit_ring.full_barrier(us));  // (release: the readers read it after their wait)
        } else if constexpr (kPaged) {  // the gather's other threads
          smem.unit_ring.consumer_wait(us);
          published = smem.unit[us.slot()];
          smem.unit_ring.consumer_release(us);
        }
        if (published.m_block < 0) return;
        const DecodeUnitKeys keys = decode_unit_keys<kBN>(p, DecodeTile{published.m_block, published.h, published.b},
                                                          share);
        if (keys.n_tiles > 0) load_unit(keys, false);
      }
    } else {
      if (first.n_tiles == 0) {
        if (kEarly && tid == 0) {  // the early loads land before the CTA's shared memory goes
          smem.q_ring.consumer_wait(QState{});
          smem.k_ring.consumer_wait(kv);
          smem.v_ring.consumer_wait(kv);
        }
        return;
      }
      if (kPaged || tid == 0) load_unit(first, kEarly);
    }
    return;
  }

  // consumers: the main loop, then the unit's partial results, unit after unit
  setmaxnreg_inc<kConsumerRegs>();
  const int cw = warpgroup - 1;  // consumer warpgroup: packed rows [64 cw, 64 cw + 64)
  const int ctid = tid - kWarpgroupThreads;
  const int warp = (tid / kWarpSize) % 4;
  const int lane = tid % kWarpSize;
  const typename Mainloop::PingPongT pingpong(cw);
  typename Mainloop::Accumulators acc;
  KVState kv;
  QState q;
  // Paged: the gather's copies landed in the generic proxy; wgmma reads through the async proxy.
  auto landed = [] {
    if constexpr (kPaged) fence_proxy_async_smem();
  };
  // One unit (n_tiles > 0).
  auto compute_unit = [&](const DecodeUnitKeys& keys) {
    const DecodeTile& unit = keys.unit;
    const PackedRowsMask mask = decode_mask_for_batch(p, unit.b);
    // Dense: keys of a V tile outside [range.lo, range.hi) become zeros before its P V (only the range's first and
    // last tiles hold any: the same test in every consumer thread, so both warpgroups take the barrier together).
    auto zero_outside = [&](int i, int slot) {
      if constexpr (!kPaged) {
        const int n0 = (keys.n_begin + i) * kBN;
        if (n0 >= keys.range.lo && n0 + kBN <= keys.range.hi) return;
        T* v = smem.v[slot];
        for (int c = ctid; c < Traits::kColBlocks * kBN * 8; c += kConsumerThreads) {  // 16-byte chunks
          const int key = n0 + (c / 8) % kBN;
          if (key < keys.range.lo || key >= keys.range.hi) {
            *reinterpret_cast<uint4*>(v + c * 8) = make_uint4(0, 0, 0, 0);
          }
        }
        fence_proxy_async_smem();
        named_barrier_sync(kDecodeTailBarrier, kConsumerThreads);
      }
    };
    mainloop.mma(mask, 0, keys.n_begin, keys.n_tiles, keys.n_tiles, cw, warp, lane, pingpong, kv, q, acc, landed,
                 zero_outside);
    float row_sum[2] = {quad_sum(acc.row_sum[0]), quad_sum(acc.row_sum[1])};
    decode::store_split_rows<T, Traits::kHeadDim / 8>(p, unit.split, unit.b, unit.hk, rows,
                                                      cw * kWgmmaM + warp * kWarpRows, lane / 4, lane % 4, acc.o,
                                                      acc.row_max, row_sum);
  };
  auto mark_empty = [&](const DecodeTile& unit) {
    decode::mark_split_empty<T>(p, unit.split, unit.b, unit.hk, 0, rows, ctid, kConsumerThreads);
  };
  if constexpr (kPersistent) {
    pingpong.open();
    for (UnitState us;; us.advance()) {
      smem.unit_ring.consumer_wait(us);
      const FwdTile published = smem.unit[us.slot()];
      smem.unit_ring.consumer_release(us);
      if (published.m_block < 0) break;
      const DecodeUnitKeys keys = decode_unit_keys<kBN>(p, DecodeTile{published.m_block, published.h, published.b},
                                                        share);
      if (keys.n_tiles == 0) {
        mark_empty(keys.unit);
      } else {
        compute_unit(keys);
      }
    }
    pingpong.close();
  } else {
    if (first.n_tiles == 0) {
      mark_empty(first.unit);
      return;
    }
    pingpong.open();
    compute_unit(first);
    pingpong.close();
  }
#else
  __trap();  // built for a target without wgmma; the dispatcher only launches this on compute capability 9.0
#endif
}

}  // namespace jax_flash::cuda::sm90
