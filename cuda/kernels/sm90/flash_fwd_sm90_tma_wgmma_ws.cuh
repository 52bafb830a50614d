// Forward FlashAttention kernel for sm_90a: TMA loads into an mbarrier-guarded shared-memory ring, wgmma for
// S = Q K^T (both operands from shared memory) and O += P V (P from registers), online softmax with exp2 and the
// log2(e)-folded scale, warp specialisation (a producer warpgroup issues the loads; consumer warpgroups compute).
//
// Tiles come from FwdTileScheduler (tile_scheduler_fwd.cuh). Persistent (Traits::kPersistent): at most one CTA per
// SM, CTA c works through the units c, c + gridDim.x, ...; otherwise a CTA per unit. The K/V ring and its mbarrier
// phases run on across a CTA's tiles, and the next tile's Q loads once every S of the current tile is done, so the
// next tile's loads overlap the last PV product and the epilogue.
// Each consumer warpgroup owns 64 query rows; per thread (warp w of the warpgroup, lane = 4 g + t) rows 16 w + g
// and 16 w + g + 8, columns 8 j + 2 t (+1) of every 8-wide column tile j of S and O.
//
// TMA tensor maps view q and o as (head_dim, seqlen_q, heads_q, batch) in boxes of kColBlock columns x tile rows, and
// k, v likewise with heads_kv; out-of-range rows and columns load as zeros (and are masked) and are not stored, so
// no length needs to divide a tile. O goes through shared memory (stmatrix) and a TMA store where the traits leave
// room (kStoreOSmem), else from registers; LSE from registers.
#pragma once

#include <cmath>
#include <type_traits>

#include "flash_params.h"
#include "kernels/common/block_ranges.cuh"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/named_barriers.h"
#include "kernels/sm90/smem_layout.h"
#include "kernels/sm90/tile_scheduler_fwd.cuh"
#include "kernels/sm90/utils_sm90.cuh"
#include "kernels/sm90/wgmma_sm90.cuh"
#include "mask.h"

namespace jax_flash::cuda::sm90 {

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    flash_fwd_sm90_kernel(const __grid_constant__ FlashParams p, const __grid_constant__ CUtensorMap tm_q,
                          const __grid_constant__ CUtensorMap tm_k, const __grid_constant__ CUtensorMap tm_v,
                          const __grid_constant__ CUtensorMap tm_o) {
#if defined(JAX_FLASH_SM90A)
  constexpr int kD = Traits::kHeadDim;
  constexpr int kBM = Traits::kBlockM;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kStages = Traits::kStages;
  constexpr int kSTiles = kBN / 8;   // 8-wide column tiles of S
  constexpr int kOTiles = kD / 8;    // 8-wide column tiles of O
  using ET = ElemTraits<T>;
  using Storage = typename Traits::SharedStorage;

  Storage& smem = shared_storage<Storage>();
  const FwdTileScheduler sched(p, kBM, Traits::kPersistent);
  const int tid = threadIdx.x;

  // The key tiles [*n_begin, *n_begin + count) that some row of the query block starting at m0 sees.
  auto key_tiles = [&](const AttentionMask& mask, int m0, int* n_begin) {
    int n_end;
    key_tiles_for_rows<kBN>(mask, p, m0, imin(kBM, p.seqlen_q - m0), n_begin, &n_end);
    return imax(n_end - *n_begin, 0);
  };

  // Ring position it (key tiles counted across the CTA's tiles) uses slot it % kStages; its "full" barrier completes
  // phase parity (it / kStages) & 1 for it. The producer waits on the slot's "empty" barrier with the other parity,
  // which a freshly initialised barrier passes at once (the phase before its first counts as complete).
  auto slot = [](int it) { return it % kStages; };
  auto phase = [](int it) { return uint32_t(it / kStages) & 1; };

  // Calls fn(tile) for each tile of this CTA in order: every unit c, c + gridDim.x, ... when persistent, else the
  // one unit blockIdx.x (the grid then has a CTA per unit).
  auto for_each_tile = [&](auto&& fn) {
    if constexpr (Traits::kPersistent) {
      for (int u = blockIdx.x; u < sched.units; u += gridDim.x) {
        for (int k = 0; k < sched.tiles(u); ++k) fn(sched.tile(u, k));
      }
    } else {
      for (int k = 0; k < sched.tiles(blockIdx.x); ++k) fn(sched.tile(blockIdx.x, k));
    }
  };

  constexpr int kConsumerWarps = Traits::kConsumerWarpgroups * 4;
  if (tid == 0) {
    mbar_init(&smem.q_full, 1);
    mbar_init(&smem.q_empty, kConsumerWarps);  // one arrival per consumer warp
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&smem.k_full[s], 1);
      mbar_init(&smem.v_full[s], 1);
      mbar_init(&smem.k_empty[s], kConsumerWarps);
      mbar_init(&smem.v_empty[s], kConsumerWarps);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int warpgroup = tid / kWarpgroupThreads;
  if (warpgroup == 0) {
    // ---- producer: one thread issues every load, tile after tile -----------------------------------------------
    setmaxnreg_dec<Traits::kProducerRegs>();
    if (tid == 0) {
      prefetch_tensor_map(&tm_q);
      prefetch_tensor_map(&tm_k);
      prefetch_tensor_map(&tm_v);
      int kv_it = 0;
      uint32_t q_phase = 0;
      for_each_tile([&](const FwdTile& tile) {
        const int m0 = tile.m_block * kBM;
        int n_begin;
        const int n_tiles = key_tiles(mask_for_batch(p, tile.b), m0, &n_begin);
        if (n_tiles == 0) return;
        const int hk = tile.h / p.group_size();
        mbar_wait(&smem.q_empty, q_phase ^ 1);  // the consumers are done with the previous tile's Q
        mbar_arrive_expect_tx(&smem.q_full, Traits::kQBytes);
#pragma unroll
        for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
          tma_load_4d(smem.q + cb * kBM * kColBlock, &tm_q, &smem.q_full, cb * kColBlock, m0, tile.h, tile.b);
        }
        q_phase ^= 1;
        for (int i = 0; i < n_tiles; ++i, ++kv_it) {
          const int n0 = (n_begin + i) * kBN;
          const int s = slot(kv_it);
          mbar_wait(&smem.k_empty[s], phase(kv_it) ^ 1);
          mbar_arrive_expect_tx(&smem.k_full[s], Traits::kKVBytes);
#pragma unroll
          for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
            tma_load_4d(smem.k[s] + cb * kBN * kColBlock, &tm_k, &smem.k_full[s], cb * kColBlock, n0, hk, tile.b);
          }
          mbar_wait(&smem.v_empty[s], phase(kv_it) ^ 1);
          mbar_arrive_expect_tx(&smem.v_full[s], Traits::kKVBytes);
#pragma unroll
          for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
            tma_load_4d(smem.v[s] + cb * kBN * kColBlock, &tm_v, &smem.v_full[s], cb * kColBlock, n0, hk, tile.b);
          }
        }
      });
    }
    return;
  }

  // ---- consumers -----------------------------------------------------------------------------------------------
  // Per key tile i the warpgroup issues S_i = Q K_i^T and O += P_{i-1} V_{i-1} back to back, then runs the softmax
  // of S_i while the PV product is still on the tensor cores (intra-warpgroup overlap). With kPingPong the
  // consumer warpgroups also take turns issuing their products, so one's softmax overlaps the others' GEMMs.
  setmaxnreg_inc<Traits::kConsumerRegs>();
  const int cw = warpgroup - 1;                 // consumer warpgroup: query rows [64 cw, 64 cw + 64) of the block
  const int wg_tid = tid % kWarpgroupThreads;
  const int warp = (tid / kWarpSize) % 4;       // warp inside the warpgroup
  const int lane = tid % kWarpSize;
  const bool lane0 = lane == 0;
  const int g = lane / 4;
  const int t = lane % 4;
  const int warp_row0 = cw * kWgmmaM + warp * kWarpRows;  // first of this warp's 16 rows inside the block

  float acc_o[kOTiles * 4];    // O: 64 rows x kD, accumulator layout
  float acc_s[kSTiles * 4];    // S of the current key tile, then its exp2 values
  uint32_t a_p[kBN / kWgmmaK][4];  // P of the previous tile as wgmma A fragments (16 keys per step)
  float row_max[2];  // running max of the raw logits of rows g, g + 8
  float row_sum[2];  // per-lane partial sums; reduced over the quad at the end

  // Q slice of this warpgroup: column block cb starts at q + cb * kBM * 64, its rows at 128-byte pitch.
  const uint32_t q_base = smem_addr(smem.q) + cw * kWgmmaM * kSwizzleBytes;
  constexpr uint32_t kQColBlockBytes = kBM * kSwizzleBytes;
  constexpr uint32_t kKVColBlockBytes = kBN * kSwizzleBytes;
  constexpr int kKStepsPerColBlock = kColBlock / kWgmmaK;  // 16-element K slices per 128-byte row

  // Ping-pong: warpgroup cw waits on barrier kPingPongBarrier + cw before issuing, then releases the next one
  // (cyclically). Every warpgroup takes the same issue steps for every tile (S_0, then (S_i, PV_{i-1}), then
  // PV_{n-1}), so the turns go round across tiles; the last warpgroup lets warpgroup 0 go first, and warpgroup 0
  // takes that opening arrival back after its last tile, so every barrier ends balanced.
  constexpr int kGroups = Traits::kConsumerWarpgroups;
  constexpr bool kPingPong = Traits::kPingPong && kGroups >= 2;
  const int my_turn = kPingPongBarrier + cw;
  const int their_turn = kPingPongBarrier + (kGroups == 2 ? cw ^ 1 : (cw + 1) % kGroups);
  constexpr int kPairThreads = 2 * kWarpgroupThreads;  // the waiting warpgroup and the one that releases it
  auto begin_issue = [&] {
    if constexpr (kPingPong) named_barrier_sync(my_turn, kPairThreads);
  };
  auto end_issue = [&] {
    if constexpr (kPingPong) named_barrier_arrive(their_turn, kPairThreads);
  };
  if constexpr (kPingPong) {
    if (cw == kGroups - 1) named_barrier_arrive(their_turn, kPairThreads);
  }

  auto issue_s = [&](int slot) {  // S = Q K^T (64 x kBN), both operands in shared memory
    const uint32_t k_base = smem_addr(smem.k[slot]);
#pragma unroll
    for (int kk = 0; kk < kD / kWgmmaK; ++kk) {
      const uint32_t k_off = (kk % kKStepsPerColBlock) * (kWgmmaK * sizeof(T));  // inside the 128-byte row
      const uint64_t desc_q =
          make_desc_sw128(q_base + (kk / kKStepsPerColBlock) * kQColBlockBytes + k_off, kKMajorLeadingBytes);
      const uint64_t desc_k =
          make_desc_sw128(k_base + (kk / kKStepsPerColBlock) * kKVColBlockBytes + k_off, kKMajorLeadingBytes);
      Wgmma<kBN, T, 0>::ss(acc_s, desc_q, desc_k, kk > 0);
    }
    wgmma_commit();
  };
  auto issue_pv = [&](int slot) {  // O += P V; V read N-major, 64-dim column blocks kKVColBlockBytes apart
    const uint32_t v_base = smem_addr(smem.v[slot]);
#pragma unroll
    for (int kk = 0; kk < kBN / kWgmmaK; ++kk) {
      const uint64_t desc_v = make_desc_sw128(v_base + kk * kWgmmaK * kSwizzleBytes, kKVColBlockBytes);
      Wgmma<kD, T, 1>::rs(acc_o, a_p[kk], desc_v, 1);
    }
    wgmma_commit();
  };

  // Masks S (only warps whose 16 rows, from row0, do not see the whole key tile from n0), then the online-softmax
  // update: S becomes exp2 values, the running max and sum move on; returns the factors that rescale O for rows g
  // and g + 8.
  auto softmax = [&](auto masked, const AttentionMask& mask, int row0, int n0, float (&correction)[2]) {
    if (masked && !mask.tile_fully_visible(row0, row0 + kWarpRows, n0, n0 + kBN, p.seqlen_q)) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int lo = mask.lo(row0 + g + 8 * r);
        const int hi = mask.hi(row0 + g + 8 * r);
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int col = n0 + j * 8 + 2 * t + e;
            if (col < lo || col >= hi) acc_s[4 * j + 2 * r + e] = -INFINITY;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) mx = fmaxf(mx, fmaxf(acc_s[4 * j + 2 * r], acc_s[4 * j + 2 * r + 1]));
      mx = quad_max(mx);
      const float max_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
      correction[r] = exp2f(row_max[r] * p.scale_log2 - max_scaled);
      row_max[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float pe = exp2f(acc_s[4 * j + 2 * r + e] * p.scale_log2 - max_scaled);
          acc_s[4 * j + 2 * r + e] = pe;
          sum += pe;
        }
      }
      row_sum[r] = row_sum[r] * correction[r] + sum;
    }
  };
  auto rescale_o = [&](const float (&correction)[2]) {
#pragma unroll
    for (int j = 0; j < kOTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[4 * j + e] *= correction[e / 2];
    }
  };
  auto convert_p = [&] {  // 16 keys per step = S column tiles 2 kk and 2 kk + 1
#pragma unroll
    for (int kk = 0; kk < kBN / kWgmmaK; ++kk) {
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4) a_p[kk][q4] = ET::pack(acc_s[8 * kk + 2 * q4], acc_s[8 * kk + 2 * q4 + 1]);
    }
  };

  // Epilogue of one tile: normalise O, store it (rows < seqlen_q, columns < head_dim) and the natural-log LSE.
  auto epilogue = [&](const FwdTile& tile, int m0, int rows_valid) {
    float inv[2];
    float* gLse = p.lse + (int64_t(tile.b) * p.heads_q + tile.h) * p.seqlen_q + m0;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float sum = quad_sum(row_sum[r]);
      inv[r] = sum > 0.f ? 1.f / sum : 0.f;
      const int row = warp_row0 + g + 8 * r;
      if (t == 0 && row < rows_valid) gLse[row] = sum > 0.f ? row_max[r] * p.scale + logf(sum) : INFINITY;
    }
    if constexpr (Traits::kStoreOSmem) {
      // This warpgroup's O: kColBlocks boxes of 64 rows x 128 bytes, 128-byte swizzled as TMA expects, written
      // with stmatrix (smem_layout.h gives the lane addresses).
      constexpr int kBoxBytes = kWgmmaM * kSwizzleBytes;
      T* o_tile = smem.o + cw * kWgmmaM * kD;  // [kColBlocks][64][64]
      const uint32_t o_base = smem_addr(o_tile);
      const int barrier = kEpilogueBarrier + cw;
      if (wg_tid == 0) bulk_wait_group_read<0>();  // the previous tile's store has read the buffer
      named_barrier_sync(barrier, kWarpgroupThreads);
      // Column pair j2 is pair j2 % 4 of box j2 / 4 (o_base is 1024-byte aligned, so one lane address serves all).
      const uint32_t lane_addr = o_base + stmatrix_x4_lane_offset(warp * kWarpRows, lane);
      constexpr int kPairsPerBox = kColBlock / 16;
#pragma unroll
      for (int j2 = 0; j2 < kOTiles / 2; ++j2) {
        const uint32_t addr = stmatrix_x4_pair_offset(lane_addr, j2 % kPairsPerBox) + (j2 / kPairsPerBox) * kBoxBytes;
        const float* o8 = acc_o + 8 * j2;  // column tiles 2 j2, 2 j2 + 1
        stmatrix_x4(addr, ET::pack(o8[0] * inv[0], o8[1] * inv[0]), ET::pack(o8[2] * inv[1], o8[3] * inv[1]),
                    ET::pack(o8[4] * inv[0], o8[5] * inv[0]), ET::pack(o8[6] * inv[1], o8[7] * inv[1]));
      }
      fence_proxy_async_smem();
      named_barrier_sync(barrier, kWarpgroupThreads);
      if (wg_tid == 0) {
#pragma unroll
        for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
          tma_store_4d(&tm_o, o_tile + cb * kWgmmaM * kColBlock, cb * kColBlock, m0 + cw * kWgmmaM, tile.h, tile.b);
        }
        bulk_commit_group();
      }
    } else {
      const int64_t q_stride = p.q_row_stride();
      T* gO = static_cast<T*>(p.o) + tile.b * p.q_batch_stride() + m0 * q_stride + int64_t(tile.h) * p.head_dim;
      for_each_acc_pair<kOTiles>(warp_row0, rows_valid, 0, p.head_dim, g, t, [&](int row, int col, int i, int r) {
        *reinterpret_cast<uint32_t*>(gO + row * q_stride + col) = ET::pack(acc_o[i] * inv[r], acc_o[i + 1] * inv[r]);
      });
    }
  };

  int kv_it = 0;  // ring position of the next key tile
  uint32_t q_phase = 0;
  for_each_tile([&](const FwdTile& tile) {
    const AttentionMask mask = mask_for_batch(p, tile.b);
    const int m0 = tile.m_block * kBM;
    const int rows_valid = imin(kBM, p.seqlen_q - m0);
    int n_begin;
    const int n_tiles = key_tiles(mask, m0, &n_begin);
    if (n_tiles == 0) {  // no row of this block sees a key: zeros and lse = +inf
      const int64_t q_stride = p.q_row_stride();
      T* gO = static_cast<T*>(p.o) + tile.b * p.q_batch_stride() + m0 * q_stride + int64_t(tile.h) * p.head_dim;
      float* gLse = p.lse + (int64_t(tile.b) * p.heads_q + tile.h) * p.seqlen_q + m0;
      const int consumer_tid = tid - kWarpgroupThreads;
      constexpr int kConsumerThreads = Traits::kConsumerWarpgroups * kWarpgroupThreads;
      for (int c = consumer_tid; c < rows_valid * (p.head_dim / 8); c += kConsumerThreads) {
        const int row = c / (p.head_dim / 8);
        const int col = (c % (p.head_dim / 8)) * 8;
        *reinterpret_cast<uint4*>(gO + row * q_stride + col) = make_uint4(0, 0, 0, 0);
      }
      for (int r = consumer_tid; r < rows_valid; r += kConsumerThreads) gLse[r] = INFINITY;
      return;
    }
#pragma unroll
    for (int i = 0; i < kOTiles * 4; ++i) acc_o[i] = 0.f;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
    const int row0 = m0 + warp_row0;
    mbar_wait(&smem.q_full, q_phase);
    q_phase ^= 1;

    // Key tile 0: S_0 alone. Key tile i sits at ring position kv_it + i.
    float correction[2];
    mbar_wait(&smem.k_full[slot(kv_it)], phase(kv_it));
    begin_issue();
    wgmma_fence();
    issue_s(slot(kv_it));
    end_issue();
    wgmma_wait<0>();
    fence_regs(acc_s);
    if (lane0) mbar_arrive(&smem.k_empty[slot(kv_it)]);
    softmax(std::true_type{}, mask, row0, n_begin * kBN, correction);
    convert_p();

    // Key tiles [full_begin, full_end) (from n_begin; the first one, already done, excluded) are visible to every
    // row of the block: their steps carry no mask code.
    int full_begin, full_end;
    mask.unmasked_blocks(m0, m0 + kBM, p.seqlen_q, kBN, n_begin, n_begin + n_tiles, &full_begin, &full_end);
    full_begin = imax(full_begin - n_begin, 1);
    full_end = imax(full_end - n_begin, full_begin);
    auto step = [&](int i, auto masked) {
      const int ki = kv_it + i;  // S_i's K and PV_{i-1}'s V (ring position ki - 1)
      mbar_wait(&smem.k_full[slot(ki)], phase(ki));
      mbar_wait(&smem.v_full[slot(ki - 1)], phase(ki - 1));
      begin_issue();
      wgmma_fence();
      issue_s(slot(ki));
      issue_pv(slot(ki - 1));
      end_issue();
      wgmma_wait<1>();  // S_i done; PV_{i-1} may still run
      fence_regs(acc_s);
      if (lane0) mbar_arrive(&smem.k_empty[slot(ki)]);
      softmax(masked, mask, row0, (n_begin + i) * kBN, correction);
      wgmma_wait<0>();  // PV_{i-1} done: O and P's registers are free
      fence_regs(acc_o);
      fence_regs(a_p);
      if (lane0) mbar_arrive(&smem.v_empty[slot(ki - 1)]);
      rescale_o(correction);
      convert_p();
    };
    for (int i = 1; i < full_begin; ++i) step(i, std::true_type{});
    for (int i = full_begin; i < full_end; ++i) step(i, std::false_type{});
    for (int i = full_end; i < n_tiles; ++i) step(i, std::true_type{});
    if (lane0) mbar_arrive(&smem.q_empty);  // every S of the tile is done: the producer may load the next Q

    // Last PV.
    kv_it += n_tiles;
    mbar_wait(&smem.v_full[slot(kv_it - 1)], phase(kv_it - 1));
    begin_issue();
    wgmma_fence();
    issue_pv(slot(kv_it - 1));
    end_issue();
    wgmma_wait<0>();
    fence_regs(acc_o);
    fence_regs(a_p);
    if (lane0) mbar_arrive(&smem.v_empty[slot(kv_it - 1)]);

    epilogue(tile, m0, rows_valid);
  });
  if constexpr (Traits::kStoreOSmem) {
    if (wg_tid == 0) bulk_wait_group<0>();  // shared memory must outlive the last store's reads
  }
  if constexpr (kPingPong) {
    if (cw == 0) named_barrier_sync(my_turn, kPairThreads);  // the last warpgroup's opening arrival
  }
#else
  __trap();  // built for a target without wgmma; the dispatcher only launches this on compute capability 9.0
#endif
}

}  // namespace jax_flash::cuda::sm90
