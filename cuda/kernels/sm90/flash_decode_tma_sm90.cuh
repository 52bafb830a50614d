// The sm_90a decode split kernel for 65-128 packed rows (query heads per kv head x Tq) over a dense cache, at head
// dims up to 128: the forward's machinery (flash_fwd_sm90_tma_wgmma_ws.cuh) with decode's tiles. At these rows a
// K/V byte carries 130-256 FLOP, so the stream is bound by the tensor cores as much as by memory, and what paces it
// is how busy the kernel keeps them: here a producer thread issues every load with TMA, two consumer warpgroups
// (64 packed rows each) take turns issuing their products (ping-pong) and each runs a tile's softmax under its own
// previous P V (the forward's main loop, FwdMainloop::mma). The cp.async wgmma kernel (flash_decode_wgmma_sm90.cuh)
// keeps paged caches and up to 64 rows.
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
//     among it: 0 x nan is nan in P V) are zeroed in the V tile by the consumers before its P V product;
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

// kSoftCap: the call has a logit soft cap. tm_q: q [B, Tq, Hq, D] as (D, group, Tq, Hkv, B) in boxes of (64, group,
// Tq, 1, 1); tm_k, tm_v: the caches [B, S, Hkv, D] as (D, S, Hkv, B) in boxes of 64 columns x kBlockN keys.
template <typename T, typename Traits, bool kSoftCap>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_decode_tma_kernel(const __grid_constant__ FlashParams p, const __grid_constant__ CUtensorMap tm_q,
                            const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v) {
#if defined(JAX_FLASH_SM90A)
  using Mainloop = FwdMainloop<T, Traits, kSoftCap>;
  using Storage = typename Traits::SharedStorage;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kConsumerThreads = Traits::kConsumerWarpgroups * kWarpgroupThreads;

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
  // The unit and the balanced splits' share (block-wide; the K ring is free until the first load).
  int* scratch = reinterpret_cast<int*>(smem.k[0]);
  const DecodeTile unit = decode_tile<kBN, Traits::kThreads>(p, blockIdx.x, scratch, tid);
  const int64_t share = decode::split_share<kBN, Traits::kThreads, true>(p, scratch, tid);
  // The generic-proxy writes above (Q's zero rows, the scratch in the K ring) ordered before the async proxy's: wgmma
  // reads Q, TMA rewrites the ring.
  fence_proxy_async_smem();
  // The unit's key tiles [*n_begin, *n_begin + count) on the grid of whole tiles, and its range.
  auto unit_tiles = [&](const DecodeTile& u, decode::DecodeRange* range, int* n_begin) {
    *range = decode::decode_range(p, u.b);
    const decode::SplitTiles st = decode::split_of<kBN, true>(p, *range, u.split, share);
    *n_begin = range->lo / kBN + st.begin;
    return imax(st.end - st.begin, 0);
  };
  auto for_each_unit = [&](auto&& fn) { fn(unit); };  // one (the main loop's roles are written for several)

  if (tid == 0) {
    mainloop.init_barriers();
    mbar_init_fence();
  }
  __syncthreads();

  const int warpgroup = tid / kWarpgroupThreads;
  if (warpgroup == 0) {  // producer: one thread issues every load
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (tid == 0) {
      prefetch_tensor_map(&tm_q);
      prefetch_tensor_map(&tm_k);
      prefetch_tensor_map(&tm_v);
      const uint32_t q_bytes = uint32_t(rows) * Traits::kHeadDim * sizeof(T);  // whole boxes, zeros past head_dim
      typename Mainloop::KVState kv;
      typename Mainloop::QState q;
      for_each_unit([&](const DecodeTile& u) {
        decode::DecodeRange range;
        int n_begin;
        const int n_tiles = unit_tiles(u, &range, &n_begin);
        if (n_tiles == 0) return;
        smem.q_ring.producer_acquire(q, q_bytes);  // the consumers are done with the previous unit's Q
#pragma unroll
        for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
          tma_load_5d(smem.q + cb * Traits::kBlockM * kColBlock, &tm_q, smem.q_ring.full_barrier(q), cb * kColBlock, 0,
                      0, u.hk, u.b);
        }
        q.advance();
        for (int i = 0; i < n_tiles; ++i, kv.advance()) {
          mainloop.load_kv_tile(&tm_k, &tm_v, kv, (n_begin + i) * kBN, u.hk, u.b);
        }
      });
    }
    return;
  }

  // consumers: the main loop, then the unit's partial results
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int cw = warpgroup - 1;  // consumer warpgroup: packed rows [64 cw, 64 cw + 64)
  const int ctid = tid - kWarpgroupThreads;
  const int warp = (tid / kWarpSize) % 4;
  const int lane = tid % kWarpSize;
  const typename Mainloop::PingPongT pingpong(cw);
  pingpong.open();

  typename Mainloop::Accumulators acc;
  typename Mainloop::KVState kv;
  typename Mainloop::QState q;
  for_each_unit([&](const DecodeTile& u) {
    decode::DecodeRange range;
    int n_begin;
    const int n_tiles = unit_tiles(u, &range, &n_begin);
    if (n_tiles == 0) {
      decode::mark_split_empty<T>(p, u.split, u.b, u.hk, 0, rows, ctid, kConsumerThreads);
      return;
    }
    const PackedRowsMask mask = decode_mask_for_batch(p, u.b);
    // Keys of a V tile outside [range.lo, range.hi) become zeros before its P V (only the range's first and last
    // tiles hold any: the same test in every consumer thread, so both warpgroups take the barrier together).
    auto zero_outside = [&](int i, int slot) {
      const int n0 = (n_begin + i) * kBN;
      if (n0 >= range.lo && n0 + kBN <= range.hi) return;
      T* v = smem.v[slot];
      for (int c = ctid; c < Traits::kColBlocks * kBN * 8; c += kConsumerThreads) {  // 16-byte chunks
        const int key = n0 + (c / 8) % kBN;
        if (key < range.lo || key >= range.hi) *reinterpret_cast<uint4*>(v + c * 8) = make_uint4(0, 0, 0, 0);
      }
      fence_proxy_async_smem();
      named_barrier_sync(kDecodeTailBarrier, kConsumerThreads);
    };
    mainloop.mma(mask, 0, n_begin, n_tiles, cw, warp, lane, pingpong, kv, q, acc, zero_outside);
    float row_sum[2] = {quad_sum(acc.row_sum[0]), quad_sum(acc.row_sum[1])};
    decode::store_split_rows<T, Traits::kHeadDim / 8>(p, u.split, u.b, u.hk, rows, cw * kWgmmaM + warp * kWarpRows,
                                                      lane / 4, lane % 4, acc.o, acc.row_max, row_sum);
  });
  pingpong.close();
#else
  __trap();  // built for a target without wgmma; the dispatcher only launches this on compute capability 9.0
#endif
}

}  // namespace jax_flash::cuda::sm90
