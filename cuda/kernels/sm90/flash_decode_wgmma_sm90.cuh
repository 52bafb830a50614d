// The sm_90a decode split kernel for many packed rows (more than 32 query heads per kv head x Tq, head dims up to
// 128): the mma.sync kernel (decode/flash_decode.cuh) issues 16 x 8 products one warp at a time, and at 32-128 rows a
// K/V byte carries 64-128 FLOP, so its issue rate, not memory, paces the stream there (H200: 1-2.2 TB/s at Tq 16).
// Here each warpgroup computes 64 packed rows, S = Q K^T (both from shared memory) and O += P V (P from registers)
// with wgmma over the whole 64-key tile; 65-128 rows run as one block of two warpgroups that share each K/V tile
// (each tile copied once per split, a deeper ring: decode_traits.h), not as two 64-row blocks that both copy it.
//
// Everything else is the mma.sync kernel's (decode/split_mainloop.cuh): CTA (split, kv head, batch), the split's key
// tiles streamed through a cp.async ring (dense or paged, ids clamped), bottom-right causal rows and windows, float32
// partial results that a combine kernel (decode/combine.cuh) merges (with one split the final O and lse, written
// here). The tiles sit in TMA's SWIZZLE_128B layout (64-column blocks of 128-byte rows; sm90/smem_layout.h), which
// wgmma's descriptors read; cp.async writes them in the generic proxy, so each thread fences its landed copies to the
// async proxy before the CTA barrier that publishes a tile.
// Thread layout (as the forward's): warp w, lane = 4 g + t, holds the block's rows 16 w + g and 16 w + g + 8, columns
// 8 j + 2 t (+1) of every 8-wide column tile j of S and O.
#pragma once

#include <cmath>

#include "flash_params.h"
#include "score_mod.h"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/decode/decode_traits.h"
#include "kernels/decode/split_mainloop.cuh"
#include "kernels/sm90/attention_gemms_sm90.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/smem_layout.h"
#include "kernels/sm90/utils_sm90.cuh"
#include "kernels/sm90/wgmma_sm90.cuh"

namespace jax_flash::cuda::sm90 {

// kGroups warpgroups (1 or 2), each computing 64 of the block's packed rows.
template <int kHeadDim, int kGroups>
struct DecodeWgmmaTraits {
  static constexpr int kD = kHeadDim;
  static constexpr int kBlockN = decode::kWgmmaBlockN;
  static constexpr int kStages = decode::WgmmaStages(kHeadDim, kGroups);
  static constexpr int kRows = kGroups * decode::kWgmmaGroupRows;
  static constexpr int kThreads = decode::WgmmaThreads(kGroups);
  static_assert(kD % kColBlock == 0 && kThreads == kGroups * kWarpgroupThreads &&
                decode::kWgmmaGroupRows == kWgmmaM);
  // Blocks an SM holds (decode_traits.h's shared-memory choice, which the split count assumes): the register
  // budget is held to it, so that a change cannot halve the occupancy unnoticed (ptxas spills instead).
  static constexpr int kMinBlocksPerSm = kGroups == 1 || kD <= 64 ? 2 : 1;
  // Tiles of kTileRows rows: 64-column blocks of rows x 128 bytes, 16-byte chunks swizzled inside each row.
  template <int kTileRows>
  __device__ __forceinline__ static int offset(int r, int col) {
    return (col / kColBlock) * kTileRows * kColBlock +
           int(swizzled_chunk_offset(r, (col % kColBlock) / decode::kElems)) / 2 + col % decode::kElems;
  }
  __device__ __forceinline__ static int q_offset(int r, int col) { return offset<kRows>(r, col); }
  __device__ __forceinline__ static int kv_offset(int key, int col) { return offset<kBlockN>(key, col); }
  // This thread's landed cp.async copies (generic proxy) become visible to wgmma's operand reads (async proxy).
  __device__ __forceinline__ static void tile_landed() { fence_proxy_async_smem(); }
  // P V of a tile runs under the next tile's softmax: its V stage is read until that compute returns.
  static constexpr int kReadLag = 1;
  // A paged call's K/V copies without the evict-first L2 hint at head dim 64: with it, CUDA 13.0's ptxas (V13.0.88)
  // emitted the d64 paged kernels' copies with uniform registers it never wrote (LDGSTS [R + UR0], desc[UR1]: an
  // illegal instruction at run time; tools/sass_check.py descs finds them; NOTES session 72).
  static constexpr bool kPagedKvEvictFirst = kHeadDim != 64;
};

// kPaged: the call has a page table; kSoftCap: a logit soft cap (its tanh compiled in only then).
template <typename T, typename Traits, bool kPaged, bool kSoftCap>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kMinBlocksPerSm) flash_decode_wgmma_kernel(
    const FlashParams p) {
  constexpr int kD = Traits::kD;
  constexpr int kBN = Traits::kBlockN;
  constexpr int kSTiles = kBN / 8;  // 8-wide column tiles of S
  constexpr int kOTiles = kD / 8;   // 8-wide column tiles of O
  using ET = ElemTraits<T>;

  extern __shared__ __align__(1024) unsigned char smem_raw[];  // no static shared memory before it (SplitSmem)
  const decode::SplitSmem<T, Traits> smem(smem_raw);

  const int group = p.group_size();
  const int rows = group * p.seqlen_q;  // packed rows of this kv head, all in this block
  const int split = blockIdx.x;
  const int hk = blockIdx.y;
  const int tid = threadIdx.x;
  // the K ring is free until the stream starts
  const int b = decode::batch_element<kBN, Traits::kThreads>(p, blockIdx.z, reinterpret_cast<int*>(smem.k), tid);
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;
  const int t = lane % 4;
  const int row0 = warp * kWarpRows;  // this warp's first packed row (warpgroup w holds rows 64 w .. 64 w + 63)

  const decode::DecodeRange range = decode::decode_range(p, b);
  const decode::SplitTiles tiles =
      decode::split_tiles<kBN, Traits::kThreads>(p, range, split, smem.pool_row[0], tid);
  if (tiles.end <= tiles.begin) {
    decode::mark_split_empty<T>(p, split, b, hk, 0, rows, tid, Traits::kThreads);
    return;
  }

  float acc_o[kOTiles * 4];
#pragma unroll
  for (int i = 0; i < kOTiles * 4; ++i) acc_o[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  int lo_r[2], hi_r[2];  // this thread's two rows' visible keys
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) decode::row_keys(p, range, row0 + g + 8 * rr, group, rows, &lo_r[rr], &hi_r[rr]);
  const SoftCap cap(p);

  // Q: column block cb starts at q + cb * kRows * 64, its rows at 128-byte pitch; this warpgroup's 64 rows from
  // row 64 (tid / 128) (a whole number of 1024-byte swizzle atoms in). The warpgroup index passes through
  // warp_uniform: without it every kernel of this file grows by 24-88 instructions (d128, NOTES session 52).
  const uint32_t q_base = smem_addr(smem.q) + warp_uniform(tid / kWarpgroupThreads) * kWgmmaM * kSwizzleBytes;
  constexpr uint32_t kQColBlockBytes = Traits::kRows * kSwizzleBytes;
  constexpr uint32_t kKVColBlockBytes = kBN * kSwizzleBytes;
  constexpr uint32_t kStageBytes = kBN * kD * sizeof(T);
  // The K and V rings' addresses as warp-uniform values in the dense kernels: the dense loader's copies derive their
  // per-thread addresses from the same bases, and sharing them put every wgmma descriptor of the loop (Q's too) in
  // vector registers (40 R2UR a tile; 926 -> 847 instructions a tile at d128). The paged kernels keep theirs uniform
  // unaided, and there the shuffle cost the one-warpgroup kernel its K descriptors (894 -> 938).
  auto ring_base = [](const T* ring) {
    return kPaged ? smem_addr(ring) : uint32_t(warp_uniform(int(smem_addr(ring))));
  };
  const uint32_t k_base0 = ring_base(smem.k);
  const uint32_t v_base0 = ring_base(smem.v);

  // Per tile i: S_i and P_{i-1} V_{i-1} issued together, the softmax of S_i while P V runs (intra-warpgroup
  // overlap, as in the forward's main loop); the last tile's P V after the stream.
  uint32_t a_p[kBN / kWgmmaK][4];  // P of the previous tile as wgmma A fragments, 16 keys per step
  int pv_stage = -1;               // that tile's stage (-1: none yet)
  auto issue_pv_prev = [&] {  // O += P V: V read N-major, 64-dim column blocks kKVColBlockBytes apart
    issue_pv<kBN, kD, T>(acc_o, a_p, v_base0 + pv_stage * kStageBytes, kKVColBlockBytes);
  };
  decode::stream_split<T, Traits, kPaged>(p, range, tiles, b, hk, 0, rows, smem, tid, [&](int stage, int key0) {
    float acc_s[kSTiles * 4];
    wgmma_fence();
    issue_qk<kBN, kD, T>(acc_s, q_base, kQColBlockBytes, k_base0 + stage * kStageBytes, kKVColBlockBytes);
    // (warp_uniform: without it ptxas took the branch for a divergent one in the one-warpgroup dense kernels and
    // serialised every wgmma there, warning C7520)
    if (warp_uniform(pv_stage) >= 0) {
      issue_pv_prev();
      wgmma_wait<1>();  // S done; P V may still run
    } else {
      wgmma_wait<0>();
    }
    fence_regs(acc_s);

    float correction[2];
    decode::softmax_tile<kSTiles, kSoftCap>(acc_s, key0, t, lo_r, hi_r, cap, p.scale_log2, row_max, row_sum,
                                            correction);
    wgmma_wait<0>();  // the previous P V done: O and P's registers are free
    fence_regs(acc_o);
    fence_regs(a_p);
    // Over a long cache the max settles early: most tiles skip these multiplies on the tile-to-tile path.
    if (decode::warp_rows_rescale(correction)) {
#pragma unroll
      for (int i = 0; i < kOTiles * 4; ++i) acc_o[i] *= correction[(i / 2) % 2];
    }
#pragma unroll
    for (int kk = 0; kk < kBN / kWgmmaK; ++kk) {  // 16 keys per step = S column tiles 2 kk, 2 kk + 1
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4) a_p[kk][q4] = ET::pack(acc_s[8 * kk + 2 * q4], acc_s[8 * kk + 2 * q4 + 1]);
    }
    pv_stage = stage;
  });
  wgmma_fence();
  issue_pv_prev();  // the split has a tile: pv_stage is set (stream_split's last tile stage is not rewritten)
  wgmma_wait<0>();
  fence_regs(acc_o);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) row_sum[rr] = quad_sum(row_sum[rr]);
  decode::store_split_rows<T, kOTiles>(p, split, b, hk, rows, row0, g, t, acc_o, row_max, row_sum);
}

}  // namespace jax_flash::cuda::sm90
