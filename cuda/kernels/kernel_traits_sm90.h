// Tile choices of the sm_90a kernels (TMA + wgmma + warp specialisation), one traits struct per head-dim class.
// Reasons next to each choice; measured results in NOTES.md.
//
// Forward CTA: one producer warpgroup (a single thread issues every TMA load; the warpgroup gives its registers
// away with setmaxnreg) and kConsumerWarpgroups consumer warpgroups of 64 query rows each. K and V tiles of
// kBlockN keys stream through a kStages-deep ring of shared-memory buffers guarded by mbarriers.
#pragma once

#include <cstdint>

namespace jax_flash::cuda::sm90 {

inline constexpr int kWgmmaM = 64;       // rows of one wgmma (a warpgroup's query rows)
inline constexpr int kWgmmaK = 16;       // reduction depth of one 16-bit wgmma
inline constexpr int kColBlock = 64;     // 16-bit elements per 128-byte swizzled row: TMA box width
inline constexpr int kProducerRegs = 24;   // setmaxnreg budget of the producer warpgroup
inline constexpr int kConsumerRegs = 240;  // ... and of each consumer warpgroup (2 x 128 x 240 + 128 x 24 <= 64K)

template <int kHeadDim_>
struct FwdTraitsSm90;

template <>
struct FwdTraitsSm90<64> {
  static constexpr int kHeadDim = 64;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kBlockN = 128;  // S accumulator 64 registers; small K/V tiles (16 KB) allow a deep ring
  static constexpr int kStages = 3;
};

template <>
struct FwdTraitsSm90<128> {
  static constexpr int kHeadDim = 128;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kBlockN = 128;  // S and O accumulators 64 registers each
  static constexpr int kStages = 2;    // Q 32 KB + 2 x (K 32 KB + V 32 KB) = 160 KB
};

template <>
struct FwdTraitsSm90<256> {
  static constexpr int kHeadDim = 256;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kBlockN = 64;   // O accumulator alone is 128 registers; Q 64 KB + 2 x 64 KB of K/V
  static constexpr int kStages = 2;
};

template <typename T, typename Base>
struct FwdKernelTraitsSm90 : Base {
  static constexpr int kBlockM = Base::kConsumerWarpgroups * kWgmmaM;
  static constexpr int kThreads = (Base::kConsumerWarpgroups + 1) * 128;
  static constexpr int kColBlocks = Base::kHeadDim / kColBlock;  // TMA boxes per tile row

  // Every tile starts on a 1024-byte boundary (the 128-byte swizzle repeats every 8 rows).
  struct alignas(1024) SharedStorage {
    alignas(1024) T q[kBlockM * Base::kHeadDim];                    // [kColBlocks][kBlockM][64], swizzled
    alignas(1024) T k[Base::kStages][Base::kBlockN * Base::kHeadDim];  // [stage][kColBlocks][kBlockN][64]
    alignas(1024) T v[Base::kStages][Base::kBlockN * Base::kHeadDim];  // [stage][kColBlocks][kBlockN][64]
    uint64_t q_full;
    uint64_t k_full[Base::kStages];
    uint64_t v_full[Base::kStages];
    uint64_t k_empty[Base::kStages];
    uint64_t v_empty[Base::kStages];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + slack to align the dynamic base
  static constexpr uint32_t kQBytes = kBlockM * Base::kHeadDim * sizeof(T);
  static constexpr uint32_t kKVBytes = Base::kBlockN * Base::kHeadDim * sizeof(T);  // one K (or V) tile
};

}  // namespace jax_flash::cuda::sm90
