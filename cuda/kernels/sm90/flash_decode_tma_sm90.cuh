// The sm_90a decode split kernel for 65-128 packed rows (query heads per kv head x Tq) over a dense or paged cache, at
// head dims up to 128: the forward's machinery (flash_fwd_sm90_tma_wgmma_ws.cuh) with decode's tiles. At these rows a
// K/V byte carries 130-256 FLOP, so the stream is bound by the tensor cores as much as by memory, and what paces it is
// how busy the kernel keeps them: here a producer thread issues every load with TMA (a paged cache's K/V tiles: the
// producer warpgroup gathers them with cp.async, PagedKVGather), two consumer warpgroups (64 packed rows each) take
// turns issuing their products (ping-pong) and each runs a tile's softmax under its own previous P V (the forward's
// main loop, FwdMainloop::mma). The cp.async wgmma kernel (flash_decode_wgmma_sm90.cuh) keeps up to 64 rows.
//
// What differs from the forward:
//   - a CTA per work unit (split, kv head, batch element): the hardware hands CTAs to SMs as they free up, so units
//     of unequal length (a ragged batch) balance; each unit's key tiles are its split of the sequence's range
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
#include "kernels/common/warp_reduce.cuh"
#include "kernels/decode/split_mainloop.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/mainloop_fwd_sm90.cuh"
#include "kernels/sm90/named_barriers.h"
#include "kernels/sm90/utils_sm90.cuh"
#include "mask.h"

namespace jax_flash::cuda::sm90 {

// A decode work unit, and the grid's order (CTA u takes unit u, and the hardware starts CTAs in that order): the kv
// head fastest, the split slowest, so a balanced grid's splits past those a sequence needs (half of it at equal
// lengths) come last and exit at once; with one split per sequence, a batch of up to kLongestFirstMaxBatch takes its
// sequences longest first (decode::batch_element: every thread calls this; `scratch` as that function's).
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

// A paged cache's K or V tile gathered by the producer warpgroup with cp.async (TMA boxes of one page each starved
// the ring at small pages: one thread issued 16 boxes of 2 KB a tile after eight dependent page-table loads; NOTES,
// session 30). The producer's issue rate paces the gather (fewer registers, more spill code: slower; a third stage:
// no faster; session 31), so each copy is kept to an address XOR and the copy itself: lane l of warp w copies keys
// 32 w + l / 2 and 32 w + 16 + l / 2 (kRows), every other 16-byte chunk of each (chunk 2 c + l % 2, c < kCopies:
// a lane pair reads a 32-byte sector per copy where kv head x head_dim is a multiple of 16 elements, a warp's copy
// 16 keys), from its own page-table lookups (no shuffles); the chunk's offset in the key's global row is an
// immediate, its swizzled place in the stage the row's place XOR a constant. The lookups of a tile are loaded a
// tile ahead (entries()) and turned into pool rows (pool_rows()) only when that tile's copies start, so the
// producer never waits for them between a tile's K and V. Keys outside the unit's range [lo, hi) (pool row -1) and
// chunks past head_dim are zero-filled and read nothing, so no tile of a paged call needs the V zeroing.
template <typename T, typename Traits>
struct PagedKVGather {
  static constexpr int kChunks = Traits::kHeadDim / 8;  // 16-byte chunks of a row: 16 or 8
  static constexpr int kCopies = kChunks / 2;           // a lane's copies of one key
  static constexpr int kRows = 2;                       // keys a lane copies in a tile
  static_assert(Traits::kBlockN == 4 * kWarpSize && kCopies % 4 == 0);

  const FlashParams& p;
  const T* k;          // this lane's first chunk (l % 2) of kv head hk in pool row 0
  const T* v;
  int64_t row_stride;  // elements between pool rows
  int key0;            // this lane's first key in a tile (the second is 16 after it)
  int copies;          // copies c < `copies` lie inside head_dim
  uint32_t place[kRows];  // byte offset of row key0 (+ 16) in a stage, XOR the lane's chunk-parity swizzle

  __device__ __forceinline__ PagedKVGather(const FlashParams& p_, int hk, int ptid) : p(p_) {
    const int warp = ptid / kWarpSize, lane = ptid % kWarpSize, parity = lane % 2;
    key0 = warp * kWarpSize + lane / 2;
    copies = (p.head_dim / 8 - parity + 1) / 2;
    row_stride = int64_t(p.heads_kv) * p.head_dim;
    k = static_cast<const T*>(p.k) + int64_t(hk) * p.head_dim + parity * 8;
    v = static_cast<const T*>(p.v) + int64_t(hk) * p.head_dim + parity * 8;
#pragma unroll
    for (int h = 0; h < kRows; ++h) {
      const int r = key0 + 16 * h;
      place[h] = swizzled_chunk_offset(r, parity);  // chunk 2 c + parity: this XOR (2 c % 8) x 16, + its column block
    }
  }
  __device__ __forceinline__ static bool in_range(int key, const decode::DecodeRange& range) {
    return key >= range.lo && key < range.hi;
  }
  // This lane's page-table entries in the tile from key n0 (loads; 0 outside the range), and their pool rows (-1
  // outside the range).
  __device__ __forceinline__ void entries(int b, int n0, const decode::DecodeRange& range, int (&e)[kRows]) const {
#pragma unroll
    for (int h = 0; h < kRows; ++h) {
      const int key = n0 + key0 + 16 * h;
      e[h] = in_range(key, range) ? decode::page_table_entry(p, b, key) : 0;
    }
  }
  __device__ __forceinline__ void pool_rows(const int (&e)[kRows], int n0, const decode::DecodeRange& range,
                                            int (&rows)[kRows]) const {
#pragma unroll
    for (int h = 0; h < kRows; ++h) {
      const int key = n0 + key0 + 16 * h;
      rows[h] = in_range(key, range) ? decode::pool_row_of(p, e[h], key) : -1;
    }
  }
  // One tensor's tile into `stage`.
  __device__ __forceinline__ void copy(T* stage, bool value, const int (&rows)[kRows]) const {
    const T* col = value ? v : k;
#pragma unroll
    for (int h = 0; h < kRows; ++h) {
      const bool row_ok = rows[h] >= 0;
      const T* src = row_ok ? col + int64_t(rows[h]) * row_stride : col;
      const uint32_t dst = smem_addr(stage) + place[h];
#pragma unroll
      for (int c = 0; c < kCopies; ++c) {
        cp_async_16((dst ^ uint32_t((2 * c % 8) * kSwizzleChunkBytes)) + (c / 4) * Traits::kBlockN * kSwizzleBytes,
                    src + 16 * c, row_ok && c < copies);
      }
    }
  }
};

// kPaged: the caches are paged (gathered by the producer warpgroup, PagedKVGather; else TMA boxes of the dense
// caches); kSoftCap: the call has a logit soft cap. tm_q: q [B, Tq, Hq, D] as (D, group, Tq, Hkv, B) in boxes of
// (64, group, Tq, 1, 1); tm_k, tm_v (dense caches only): [B, S, Hkv, D] as (D, S, Hkv, B) in boxes of 64 columns x
// kBlockN keys.
template <typename T, typename Traits, bool kPaged, bool kSoftCap>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_decode_tma_kernel(const __grid_constant__ FlashParams p, const __grid_constant__ CUtensorMap tm_q,
                            const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v) {
#if defined(JAX_FLASH_SM90A)
  using Mainloop = FwdMainloop<T, Traits, kSoftCap>;
  using Storage = typename Traits::SharedStorage;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kConsumerThreads = Traits::kConsumerWarpgroups * kWarpgroupThreads;
  // setmaxnreg moves registers between the warpgroups inside what the CTA was launched with (the register file
  // over its threads, 168 each): 24 + 2 x 240 per thread slot. The gather's copies spill below 56 (ptxas; and the
  // spill code slows the gather: session 31), and at 56 + 2 x 224 neither role spills. (An increase past what the
  // CTA holds never returns: 32 + 2 x 240 hung.)
  constexpr int kProducerRegs = kPaged ? 56 : Traits::kProducerRegs;
  constexpr int kConsumerRegs = kPaged ? 224 : Traits::kConsumerRegs;
  constexpr int kLaunchRegs = 64 * 1024 / Traits::kThreads / 8 * 8;
  static_assert((kProducerRegs + Traits::kConsumerWarpgroups * kConsumerRegs) * kWarpgroupThreads <=
                kLaunchRegs * Traits::kThreads);

  Storage& smem = shared_storage<Storage>();
  const Mainloop mainloop{p, smem};
  const int tid = threadIdx.x;
  const int group = p.group_size();
  const int rows = group * p.seqlen_q;  // packed rows (65-128), all in the block's 128

  // Q rows past the packed ones are never written by the loads: zeros, once (generic proxy writes, read by wgmma).
  for (int i = rows * kColBlock + tid * 8; i < Traits::kBlockM * kColBlock; i += Traits::kThreads * 8) {
#pragma unroll
    for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
      *reinterpret_cast<uint4*>(smem.q + cb * Traits::kBlockM * kColBlock + i) = make_uint4(0, 0, 0, 0);
    }
  }
  // The unit, the balanced splits' share (block-wide; the K ring is free until the first load), and from them the
  // unit's key range and its key tiles [n_begin, n_begin + n_tiles) on the grid of whole tiles (every thread alike,
  // so the roles agree on them). The unit and the tiles pass through warp_uniform: read from shared memory, they
  // would not be uniform by construction, and the main loop's state and wgmma descriptors, which derive from them,
  // would leave the uniform datapath (NOTES, sessions 26 and 31).
  int* scratch = reinterpret_cast<int*>(smem.k[0]);
  const DecodeTile u = decode_tile<kBN, Traits::kThreads>(p, blockIdx.x, scratch, tid);
  const DecodeTile unit{warp_uniform(u.split), warp_uniform(u.hk), warp_uniform(u.b)};
  const int64_t share = decode::split_share<kBN, Traits::kThreads, true>(p, scratch, tid);
  const decode::DecodeRange range = decode::decode_range(p, unit.b);
  const decode::SplitTiles st = decode::split_of<kBN, true>(p, range, unit.split, share);
  const int n_begin = warp_uniform(range.lo / kBN + st.begin);
  const int n_tiles = warp_uniform(imax(st.end - st.begin, 0));
  // The generic-proxy writes above (Q's zero rows, the scratch in the K ring) ordered before the async proxy's: wgmma
  // reads Q, TMA (or the gather's cp.async) rewrites the ring.
  fence_proxy_async_smem();

  if (tid == 0) {
    mainloop.init_barriers(kPaged ? kWarpgroupThreads : 1);
    mbar_init_fence();
  }
  __syncthreads();

  const int warpgroup = warp_uniform(tid / kWarpgroupThreads);
  if (warpgroup == 0) {  // producer: Q and the unit's K/V tiles
    setmaxnreg_dec<kProducerRegs>();
    if (n_tiles == 0) return;
    typename Mainloop::KVState kv;
    if (tid == 0) {
      prefetch_tensor_map(&tm_q);
      if constexpr (!kPaged) {
        prefetch_tensor_map(&tm_k);
        prefetch_tensor_map(&tm_v);
      }
      const uint32_t q_bytes = uint32_t(rows) * Traits::kHeadDim * sizeof(T);  // whole boxes, zeros past head_dim
      const typename Mainloop::QState q;
      smem.q_ring.producer_acquire(q, q_bytes);
#pragma unroll
      for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
        tma_load_5d(smem.q + cb * Traits::kBlockM * kColBlock, &tm_q, smem.q_ring.full_barrier(q), cb * kColBlock, 0,
                    0, unit.hk, unit.b);
      }
      if constexpr (!kPaged) {  // one thread issues every load
        for (int i = 0; i < n_tiles; ++i, kv.advance()) {
          mainloop.load_kv_tile(&tm_k, &tm_v, kv, (n_begin + i) * kBN, unit.hk, unit.b);
        }
      }
    }
    if constexpr (kPaged) {  // the whole warpgroup gathers each tile, K then V, each once its slot is free
      const PagedKVGather<T, Traits> gather(p, unit.hk, tid);
      int entries[PagedKVGather<T, Traits>::kRows], tile_rows[PagedKVGather<T, Traits>::kRows];
      gather.entries(unit.b, n_begin * kBN, range, entries);
      for (int i = 0; i < n_tiles; ++i, kv.advance()) {
        const int n0 = (n_begin + i) * kBN;
        gather.pool_rows(entries, n0, range, tile_rows);
        smem.k_ring.producer_wait_empty(kv);
        gather.copy(smem.k[kv.slot()], false, tile_rows);
        cp_async_mbar_arrive(smem.k_ring.full_barrier(kv));
        if (i + 1 < n_tiles) gather.entries(unit.b, n0 + kBN, range, entries);  // used by the next tile
        smem.v_ring.producer_wait_empty(kv);
        gather.copy(smem.v[kv.slot()], true, tile_rows);
        cp_async_mbar_arrive(smem.v_ring.full_barrier(kv));
      }
    }
    return;
  }

  // consumers: the main loop, then the unit's partial results
  setmaxnreg_inc<kConsumerRegs>();
  const int cw = warpgroup - 1;  // consumer warpgroup: packed rows [64 cw, 64 cw + 64)
  const int ctid = tid - kWarpgroupThreads;
  if (n_tiles == 0) {
    decode::mark_split_empty<T>(p, unit.split, unit.b, unit.hk, 0, rows, ctid, kConsumerThreads);
    return;
  }
  const int warp = (tid / kWarpSize) % 4;
  const int lane = tid % kWarpSize;
  const typename Mainloop::PingPongT pingpong(cw);
  pingpong.open();

  typename Mainloop::Accumulators acc;
  typename Mainloop::KVState kv;
  typename Mainloop::QState q;
  const PackedRowsMask mask = decode_mask_for_batch(p, unit.b);
  // Paged: the gather's copies landed in the generic proxy; wgmma reads through the async proxy.
  auto landed = [] {
    if constexpr (kPaged) fence_proxy_async_smem();
  };
  // Dense: keys of a V tile outside [range.lo, range.hi) become zeros before its P V (only the range's first and last
  // tiles hold any: the same test in every consumer thread, so both warpgroups take the barrier together).
  auto zero_outside = [&](int i, int slot) {
    if constexpr (!kPaged) {
      const int n0 = (n_begin + i) * kBN;
      if (n0 >= range.lo && n0 + kBN <= range.hi) return;
      T* v = smem.v[slot];
      for (int c = ctid; c < Traits::kColBlocks * kBN * 8; c += kConsumerThreads) {  // 16-byte chunks
        const int key = n0 + (c / 8) % kBN;
        if (key < range.lo || key >= range.hi) *reinterpret_cast<uint4*>(v + c * 8) = make_uint4(0, 0, 0, 0);
      }
      fence_proxy_async_smem();
      named_barrier_sync(kDecodeTailBarrier, kConsumerThreads);
    }
  };
  mainloop.mma(mask, 0, n_begin, n_tiles, cw, warp, lane, pingpong, kv, q, acc, landed, zero_outside);
  float row_sum[2] = {quad_sum(acc.row_sum[0]), quad_sum(acc.row_sum[1])};
  decode::store_split_rows<T, Traits::kHeadDim / 8>(p, unit.split, unit.b, unit.hk, rows,
                                                    cw * kWgmmaM + warp * kWarpRows, lane / 4, lane % 4, acc.o,
                                                    acc.row_max, row_sum);
  pingpong.close();
#else
  __trap();  // built for a target without wgmma; the dispatcher only launches this on compute capability 9.0
#endif
}

}  // namespace jax_flash::cuda::sm90
