// Tile choices of the sm_80-class (mma.sync + cp.async) kernels, one traits struct per head-dim class.
// Head dims that are not a class are padded up to the next class inside the kernel (zero-filled loads, masked
// stores). Reasons for each choice are next to it; measured results are in NOTES.md.
#pragma once

namespace jax_flash::cuda {

inline constexpr int kWarpSize = 32;
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

}  // namespace jax_flash::cuda
