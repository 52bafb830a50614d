// Tile choices of the sm_80-class (mma.sync + cp.async) kernels, one traits struct per head-dim class.
// Head dims that are not a class are padded up to the next class inside the kernel (zero-filled loads, masked
// stores). Reasons for each choice are next to it; measured results are in NOTES.md.
#pragma once

#include "kernels/common/warp_reduce.cuh"  // kWarpSize

namespace jax_flash::cuda {

inline constexpr int kMmaM = 16;  // rows of one m16n8k16 MMA
inline constexpr int kMmaK = 16;
inline constexpr int kElemsPerChunk = 8;  // 16-byte cp.async / ldmatrix row chunk of 16-bit elements

// Forward: each warp owns kWarpMTiles x 16 query rows of the CTA's kBlockM; K/V tiles of kBlockN keys stream
// through a two-stage cp.async ring. Two m-tiles per warp let every K/V fragment read from shared memory feed two
// MMAs (half the shared-memory traffic per FLOP) at the price of twice the accumulator registers.
template <int kHeadDim_>
struct FwdTraitsSm80;

template <>
struct FwdTraitsSm80<64> {
  static constexpr int kHeadDim = 64;
  static constexpr int kWarps = 4;
  static constexpr int kWarpMTiles = 2;   // 32 rows per warp, 128 per CTA
  static constexpr int kBlockN = 64;      // S (64) + O (64) accumulators; 48 KB of smem
  static constexpr bool kQInRegs = true;  // 32 registers of Q fragments
  static constexpr int kMinBlocksPerSm = 2;
};

template <>
struct FwdTraitsSm80<128> {
  static constexpr int kHeadDim = 128;
  static constexpr int kWarps = 4;
  static constexpr int kWarpMTiles = 2;    // 32 rows per warp, 128 per CTA: O accumulator is 128 registers
  static constexpr int kBlockN = 64;       // S is 64 registers; 96 KB smem -> 2 CTAs per SM on sm_90
  static constexpr bool kQInRegs = false;  // no room for 64 more registers: Q fragments re-read from smem
  static constexpr int kMinBlocksPerSm = 1;
};

template <>
struct FwdTraitsSm80<256> {
  static constexpr int kHeadDim = 256;
  static constexpr int kWarps = 8;
  static constexpr int kWarpMTiles = 1;    // O accumulator alone is 128 registers
  static constexpr int kBlockN = 32;       // keeps Q (64 KB) + two K/V stages (64 KB) at 128 KB of smem
  static constexpr bool kQInRegs = false;
  static constexpr int kMinBlocksPerSm = 1;
};

template <typename Base>
struct FwdKernelTraits : Base {
  static constexpr int kThreads = Base::kWarps * kWarpSize;
  static constexpr int kBlockM = Base::kWarps * Base::kWarpMTiles * kMmaM;
  static constexpr int kStages = 2;
  static constexpr int kSmemQElems = kBlockM * Base::kHeadDim;
  static constexpr int kSmemKVElems = Base::kBlockN * Base::kHeadDim;  // one stage of K (or of V)
  static constexpr int kSmemElems = kSmemQElems + 2 * kStages * kSmemKVElems;
};

// Backward (key/value stationary): each CTA owns kBlockN keys of one kv head and loops over every query head of
// its group and every query block that can see those keys. Warp w owns keys [16*(w % kWarpsN), +16) and, when
// kSplitD > 1, columns [(w / kWarpsN) * kHeadDim / kSplitD, +kHeadDim / kSplitD) of dK and dV.
template <int kHeadDim_>
struct BwdTraitsSm80;

template <>
struct BwdTraitsSm80<64> {
  static constexpr int kHeadDim = 64;
  static constexpr int kWarps = 4;      // 64 keys per CTA; 56 KB of smem, so several CTAs overlap their phases
  static constexpr int kSplitD = 1;
  static constexpr int kBlockM = 64;
  static constexpr int kMinBlocksPerSm = 3;  // dK+dV are 64 registers: cap at 170 so 12 warps share an SM
};

template <>
struct BwdTraitsSm80<128> {
  static constexpr int kHeadDim = 128;
  static constexpr int kWarps = 4;      // dK+dV accumulators are 128 registers per thread, so 255 registers x 128
                                        // threads and <= 113 KB of smem let two CTAs share an SM
  static constexpr int kSplitD = 1;
  static constexpr int kBlockM = 32;    // S^T and dP^T tiles of 16 registers each leave room for the compiler to
                                        // run loads ahead of the MMAs (64 spilled; NOTES.md)
  static constexpr int kMinBlocksPerSm = 1;
};

template <>
struct BwdTraitsSm80<256> {
  static constexpr int kHeadDim = 256;
  static constexpr int kWarps = 8;
  static constexpr int kSplitD = 2;     // dK+dV of 16 keys x 256 would need 256 registers: split over two warps,
                                        // each recomputing the (cheap to hold) 16 x kBlockM score tile
  static constexpr int kBlockM = 64;
  static constexpr int kMinBlocksPerSm = 1;
};

template <typename Base>
struct BwdKernelTraits : Base {
  static constexpr int kThreads = Base::kWarps * kWarpSize;
  static constexpr int kWarpsN = Base::kWarps / Base::kSplitD;
  static constexpr int kBlockN = kWarpsN * kMmaM;
  static constexpr int kDimPerWarp = Base::kHeadDim / Base::kSplitD;  // dK/dV columns a warp accumulates
  static constexpr int kStages = 2;                                   // Q/dO/lse/dsum ring
  // dQ = dS K: warps tile the kBlockM x kHeadDim result as kDqWarpsM x kDqWarpsD.
  static constexpr int kDqWarpsM = Base::kBlockM / kMmaM;
  static constexpr int kDqWarpsD = Base::kWarps / kDqWarpsM;
  static constexpr int kDqDimPerWarp = Base::kHeadDim / kDqWarpsD;
  static_assert(Base::kWarps % kDqWarpsM == 0, "dQ warp tiling");
  static constexpr int kSmemKVElems = kBlockN * Base::kHeadDim;
  static constexpr int kSmemQElems = Base::kBlockM * Base::kHeadDim;  // one stage of Q (or of dO)
  static constexpr int kDsCols = Base::kBlockM < 64 ? 64 : Base::kBlockM;  // dS^T row, padded for the swizzle
  static constexpr int kSmemDsElems = kBlockN * kDsCols;                    // dS^T tile
  static constexpr int kSmemBytes = (2 * kSmemKVElems + 2 * kStages * kSmemQElems + kSmemDsElems) * 2 +
                                    2 * kStages * Base::kBlockM * int(sizeof(float));
};

// Backward with CTA-wide tiling (flash_bwd_sm80_mma_cpasync_cta.cuh): each CTA owns kBlockN keys of one kv head;
// the three GEMM phases of an iteration are each spread over all warps as a 2-D warp grid, with P^T and dS^T passed
// through shared memory. Per-warp tiles of 32 x 32 or larger make every fragment read from shared memory feed two
// to four MMAs (the per-warp kernel above: one or two).
template <int kHeadDim_>
struct BwdCtaTraitsSm80;

template <>
struct BwdCtaTraitsSm80<64> {
  static constexpr int kHeadDim = 64;
  static constexpr int kWarps = 8;
  static constexpr int kBlockN = 128;  // dK and dV: 64 registers a thread; 97 KB of shared memory
  static constexpr int kBlockM = 64;
  static constexpr int kSWarpsN = 4;   // S^T, dP^T: 4 (keys) x 2 (queries) warps of 32 x 32
  static constexpr int kKvWarpsN = 4;  // dV, dK: 4 (keys) x 2 (columns) warps of 32 x 32
  static constexpr int kDqWarpsM = 4;  // dQ: 4 (queries) x 2 (columns) warps of 16 x 32
  static constexpr int kMinBlocksPerSm = 1;
};

template <>
struct BwdCtaTraitsSm80<128> {
  static constexpr int kHeadDim = 128;
  static constexpr int kWarps = 8;
  static constexpr int kBlockN = 128;  // 128 keys x 128 columns of dK and dV over 8 warps: 128 registers a thread
  static constexpr int kBlockM = 64;   // 160 KB of shared memory: one CTA of 8 warps per SM
  static constexpr int kSWarpsN = 4;   // S^T, dP^T: 4 (keys) x 2 (queries) warps of 32 x 32
  static constexpr int kKvWarpsN = 4;  // dV, dK: 4 (keys) x 2 (columns) warps of 32 x 64
  static constexpr int kDqWarpsM = 2;  // dQ: 2 (queries) x 4 (columns) warps of 32 x 32
  static constexpr int kMinBlocksPerSm = 1;
};

template <>
struct BwdCtaTraitsSm80<256> {
  static constexpr int kHeadDim = 256;
  static constexpr int kWarps = 8;
  static constexpr int kBlockN = 64;   // 64 keys x 256 columns of dK and dV over 8 warps: 128 registers a thread
  static constexpr int kBlockM = 64;   // 209 KB of shared memory (two 64 x 256 stages of Q and of dO): sm_90 only
  static constexpr int kSWarpsN = 2;   // S^T, dP^T: 2 (keys) x 4 (queries) warps of 32 x 16
  static constexpr int kKvWarpsN = 2;  // dV, dK: 2 (keys) x 4 (columns) warps of 32 x 64
  static constexpr int kDqWarpsM = 2;  // dQ: 2 (queries) x 4 (columns) warps of 32 x 64
  static constexpr int kMinBlocksPerSm = 1;
};

template <typename Base>
struct BwdCtaKernelTraits : Base {
  static constexpr int kThreads = Base::kWarps * kWarpSize;
  static constexpr int kStages = 2;  // Q/dO/lse/dsum ring
  static constexpr int kSWarpsM = Base::kWarps / Base::kSWarpsN;
  static constexpr int kSRows = Base::kBlockN / Base::kSWarpsN;  // keys of a warp's S^T tile
  static constexpr int kSCols = Base::kBlockM / kSWarpsM;        // queries of a warp's S^T tile
  static constexpr int kKvWarpsD = Base::kWarps / Base::kKvWarpsN;
  static constexpr int kKvRows = Base::kBlockN / Base::kKvWarpsN;  // keys of a warp's dK/dV tile
  static constexpr int kKvCols = Base::kHeadDim / kKvWarpsD;       // columns of a warp's dK/dV tile
  static constexpr int kDqWarpsD = Base::kWarps / Base::kDqWarpsM;
  static constexpr int kDqRows = Base::kBlockM / Base::kDqWarpsM;  // queries of a warp's dQ tile
  static constexpr int kDqCols = Base::kHeadDim / kDqWarpsD;       // columns of a warp's dQ tile
  static constexpr int kPCols = Base::kBlockM < 64 ? 64 : Base::kBlockM;  // P^T / dS^T row, padded for the swizzle
  static_assert(kSWarpsM * Base::kSWarpsN == Base::kWarps && kKvWarpsD * Base::kKvWarpsN == Base::kWarps &&
                    kDqWarpsD * Base::kDqWarpsM == Base::kWarps,
                "each warp grid must use every warp once");
  static_assert(kSRows % 16 == 0 && kSCols % 16 == 0 && kKvRows % 16 == 0 && kKvCols % 16 == 0 &&
                    kDqRows % 16 == 0 && kDqCols % 16 == 0,
                "warp tiles are whole 16 x 16 MMA fragments");
  static_assert(((kSCols / 8) & (kSCols / 8 - 1)) == 0 && kSCols <= 64,
                "P^T stores step through a warp's chunks by XOR: a power of two within a 64-column row");
  static_assert(Base::kBlockM % 16 == 0 && Base::kBlockN % 16 == 0, "blocks are whole MMA k-steps");
  static constexpr bool is_pow2(int x) { return (x & (x - 1)) == 0; }
  static_assert(is_pow2(kKvCols / 8) && is_pow2(kDqCols / 8) && is_pow2(kDqRows / 8),
                "fragment loads step through a warp's chunks by XOR: chunk counts must be powers of two");
};

}  // namespace jax_flash::cuda
