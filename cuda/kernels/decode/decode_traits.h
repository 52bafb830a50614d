// Tile choices of the decode kernels (flash_decode.cuh, sm90/flash_decode_wgmma_sm90.cuh), in one place and
// host-visible: the launchers, the handler's support check and the split count (shared memory, threads) read them.
#pragma once

namespace jax_flash::cuda::decode {

// Packed query rows (query heads per kv head x Tq) -> 16-row MMA tiles per CTA (1, 2, 4 or 8; 0: too many).
constexpr int RowTiles(int rows) {
  return rows <= 16 ? 1 : rows <= 32 ? 2 : rows <= 64 ? 4 : rows <= 128 ? 8 : 0;
}

// Splits of a key range the combine kernel merges (its weights sit in shared memory).
inline constexpr int kMaxDecodeSplits = 1024;

// Batches of one split per sequence take their sequences longest first up to this many sequences (each block ranks
// the batch's lengths: batch^2 / threads comparisons; split_mainloop.cuh batch_element). dec16 ranked up to 256:
// on an H200 the ragged B 64 rows gained 8-33 % but the B 256 ones lost 18-37 % to the ranking every block redoes.
inline constexpr int kLongestFirstMaxBatch = 64;
// Whether a call's blocks rank its sequences (else block z computes batch element z).
constexpr bool LongestFirst(int num_splits, int batch) {
  return num_splits == 1 && batch >= 2 && batch <= kLongestFirstMaxBatch;
}

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

// Shared memory of the split kernel for head-dim class kd (64, 128, 256) and `row_tiles` row tiles.
constexpr int SmemBytes(int kd, int row_tiles) {
  return (row_tiles * 16 * kd + 2 * kStages * BlockN(kd) * kd) * 2 + kStages * BlockN(kd) * 4;
}
// Threads of the split kernel for head-dim class kd and `row_tiles` row tiles.
constexpr int Threads(int kd, int row_tiles) { return Warps(kd, row_tiles) * 32; }

// The sm_90a wgmma split kernel (kernels/sm90/flash_decode_wgmma_sm90.cuh), for more than 32 packed rows at head dims
// up to 128, where mma.sync's issue rate paces the stream: each warpgroup computes 64 packed rows; 65-128 rows take
// one block of two warpgroups that share every K/V tile (one copy of each tile per split). K/V tiles of 64 keys; the
// ring as deep as the shared memory allows at the blocks an SM holds: one warpgroup 3 stages at head dim 128 (112 KB,
// two blocks an SM) or 4 at 64; two warpgroups 6 stages at 128 (226 KB, one block an SM) or 5 at 64 (two an SM).
inline constexpr int kWgmmaMinRows = 33;
inline constexpr int kWgmmaGroupRows = 64;  // packed rows per warpgroup
inline constexpr int kWgmmaBlockN = 64;
constexpr int WgmmaGroups(int rows) { return rows <= kWgmmaGroupRows ? 1 : 2; }
constexpr int WgmmaStages(int kd, int groups) { return groups == 1 ? (kd <= 64 ? 4 : 3) : (kd <= 64 ? 5 : 6); }
constexpr int WgmmaSmemBytes(int kd, int groups) {
  return (groups * kWgmmaGroupRows * kd + 2 * WgmmaStages(kd, groups) * kWgmmaBlockN * kd) * 2 +
         WgmmaStages(kd, groups) * kWgmmaBlockN * 4;
}
constexpr int WgmmaThreads(int groups) { return groups * 128; }
static_assert(WgmmaSmemBytes(128, 2) <= 227 * 1024 && 2 * (WgmmaSmemBytes(64, 2) + 1024) <= 228 * 1024 &&
              2 * (WgmmaSmemBytes(128, 1) + 1024) <= 228 * 1024);

}  // namespace jax_flash::cuda::decode
