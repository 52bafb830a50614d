// Tile choices of the decode kernels (flash_decode.cuh, sm90/flash_decode_wgmma_sm90.cuh), in one place and
// host-visible: the launchers, the handler's support check and the split count (shared memory, threads) read them.
#pragma once

#include <cstdint>

namespace jax_flash::cuda::decode {

// Packed query rows (query heads per kv head x Tq) -> 16-row MMA tiles per CTA (1, 2, 4 or 8; 0: too many).
constexpr int RowTiles(int rows) {
  return rows <= 16 ? 1 : rows <= 32 ? 2 : rows <= 64 ? 4 : rows <= 128 ? 8 : 0;
}

// Splits of a key range the combine kernel merges (its weights sit in shared memory).
inline constexpr int kMaxDecodeSplits = 1024;

// Which calls' blocks take the batch's sequences longest first (each block ranks the batch's tile counts in shared
// memory by buckets: split_mainloop.cuh batch_element), decided by the launchers for the kernel they launch
// (FlashParams::rank_batch):
//   - one split per sequence, up to kLongestFirstMaxBatch sequences (dec16 ranked up to 256 whatever the grid,
//     pairwise: on an H200 the ragged B 64 rows gained 8-33 % but the B 256 ones lost 18-37 % to the ranking), but
//     in the TMA kernel only past one wave: within one wave no order starts a unit sooner, and an unranked grid
//     keeps that kernel's early Q and first tile (kUnitEarly);
//   - in the TMA kernel, any grid of more than one and at most kRankMaxWaves waves of its resident blocks, up to
//     kRankMaxBatch sequences. The same ragged lengths handed over longest first ran 8/1 at Tq 16 256 x 1024 x1.24
//     (two waves) and 8/1 64 x 8192 x1.12-1.16 (two waves of splits), but 64/8 256 x 1024 (8-16 waves) x0.96 (NOTES,
//     session 73); ranked in the kernel, 8/1 Tq 16 64 x 8192 ragged ran x1.11 and 64/8 Tq 16 8 x 32768 ragged
//     x1.02-1.03, while the mma.sync kernel's split grids of the same rule lost x0.97 on paged ragged rows at Tq 1
//     (NOTES, session 74).
inline constexpr int kLongestFirstMaxBatch = 64;
inline constexpr int kRankMaxWaves = 4;  // (unranked TMA grids past it run persistent: launch_decode_sm90.cuh)
inline constexpr int kRankMaxBatch = 256;
static_assert(kLongestFirstMaxBatch <= kRankMaxBatch, "batch_element's scratch holds kRankMaxBatch sequences");
// batch_element's shared-memory scratch (ints): the buckets' histogram (a warp's lanes), each warp's most tiles,
// the sequence found, and each sequence's key.
inline constexpr int kRankBuckets = 32;
inline constexpr int kRankMaxWarps = 32;
constexpr int RankScratchInts(int batch) { return kRankBuckets + kRankMaxWarps + 1 + batch; }
// units: the grid's blocks; resident: blocks of the kernel the GPU holds at once; tma: the launch is the TMA kernel's.
constexpr bool RankBatch(int num_splits, int batch, int64_t units, int64_t resident, bool tma) {
  if (batch < 2) return false;
  if (num_splits == 1 && batch <= kLongestFirstMaxBatch && (!tma || units > resident)) return true;
  return tma && batch <= kRankMaxBatch && units > resident && units <= kRankMaxWaves * resident;
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
