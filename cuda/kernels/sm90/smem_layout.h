// The shared-memory layout every sm_90a operand uses, as pure address arithmetic (host and device, so that
// tests/cpp/smem_layout_check.cc checks it against an independent model of the hardware's layouts):
// - tiles of 128-byte rows (64 16-bit or 32 float32 elements) in TMA's SWIZZLE_128B layout: 16-byte chunk c of row
//   r sits at chunk c ^ (r % 8); the pattern repeats every 8 rows (1024 bytes, so tiles are 1024-byte aligned);
// - the lane addresses of stmatrix.x4 into such a tile (an m16n16 piece of a wgmma accumulator, as 16-bit values),
//   and of stmatrix.x4/.x2.trans into a transposed one;
// - wgmma shared-memory matrix descriptors for such tiles (K-major and MN-major operands).
#pragma once

#include <cstdint>

#include "flash_params.h"  // JF_HD

namespace jax_flash::cuda::sm90 {

inline constexpr int kSwizzleBytes = 128;   // TMA SWIZZLE_128B: rows of 128 bytes, 16-byte chunks XOR (row % 8)
inline constexpr int kSwizzleRows = 8;      // rows in one swizzle period
inline constexpr int kSwizzleChunkBytes = 16;  // the unit the swizzle permutes
inline constexpr int kSwizzleAtomBytes = kSwizzleRows * kSwizzleBytes;  // one swizzle period (1024-byte aligned)

// Byte offset of 16-byte chunk `chunk` of row `row` in a 128-byte-swizzled tile (TMA SWIZZLE_128B layout).
JF_HD uint32_t swizzled_chunk_offset(int row, int chunk) {
  return row * kSwizzleBytes + ((chunk ^ (row % kSwizzleRows)) * kSwizzleChunkBytes);
}

// stmatrix.x4 of an accumulator's 16 rows from row0 and 16 16-bit columns (two 8-column tiles): lane l gives the
// address of row l % 8 of matrix l / 8, where matrices 0 / 1 are rows 0-7 / 8-15 of the first 8-column tile and 2 / 3
// the same rows of the second. The lane's offset for the pair of column tiles at 16-byte chunk 0:
JF_HD uint32_t stmatrix_x4_lane_offset(int row0, int lane) {
  const int mat = lane / 8;
  return swizzled_chunk_offset(row0 + lane % 8 + 8 * (mat % 2), mat / 2);
}
// ... and for the pair `pair` (0..3) of a 128-byte row, starting at chunk 2 pair: a row is one swizzle period, so the
// chunk's swizzle is (2 pair) ^ (the lane's own chunk ^ row % 8), an XOR of bits the lane offset leaves clear when
// the tile base is 1024-byte aligned; `lane_offset` may include that base.
JF_HD uint32_t stmatrix_x4_pair_offset(uint32_t lane_offset, int pair) {
  return lane_offset ^ uint32_t(pair * 2 * kSwizzleChunkBytes);
}

// stmatrix.x4.trans / .x2.trans of a warp's accumulator piece into a transposed 128-byte-swizzled tile (the d256
// backward's P^T and dS^T: one row per key, 64 queries in the row, from S and dP whose rows are queries). With
// .trans, matrix i's row r in memory (the address lane 8 i + r gives) receives column r of the register matrix: a
// key, its 8 queries in the 16 bytes. The piece holds queries [8 q_chunk0, +16) (accumulator rows g, g + 8 of the
// warp) and keys from key_row0: x4 covers two 8-key column tiles (matrices 0 / 1: queries 0-7 / 8-15 of the first
// tile, 2 / 3 of the second, as the accumulator's packed registers), x2 one (matrices 0 / 1, lanes 0-15: the same
// offsets). The next x4 pair is 16 key rows on: + 2048 bytes, the swizzle unchanged.
JF_HD uint32_t stmatrix_x4_trans_lane_offset(int key_row0, int q_chunk0, int lane) {
  const int mat = lane / 8;
  return swizzled_chunk_offset(key_row0 + 8 * (mat / 2) + lane % 8, q_chunk0 + mat % 2);
}

// Shared-memory matrix descriptor for a tile written by TMA with SWIZZLE_128B (rows of 128 bytes; 8-row groups
// 1024 bytes apart, the stride offset). K-major operands (Q, K): the 16-element K slice starts at `start_addr`
// (tile base + 32 bytes per slice inside the row); the leading offset is unused (kKMajorLeadingBytes).
// MN-major operands (V as B of O += P V, dS^T as A of dQ): the leading offset is the distance between 64-element
// column blocks.
inline constexpr uint32_t kKMajorLeadingBytes = 16;
JF_HD uint64_t make_desc_sw128(uint32_t start_addr, uint32_t leading_bytes) {
  constexpr uint64_t kLayoutSw128 = 1;
  uint64_t desc = 0;
  desc |= uint64_t((start_addr & 0x3FFFF) >> 4);
  desc |= uint64_t((leading_bytes >> 4) & 0x3FFF) << 16;
  desc |= uint64_t((kSwizzleAtomBytes >> 4) & 0x3FFF) << 32;  // stride: next 8-row group
  desc |= kLayoutSw128 << 62;
  return desc;
}

// Moves a descriptor's start address by `bytes` (bits 0-13 in 16-byte units; tiles lie inside shared memory, so
// the field cannot overflow). Descriptors are built once per operand and advanced by compile-time offsets.
JF_HD uint64_t desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

}  // namespace jax_flash::cuda::sm90
