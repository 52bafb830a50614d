// Tile choices of the decode kernels (flash_decode.cuh), in one place and host-visible: the launcher and the
// handler's support check (shared memory) read them.
#pragma once

namespace jax_flash::cuda::decode {

// Packed query rows (query heads per kv head x Tq) -> 16-row MMA tiles per CTA (1, 2, 4 or 8; 0: too many).
constexpr int RowTiles(int rows) {
  return rows <= 16 ? 1 : rows <= 32 ? 2 : rows <= 64 ? 4 : rows <= 128 ? 8 : 0;
}

// Splits of a key range the combine kernel merges (its weights sit in shared memory).
inline constexpr int kMaxDecodeSplits = 1024;

// Keys per K/V tile and pipeline depth by head-dim class.
constexpr int BlockN(int kd) { return kd <= 128 ? 64 : 32; }
inline constexpr int kStages = 3;
// Warps: 4 for one row tile (and for head dim 256 up to two, whose 32-key tiles take two slices at most), else 8.
// Each row tile's keys are sliced across warps (a tile's kBlockN keys split into kSlices slices of at least 16
// keys, one warp each), so that every warp computes; the slices merge at the end.
constexpr int Warps(int kd, int row_tiles) { return row_tiles == 1 || (kd > 128 && row_tiles == 2) ? 4 : 8; }
constexpr int Slices(int kd, int row_tiles) {
  const int by_warps = Warps(kd, row_tiles) / row_tiles;
  const int by_keys = BlockN(kd) / 16;
  return by_warps < by_keys ? by_warps : by_keys;
}

template <int kHeadDim, int kRowTiles>
struct DecodeTraits {
  static constexpr int kD = kHeadDim;
  static constexpr int kBlockN = BlockN(kHeadDim);          // keys per K/V tile
  static constexpr int kStages = decode::kStages;           // K/V tiles in flight (cp.async groups)
  static constexpr int kRows = kRowTiles * 16;              // packed query rows per CTA
  static constexpr int kWarps = Warps(kHeadDim, kRowTiles);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kSlices = Slices(kHeadDim, kRowTiles);  // key slices per row tile (one warp each)
  static constexpr int kSliceN = kBlockN / kSlices;             // keys per slice
  static constexpr int kSmemElems = kRows * kD + 2 * kStages * kBlockN * kD;  // Q, then K and V x stages
  // ... then the page ids of the stages' keys (int32). Dynamic shared memory only: the tiles' swizzled addressing
  // needs the base aligned to a row's bytes, which static shared memory placed before it would break.
  static constexpr int kSmemBytes = kSmemElems * 2 + kStages * kBlockN * 4;
  static_assert(kSliceN % 16 == 0 && kRowTiles * kSlices <= kWarps);
  // Slices 1.. of each row tile leave their float32 partial O and (max, sum) in shared memory for slice 0 to merge,
  // reusing the K/V stages.
  static constexpr int kMergeSlots = kRowTiles * (kSlices - 1);
  static_assert(kMergeSlots * 32 * (kD / 8 * 4 + 4) * 4 <= 2 * kStages * kBlockN * kD * 2);
};

// Shared memory of the split kernel for head-dim class kd (64, 128, 256) and `row_tiles` row tiles.
constexpr int SmemBytes(int kd, int row_tiles) {
  return (row_tiles * 16 * kd + 2 * kStages * BlockN(kd) * kd) * 2 + kStages * BlockN(kd) * 4;
}
// Threads of the split kernel for head-dim class kd and `row_tiles` row tiles.
constexpr int Threads(int kd, int row_tiles) { return Warps(kd, row_tiles) * 32; }
static_assert(SmemBytes(256, 8) == DecodeTraits<256, 8>::kSmemBytes &&
              SmemBytes(64, 1) == DecodeTraits<64, 1>::kSmemBytes);

}  // namespace jax_flash::cuda::decode
