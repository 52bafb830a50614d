// Check of cuda/kernels/sm90/smem_layout.h (the sm_90a kernels' shared-memory layout arithmetic) on the CPU, against
// an independent model of the hardware's layouts written from the PTX ISA and CUTLASS's documentation, not from the
// code under test:
// - swizzle: swizzled_chunk_offset(row, chunk) is where TMA's SWIZZLE_128B puts 16-byte chunk `chunk` of row `row`
//   (tile bases 0 and 1024 k), for rows [0, 256); over 64 (and 256) rows the map is a bijection onto the tile's chunks;
// - stmatrix: the whole stmatrix.x4 store of a warp's m16n16 accumulator piece, with the lane addresses from
//   stmatrix_x4_lane_offset / stmatrix_x4_pair_offset composed as the forward's O epilogue and the backward's dS^T
//   stores compose them, puts every (thread, register, element) at the (row, column) of the logical tile that the
//   accumulator layout says it holds, for every row0 = 16 i of 64- and 128-row column blocks, every pair and column
//   block, at 1024-byte-aligned bases; at bases that are not 1024-byte aligned it must not (the precondition is real);
// - stmatrix .trans: stmatrix_x4_trans_lane_offset (.x4 and, through lanes 0-15, .x2) puts the d256 backward's S / dP
//   accumulator pieces (queries as rows, a warpgroup's 40 keys as columns) at (key, query) of a [key][64 queries]
//   tile, for both warpgroups' key ranges and every warp;
// - descriptors: make_desc_sw128 decodes (with the PTX field layout) to the start address, leading byte offset,
//   stride byte offset 1024, base offset 0 and 128-byte swizzle, reserved bits clear, for every 16-byte-aligned
//   address below 227 KB and the leading offsets the kernels use; desc_advance by the offsets the kernels use (k-steps,
//   column blocks, 16-row steps, stage and buffer strides, from the real traits in kernel_traits_sm90.h) decodes to
//   the advanced address (below 2^18);
// - operands: the elements a wgmma reads through such descriptors (CUTLASS's canonical K-major and MN-major 128-byte
//   swizzled layouts) are the elements TMA wrote there, for every k-step, row / column block and stage of the tiles
//   of every sm_90a traits struct;
// - dQ staging order: DqFragmentOrder::pairs (kernel_traits_sm90.h) gives back, for every float4 slot the d64/d128
//   backward stages, the (row, column) pairs the f32 accumulator layout puts in it, and covers the tile once; so
//   does DqTransposedFragmentOrder::elems for the d256 redesign's dQ^T adds;
// - the constants equal the model's.
// Mutation check: the same checks run on deliberately broken copies of each function (defined below); each must be
// detected. Prints "ok <cases>" (then which checks caught each mutant) only if the real functions pass and every
// mutant fails; otherwise the first failures; exit 1. Built and run by tests/test_smem_layout.py.
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <vector>

// kernel_traits_sm90.h is read for its tile shapes; its split-d shared storage names CUDA's float4, declared here
// as CUDA declares it (four floats, 16-byte aligned) for the host build.
struct alignas(16) float4 {
  float x, y, z, w;
};
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/smem_layout.h"

namespace sm90 = jax_flash::cuda::sm90;

// ---- the model (PTX ISA, CUDA TMA and CUTLASS documentation) -------------------------------------------------------
namespace model {

constexpr uint32_t kRowBytes = 128;    // SWIZZLE_128B: the box's inner dimension spans one 128-byte row
constexpr uint32_t kChunkBytes = 16;   // the swizzle permutes 16-byte units
constexpr uint32_t kPeriodBytes = 1024;  // the pattern repeats every 8 rows of 128 bytes
constexpr int kElemBytes = 2;          // 16-bit elements (bf16 / fp16)

// CUTLASS Swizzle<B=3, M=4, S=3> applied to a shared-memory byte address (CUTLASS composes it with the smem pointer;
// TMA SWIZZLE_128B is the same pattern): address bits [M, M+B) (the 16-byte chunk in a 128-byte row) are XORed with
// bits [M+S, M+S+B) (the row within the 1024-byte period). An involution: bits [7, 10) are left as they are.
inline uint32_t swizzle(uint32_t addr) {
  constexpr uint32_t kB = 3, kM = 4, kS = 3;
  constexpr uint32_t kYyyMask = ((1u << kB) - 1) << (kM + kS);
  return addr ^ ((addr & kYyyMask) >> kS);
}

// Where TMA (SWIZZLE_128B) writes byte `byte` of row `row` of a box whose shared-memory destination is `box`.
inline uint32_t tma_addr(uint32_t box, int row, int byte) { return swizzle(box + row * kRowBytes + byte); }

// stmatrix.sync.aligned.m8n8.x4.shared.b16 (PTX ISA): lanes 8 i .. 8 i + 7 give the addresses of rows 0..7 of matrix
// i (a row: 8 16-bit elements, 16 contiguous bytes, 16-byte aligned); register i of each lane is its fragment of
// matrix i: lane l holds row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1. Returns where element `elem` of register
// `reg` of lane `lane` is written.
inline uint32_t stmatrix_x4_dest(const uint32_t (&row_addr)[32], int lane, int reg, int elem) {
  const int row = lane / 4, col = 2 * (lane % 4) + elem;
  return row_addr[8 * reg + row] + col * kElemBytes;
}

// stmatrix ... .trans: as above, but matrix i is transposed on the way: the row in memory that lane 8 i + r addresses
// receives column r of the matrix, so element (row l / 4, column 2 (l % 4) + e) of lane l's register i goes to
// memory row 2 (l % 4) + e, element l / 4. (.x2: matrices 0, 1 only, addressed by lanes 0-15.)
inline uint32_t stmatrix_trans_dest(const uint32_t (&row_addr)[32], int lane, int reg, int elem) {
  const int row = lane / 4, col = 2 * (lane % 4) + elem;
  return row_addr[8 * reg + col] + row * kElemBytes;
}

// The element of a warp's 16-row accumulator slice (rows from row0) that register `reg` of lane `lane` carries in the
// stmatrix of column tiles 2 j2, 2 j2 + 1 (columns 16 j2 .. 16 j2 + 15). wgmma / mma f32 accumulator: lane 4 g + t
// holds rows g and g + 8, columns 2 t, 2 t + 1 of each 8-column tile; packed to 16 bits, register i is matrix i:
// 0 / 1 rows 0-7 / 8-15 of the first column tile, 2 / 3 the same rows of the second.
struct Element {
  int row, col;
};
inline Element accumulator_element(int row0, int j2, int lane, int reg, int elem) {
  const int g = lane / 4, t = lane % 4;
  return {row0 + g + 8 * (reg % 2), 16 * j2 + 8 * (reg / 2) + 2 * t + elem};
}

// wgmma shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): bits 0-13 start address >> 4,
// 16-29 leading dimension byte offset >> 4, 32-45 stride dimension byte offset >> 4, 49-51 matrix base offset,
// 62-63 swizzle mode (0 none, 1 128-byte, 2 64-byte, 3 32-byte); the other bits unused (kept zero).
constexpr uint32_t kSwizzle128B = 1;
struct Desc {
  uint32_t start, lead, stride, base_offset, swizzle_mode;
  uint64_t reserved;  // the unused bits
};
inline Desc decode(uint64_t d) {
  auto field = [&](int lo, int bits) { return uint32_t((d >> lo) & ((uint64_t(1) << bits) - 1)); };
  constexpr int kFields[5][2] = {{0, 14}, {16, 14}, {32, 14}, {49, 3}, {62, 2}};  // (lowest bit, bits)
  uint64_t used = 0;
  for (const auto& f : kFields) used |= ((uint64_t(1) << f[1]) - 1) << f[0];
  return {field(0, 14) << 4, field(16, 14) << 4, field(32, 14) << 4, field(49, 3), field(62, 2), d & ~used};
}

// Where a wgmma reads 16-bit element (mn, k) of an operand through a descriptor, CUTLASS's canonical layouts for the
// 128-byte swizzle (make_gmma_desc; T = 8 elements = 16 bytes, offsets in elements, SBO / LBO in bytes):
//   K-major:  Swizzle<3,4,3> o smem_ptr o ((8,m),(T,2)):((8T,SBO),(1,T))
//   MN-major: Swizzle<3,4,3> o smem_ptr o ((T,8,m),(8,k)):((1,T,LBO),(8T,SBO))
// (the leading offset is unused by K-major swizzled layouts: one wgmma's 16 k-elements lie inside a 128-byte row).
inline uint32_t kmajor_addr(const Desc& d, int mn, int k) {
  const uint32_t off = ((mn % 8) * 64 + (k % 8) + (k / 8) * 8) * kElemBytes + (mn / 8) * d.stride;
  return swizzle(d.start + off);
}
inline uint32_t mnmajor_addr(const Desc& d, int mn, int k) {
  const uint32_t off = ((mn % 8) + ((mn / 8) % 8) * 8 + (k % 8) * 64) * kElemBytes + (mn / 64) * d.lead +
                       (k / 8) * d.stride;
  return swizzle(d.start + off);
}

}  // namespace model

// ---- implementations under test: the real functions and mutants -----------------------------------------------------
struct Real {
  static uint32_t chunk_offset(int row, int chunk) { return sm90::swizzled_chunk_offset(row, chunk); }
  static uint32_t lane_offset(int row0, int lane) { return sm90::stmatrix_x4_lane_offset(row0, lane); }
  static uint32_t pair_offset(uint32_t lane_off, int pair) { return sm90::stmatrix_x4_pair_offset(lane_off, pair); }
  static uint32_t trans_x4_offset(int key_row0, int q_chunk0, int lane) {
    return sm90::stmatrix_x4_trans_lane_offset(key_row0, q_chunk0, lane);
  }
  static uint64_t make_desc(uint32_t addr, uint32_t lead) { return sm90::make_desc_sw128(addr, lead); }
  static uint64_t advance(uint64_t desc, uint32_t bytes) { return sm90::desc_advance(desc, bytes); }
  template <class Traits>
  static void dq_pairs(int slot, int (&row)[2], int (&col)[2]) {
    sm90::DqFragmentOrder<Traits>::pairs(slot, row, col);
  }
};

// Each mutant breaks one function (the others are the real ones).
struct SwizzleRowMod4 : Real {  // XOR with row % 4 instead of row % 8
  static uint32_t chunk_offset(int row, int chunk) { return row * 128 + ((chunk ^ (row % 4)) * 16); }
};
struct SwizzleNone : Real {  // plain row-major rows
  static uint32_t chunk_offset(int row, int chunk) { return row * 128 + chunk * 16; }
};
struct SwizzleRowDiv2 : Real {  // XOR with the wrong row bits
  static uint32_t chunk_offset(int row, int chunk) { return row * 128 + ((chunk ^ ((row / 2) % 8)) * 16); }
};
struct LaneMatricesSwapped : Real {  // matrix bit 0 taken as the column tile, bit 1 as the row half
  static uint32_t lane_offset(int row0, int lane) {
    const int mat = lane / 8;
    return sm90::swizzled_chunk_offset(row0 + lane % 8 + 8 * (mat / 2), mat % 2);
  }
};
struct LaneRowFromQuad : Real {  // row from the accumulator's lane / 4 instead of the address lane's lane % 8
  static uint32_t lane_offset(int row0, int lane) {
    const int mat = lane / 8;
    return sm90::swizzled_chunk_offset(row0 + (lane / 4) % 8 + 8 * (mat % 2), mat / 2);
  }
};
struct PairAdded : Real {  // pair offset added, not XORed into the swizzled chunk
  static uint32_t pair_offset(uint32_t lane_offset, int pair) { return lane_offset + pair * 32; }
};
struct PairOneChunk : Real {  // one 16-byte chunk per pair instead of two
  static uint32_t pair_offset(uint32_t lane_offset, int pair) { return lane_offset ^ uint32_t(pair * 16); }
};
struct TransX4MatricesSwapped : Real {  // .trans x4: matrix bit 0 taken as the key tile, bit 1 as the query half
  static uint32_t trans_x4_offset(int key_row0, int q_chunk0, int lane) {
    const int mat = lane / 8;
    return sm90::swizzled_chunk_offset(key_row0 + 8 * (mat % 2) + lane % 8, q_chunk0 + mat / 2);
  }
};
struct DescLeadShifted : Real {  // leading-offset field one bit too high
  static uint64_t make_desc(uint32_t addr, uint32_t lead) {
    return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t((lead >> 4) & 0x3FFF) << 17 | uint64_t(1024 >> 4) << 32 |
           uint64_t(1) << 62;
  }
};
struct DescStride512 : Real {  // stride of 4-row groups
  static uint64_t make_desc(uint32_t addr, uint32_t lead) {
    return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t((lead >> 4) & 0x3FFF) << 16 | uint64_t(512 >> 4) << 32 |
           uint64_t(1) << 62;
  }
};
struct DescSwizzle64B : Real {  // swizzle mode 2 (64-byte)
  static uint64_t make_desc(uint32_t addr, uint32_t lead) {
    return uint64_t((addr & 0x3FFFF) >> 4) | uint64_t((lead >> 4) & 0x3FFF) << 16 | uint64_t(1024 >> 4) << 32 |
           uint64_t(2) << 62;
  }
};
struct DescStart16Bit : Real {  // start address masked to 64 KB
  static uint64_t make_desc(uint32_t addr, uint32_t lead) {
    return uint64_t((addr & 0xFFFF) >> 4) | uint64_t((lead >> 4) & 0x3FFF) << 16 | uint64_t(1024 >> 4) << 32 |
           uint64_t(1) << 62;
  }
};
struct DqPairsHalvesSwapped : Real {  // the float4's two pairs in the other order (rows + 8 first)
  template <class Traits>
  static void dq_pairs(int slot, int (&row)[2], int (&col)[2]) {
    sm90::DqFragmentOrder<Traits>::pairs(slot, row, col);
    const int r0 = row[0];
    row[0] = row[1];
    row[1] = r0;
  }
};
struct DqPairsWarpgroupOnColumns : Real {  // the warpgroups' parts always split by columns
  template <class Traits>
  static void dq_pairs(int slot, int (&row)[2], int (&col)[2]) {
    const int thread = slot % 128, j = slot / 128 % (Traits::kDqCols / 8), wg = slot / (128 * (Traits::kDqCols / 8));
    const int lane = thread % 32, r = thread / 32 * 16 + lane / 4;
    row[0] = r;
    row[1] = r + 8;
    col[0] = col[1] = 8 * j + 2 * (lane % 4) + wg * Traits::kDqCols;
  }
};
struct AdvanceUnscaled : Real {  // bytes added to the 16-byte-unit field
  static uint64_t advance(uint64_t desc, uint32_t bytes) { return desc + bytes; }
};
struct AdvanceLeadField : Real {  // the leading-offset field advanced instead of the start address
  static uint64_t advance(uint64_t desc, uint32_t bytes) { return desc + (uint64_t(bytes >> 4) << 16); }
};

// ---- failure accounting ---------------------------------------------------------------------------------------------
struct Report {
  bool verbose = false;  // print the first failures (the real functions); mutants only count them
  long cases = 0, bad = 0;
  std::set<std::string> failed_checks;
  long bad_in_check = 0;  // failures of the check under way: a check stops after a few
  void begin() { bad_in_check = 0; }
  bool stop() const { return bad_in_check >= 20; }
  void fail(const char* check, const char* fmt, ...) {
    ++bad, ++bad_in_check;
    failed_checks.insert(check);
    if (verbose && bad <= 8) {
      std::printf("%s: ", check);
      va_list args;
      va_start(args, fmt);
      std::vprintf(fmt, args);
      va_end(args);
      std::printf("\n");
    }
  }
};

// The 1024-byte-aligned shared-memory bases tiles are placed at (the kernels align every tile to 1024 bytes).
const uint32_t kAlignedBases[] = {0, 1024, 8192, 37 * 1024, 150 * 1024};
constexpr uint32_t kSmemLimit = 227 * 1024;  // H100's opt-in shared memory per block

// ---- 1. swizzle -----------------------------------------------------------------------------------------------------
template <class Impl>
void check_swizzle(Report& rep) {
  rep.begin();
  for (uint32_t base : kAlignedBases) {
    for (int row = 0; row < 256 && !rep.stop(); ++row) {
      for (int chunk = 0; chunk < 8; ++chunk) {
        ++rep.cases;
        const uint32_t got = base + Impl::chunk_offset(row, chunk);
        const uint32_t want = model::tma_addr(base, row, chunk * model::kChunkBytes);
        if (got != want) rep.fail("swizzle", "base=%u row=%d chunk=%d: %u, model %u", base, row, chunk, got, want);
      }
    }
  }
  for (int rows : {64, 256}) {  // a bijection onto the tile's 16-byte chunks
    std::vector<int> seen(rows * 8, 0);
    ++rep.cases;
    bool ok = true;
    for (int row = 0; row < rows; ++row) {
      for (int chunk = 0; chunk < 8; ++chunk) {
        const uint32_t off = Impl::chunk_offset(row, chunk);
        if (off % model::kChunkBytes != 0 || off >= uint32_t(rows) * model::kRowBytes) {
          ok = false;
        } else {
          ++seen[off / model::kChunkBytes];
        }
      }
    }
    for (int s : seen) ok = ok && s == 1;
    if (!ok) rep.fail("swizzle bijection", "rows=%d: not one chunk of the tile each", rows);
  }
}

// ---- 2. stmatrix ----------------------------------------------------------------------------------------------------
// A tile of column blocks of `rows` rows x 64 16-bit columns (each a TMA box, `rows` * 128 bytes apart) at `base`,
// `cols` columns. Warp slice rows row0..row0+15 of every column block, stored pair by pair as the kernels do:
// fwd (O epilogue): stmatrix_x4_pair_offset(base + lane_offset, j2 % 4) + (j2 / 4) * block bytes;
// bwd (dS^T):       base + (j2 / 4) * block bytes + stmatrix_x4_pair_offset(lane_offset, j2 % 4).
// Returns whether every element landed where the accumulator layout says (failures recorded when `record`).
template <class Impl>
bool check_stmatrix_tile(Report& rep, bool record, uint32_t base, int rows, int cols, int row0, bool fwd_form) {
  const uint32_t block_bytes = uint32_t(rows) * model::kRowBytes;
  bool ok = true;
  for (int j2 = 0; j2 < cols / 16; ++j2) {
    uint32_t row_addr[32];
    for (int lane = 0; lane < 32; ++lane) {
      const uint32_t lane_off = Impl::lane_offset(row0, lane);
      row_addr[lane] = fwd_form ? Impl::pair_offset(base + lane_off, j2 % 4) + (j2 / 4) * block_bytes
                                : base + (j2 / 4) * block_bytes + Impl::pair_offset(lane_off, j2 % 4);
    }
    for (int lane = 0; lane < 32; ++lane) {
      if (record) ++rep.cases;
      if (row_addr[lane] % 16 != 0) {
        ok = false;
        if (record) rep.fail("stmatrix", "row address of lane %d not 16-byte aligned", lane);
      }
      for (int reg = 0; reg < 4; ++reg) {
        for (int elem = 0; elem < 2; ++elem) {
          if (record) ++rep.cases;
          const uint32_t dest = model::stmatrix_x4_dest(row_addr, lane, reg, elem);
          const uint32_t lin = model::swizzle(dest) - base;  // TMA's layout inverted: the logical byte of the tile
          const int block = int(lin / block_bytes), row = int(lin % block_bytes / model::kRowBytes);
          const int col = block * 64 + int(lin % model::kRowBytes) / model::kElemBytes;
          const model::Element want = model::accumulator_element(row0, j2, lane, reg, elem);
          if (lin >= uint32_t(cols / 64) * block_bytes || row != want.row || col != want.col) {
            ok = false;
            if (record) {
              rep.fail("stmatrix", "%s base=%u rows=%d row0=%d j2=%d lane=%d reg=%d elem=%d: (%d, %d), want (%d, %d)",
                       fwd_form ? "fwd" : "bwd", base, rows, row0, j2, lane, reg, elem, row, col, want.row,
                       want.col);
              if (rep.stop()) return false;
            }
          }
        }
      }
    }
  }
  return ok;
}

template <class Impl>
void check_stmatrix(Report& rep) {
  rep.begin();
  for (uint32_t base : kAlignedBases) {
    for (int rows : {64, 128}) {      // O boxes: 64 rows; dS^T: kBlockN = 128 key rows per 64-query column block
      for (int cols : {64, 128, 256}) {  // head dims (O), kBlockM (dS^T)
        for (int row0 = 0; row0 < rows; row0 += 16) {
          for (bool fwd_form : {true, false}) {
            if (!check_stmatrix_tile<Impl>(rep, true, base, rows, cols, row0, fwd_form) && rep.stop()) return;
          }
        }
      }
    }
  }
}

// The d256 backward's P^T / dS^T stores: a [keys][64 queries] tile (one 128-byte swizzled row per key) at `base`;
// warp w of a warpgroup holds queries 16 w .. 16 w + 15 (S, dP rows) and the warpgroup's 40 keys from key0 (S, dP
// columns: five 8-key tiles), stored as x4.trans of tiles (0, 1) and (2, 3) (the second 16 key rows = 2048 bytes
// on) and x2.trans of tile 4. Every (lane, register, element) must land at (key, query) of the tile.
template <class Impl>
void check_stmatrix_trans(Report& rep) {
  rep.begin();
  for (uint32_t base : kAlignedBases) {
    for (int key0 : {0, 40}) {
      for (int w = 0; w < 4; ++w) {
        for (int piece = 0; piece < 3; ++piece) {  // x4 of tiles 0-1, x4 of tiles 2-3, x2 of tile 4
          const bool x2 = piece == 2;
          uint32_t row_addr[32];
          for (int lane = 0; lane < 32; ++lane) {
            row_addr[lane] = base + Impl::trans_x4_offset(key0, 2 * w, lane) + piece * 2048;  // x2: lanes 0-15
          }
          for (int lane = 0; lane < 32; ++lane) {
            const int g = lane / 4, t = lane % 4;
            for (int reg = 0; reg < (x2 ? 2 : 4); ++reg) {
              for (int elem = 0; elem < 2; ++elem) {
                ++rep.cases;
                // S / dP accumulator: row (query) g + 8 (reg % 2), column (key) 8 tile + 2 t + elem; the packed
                // registers pair the rows halves first, then the two key tiles of the x4.
                const int query = 16 * w + g + 8 * (reg % 2);
                const int key = key0 + 8 * (x2 ? 4 : 2 * piece + reg / 2) + 2 * t + elem;
                const uint32_t dest = model::stmatrix_trans_dest(row_addr, lane, reg, elem);
                const uint32_t lin = model::swizzle(dest) - base;
                const int row = int(lin / model::kRowBytes), col = int(lin % model::kRowBytes) / model::kElemBytes;
                if (dest % 2 != 0 || row != key || col != query) {
                  rep.fail("stmatrix trans", "base=%u key0=%d w=%d piece=%d lane=%d reg=%d elem=%d: (%d, %d), "
                           "want key %d query %d", base, key0, w, piece, lane, reg, elem, row, col, key, query);
                  if (rep.stop()) return;
                }
              }
            }
          }
        }
      }
    }
  }
}

// The 1024-byte alignment is a real precondition: at other 16-byte-aligned bases the same stores land elsewhere.
template <class Impl>
void check_stmatrix_needs_alignment(Report& rep) {
  rep.begin();
  for (uint32_t base : {128u, 512u, 1024u + 256u, 8192u + 896u}) {
    ++rep.cases;
    bool all_ok = true;
    for (int row0 = 0; row0 < 64; row0 += 16) {
      for (bool fwd_form : {true, false}) {
        all_ok = check_stmatrix_tile<Impl>(rep, false, base, 64, 64, row0, fwd_form) && all_ok;
      }
    }
    if (all_ok) rep.fail("stmatrix alignment", "base=%u (not 1024-byte aligned) stores like an aligned one", base);
  }
}

// ---- shapes of the kernels' operand tiles, from the real traits -----------------------------------------------------
// A tile of column blocks of `rows` rows x 64 16-bit columns, `cols` columns, `copies` copies `copy_bytes` apart
// (pipeline stages, double buffers).
struct TileShape {
  const char* name;
  int rows, cols, copies;
  uint32_t copy_bytes;
};
using u16 = uint16_t;
template <class Fwd>
void add_fwd(std::vector<TileShape>& v) {
  using Tr = sm90::FwdKernelTraitsSm90<u16, Fwd>;
  v.push_back({"fwd Q", Tr::kBlockM, Tr::kHeadDim, 1, 0});
  v.push_back({"fwd K/V", Tr::kBlockN, Tr::kHeadDim, Tr::kStages, Tr::kKVBytes});
}
template <class Bwd>
void add_bwd(std::vector<TileShape>& v) {
  using Tr = sm90::BwdKernelTraitsSm90<u16, Bwd>;
  using S = typename Tr::SharedStorage;
  v.push_back({"bwd K/V", Tr::kBlockN, Tr::kHeadDim, 1, 0});
  v.push_back({"bwd Q/dO", Tr::kBlockM, Tr::kHeadDim, Tr::kStages, uint32_t(sizeof(S::q[0]))});
  v.push_back({"bwd dS^T", Tr::kBlockN, Tr::kBlockM, 2, uint32_t(sizeof(S::ds[0]))});
}
void add_bwd_d256(std::vector<TileShape>& v) {
  using Tr = sm90::BwdD256TraitsSm90;
  using S = Tr::SharedStorage<u16>;
  v.push_back({"bwd d256 K/V", Tr::kBlockN, Tr::kHeadDim, 1, 0});
  v.push_back({"bwd d256 Q", Tr::kBlockM, Tr::kHeadDim, Tr::kQStages, uint32_t(sizeof(S::q[0]))});
  v.push_back({"bwd d256 dO", Tr::kBlockM, Tr::kHeadDim, Tr::kDoStages, uint32_t(sizeof(S::dout[0]))});
  v.push_back({"bwd d256 P^T/dS^T", Tr::kBlockN, Tr::kBlockM, 2, uint32_t(sizeof(S::pt[0]))});
}
std::vector<TileShape> kernel_tiles() {
  std::vector<TileShape> v;
  add_fwd<sm90::FwdTraitsSm90<64>>(v);
  add_fwd<sm90::FwdTraitsSm90<128>>(v);
  add_fwd<sm90::FwdTraitsSm90<256>>(v);
  add_fwd<sm90::FwdWideTraitsSm90<64>>(v);
  add_bwd<sm90::BwdTraitsSm90<64>>(v);
  add_bwd<sm90::BwdTraitsSm90<128>>(v);
  add_bwd_d256(v);
  return v;
}
const std::vector<TileShape> kTiles = kernel_tiles();

// Offsets the kernels advance descriptors by: k-steps of 32 bytes inside a row, column blocks (rows * 128 bytes),
// 16-row steps (2048 bytes), copies (stages, buffers), and their sums.
std::vector<uint32_t> kernel_offsets() {
  std::set<uint32_t> s;
  for (const TileShape& t : kTiles) {
    const uint32_t block = uint32_t(t.rows) * model::kRowBytes;
    for (int copy = 0; copy < t.copies; ++copy) {
      for (int cb = 0; cb < t.cols / 64; ++cb) {
        for (uint32_t k_off = 0; k_off < model::kRowBytes; k_off += 32) {
          s.insert(copy * t.copy_bytes + cb * block + k_off);
        }
      }
      for (int kk = 0; kk < t.rows / 16; ++kk) s.insert(copy * t.copy_bytes + kk * 16 * model::kRowBytes);
    }
  }
  return {s.begin(), s.end()};
}
// Leading offsets: 16 (K-major, unused) and the column-block distances of MN-major operands.
std::vector<uint32_t> kernel_leads() {
  std::set<uint32_t> s = {sm90::kKMajorLeadingBytes};
  for (const TileShape& t : kTiles) s.insert(uint32_t(t.rows) * model::kRowBytes);
  return {s.begin(), s.end()};
}

// ---- 3. descriptors -------------------------------------------------------------------------------------------------
template <class Impl>
void check_descriptors(Report& rep, const std::vector<uint32_t>& leads, const std::vector<uint32_t>& offsets) {
  rep.begin();
  auto expect = [&](const char* check, uint64_t desc, uint32_t addr, uint32_t lead, uint32_t from, uint32_t by) {
    ++rep.cases;
    const model::Desc d = model::decode(desc);
    if (d.start != addr || d.lead != lead || d.stride != model::kPeriodBytes || d.base_offset != 0 ||
        d.swizzle_mode != model::kSwizzle128B || d.reserved != 0) {
      rep.fail(check,
               "addr=%u (+%u) lead=%u: start %u, leading %u, stride %u, base offset %u, swizzle %u, reserved %llx",
               from, by, lead, d.start, d.lead, d.stride, d.base_offset, d.swizzle_mode,
               (unsigned long long)d.reserved);
    }
  };
  for (uint32_t lead : leads) {
    for (uint32_t addr = 0; addr < kSmemLimit && !rep.stop(); addr += 16) {
      expect("make_desc_sw128", Impl::make_desc(addr, lead), addr, lead, addr, 0);
    }
  }
  rep.begin();
  for (uint32_t lead : leads) {
    for (uint32_t addr = 0; addr < kSmemLimit && !rep.stop(); addr += 16) {
      const uint64_t desc = Impl::make_desc(addr, lead);
      for (uint32_t off : offsets) {
        if (addr + off >= (1u << 18)) break;  // offsets ascend; the start field holds addresses below 2^18
        expect("desc_advance", Impl::advance(desc, off), addr + off, lead, addr, off);
      }
    }
  }
}

// ---- 4. wgmma operands through the descriptors ----------------------------------------------------------------------
// For every tile of the kernels, at 1024-byte-aligned bases (and every copy of it): the descriptors built as the
// kernels build them address, under the model of wgmma's reads, exactly the elements TMA wrote for the operand.
template <class Impl>
void check_operands(Report& rep) {
  rep.begin();
  for (const TileShape& t : kTiles) {
    const uint32_t block = uint32_t(t.rows) * model::kRowBytes;
    const uint32_t tile_bytes = uint32_t(t.cols / 64) * block;
    for (uint32_t base0 : kAlignedBases) {
      for (int copy = 0; copy < t.copies; ++copy) {
        const uint32_t base = base0 + copy * t.copy_bytes;
        if (base + tile_bytes > kSmemLimit) continue;
        // K-major (A or B of S = Q K^T, S^T = K Q^T, dP^T, dV / dK from P^T, dS^T): rows from row0 (warpgroup slices:
        // multiples of 32), the k-step kk's 16 columns. Built directly (forward) or by advancing (backward).
        for (int row0 = 0; row0 < t.rows; row0 += 32) {
          for (int kk = 0; kk < t.cols / 16; ++kk) {
            const uint32_t off = (kk / 4) * block + (kk % 4) * 32;
            const uint64_t descs[2] = {
                Impl::make_desc(base + row0 * model::kRowBytes + off, sm90::kKMajorLeadingBytes),
                Impl::advance(Impl::make_desc(base + row0 * model::kRowBytes, sm90::kKMajorLeadingBytes), off)};
            for (uint64_t desc : descs) {
              const model::Desc d = model::decode(desc);
              for (int r = 0; r < t.rows - row0; ++r) {
                for (int k = 0; k < 16; ++k) {
                  ++rep.cases;
                  const int col = 16 * kk + k;
                  const uint32_t got = model::kmajor_addr(d, r, k);
                  const uint32_t want = model::tma_addr(base + (col / 64) * block, row0 + r, (col % 64) * 2);
                  if (got != want || d.swizzle_mode != model::kSwizzle128B) {
                    rep.fail("K-major operand", "%s base=%u row0=%d kk=%d element (%d, %d): read at %u, TMA wrote %u",
                             t.name, base, row0, kk, r, k, got, want);
                    if (rep.stop()) return;
                  }
                }
              }
            }
          }
        }
        // MN-major (V as B of O += P V, dO / Q as B of dV / dK, K as B of dQ, dS^T as A of dQ): the columns from
        // col0 (a multiple of 64), k-step kk = rows 16 kk..16 kk + 15, column blocks the leading offset apart.
        for (int col0 = 0; col0 < t.cols; col0 += 64) {
          for (int kk = 0; kk < t.rows / 16; ++kk) {
            const uint32_t step = kk * 16 * model::kRowBytes;
            const uint32_t start = base + (col0 / 64) * block;
            const uint64_t descs[2] = {Impl::make_desc(start + step, block),
                                       Impl::advance(Impl::make_desc(start, block), step)};
            for (uint64_t desc : descs) {
              const model::Desc d = model::decode(desc);
              for (int n = 0; n < t.cols - col0; ++n) {
                for (int k = 0; k < 16; ++k) {
                  ++rep.cases;
                  const int col = col0 + n;
                  const uint32_t got = model::mnmajor_addr(d, n, k);
                  const uint32_t want = model::tma_addr(base + (col / 64) * block, 16 * kk + k, (col % 64) * 2);
                  if (got != want || d.swizzle_mode != model::kSwizzle128B) {
                    rep.fail("MN-major operand",
                             "%s base=%u col0=%d kk=%d element (%d, %d): read at %u, TMA wrote %u", t.name, base,
                             col0, kk, n, k, got, want);
                    if (rep.stop()) return;
                  }
                }
              }
            }
          }
        }
      }
    }
  }
}

// ---- dQ staging order -----------------------------------------------------------------------------------------------
// The sm_90a d64/d128 backward stages dQ as float4 slot (wg * tiles + j) * 128 + wg_tid of the query tile: thread
// wg_tid's accumulator elements 4 j .. 4 j + 3 (the f32 accumulator layout: lane 4 g + t of warp w holds rows
// 16 w + g and + 8, columns 2 t, 2 t + 1 of each 8-column tile j), of its warpgroup's part: rows [64 wg, + 64) when
// the tile has two wgmma M of rows (d64), else columns [wg kDqCols, + kDqCols). DqFragmentOrder::pairs must give
// back, for every slot, (row, col) of elements 0 and 2; and so cover each column pair of the tile once.
template <class Impl, class Bwd>
void check_dq_order_of(Report& rep, const char* name) {
  using Tr = sm90::BwdKernelTraitsSm90<u16, Bwd>;
  constexpr int kTiles = Tr::kDqCols / 8;
  std::vector<int> seen(Tr::kBlockM * Tr::kHeadDim / 2, 0);
  rep.begin();
  for (int wg = 0; wg < Tr::kConsumerWarpgroups && !rep.stop(); ++wg) {
    for (int j = 0; j < kTiles; ++j) {
      for (int thread = 0; thread < 128; ++thread) {
        const int w = thread / 32, g = thread % 32 / 4, t = thread % 4;
        const int row0 = Tr::kDqSplitRows ? 64 * wg : 0, col0 = Tr::kDqSplitRows ? 0 : wg * Tr::kDqCols;
        const int slot = (wg * kTiles + j) * 128 + thread;
        int row[2], col[2];
        Impl::template dq_pairs<Tr>(slot, row, col);
        for (int k = 0; k < 2; ++k) {
          ++rep.cases;
          const int want_row = row0 + 16 * w + g + 8 * k, want_col = col0 + 8 * j + 2 * t;
          if (row[k] != want_row || col[k] != want_col) {
            rep.fail("dq order", "%s slot %d pair %d: (%d, %d), accumulator (%d, %d)", name, slot, k, row[k], col[k],
                     want_row, want_col);
          }
          if (row[k] >= 0 && row[k] < Tr::kBlockM && col[k] >= 0 && col[k] < Tr::kHeadDim && col[k] % 2 == 0) {
            ++seen[row[k] * (Tr::kHeadDim / 2) + col[k] / 2];
          }
        }
      }
    }
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    ++rep.cases;
    if (seen[i] != 1) rep.fail("dq order", "%s column pair %zu covered %d times", name, i, seen[i]);
  }
}
template <class Impl>
void check_dq_order(Report& rep) {
  check_dq_order_of<Impl, sm90::BwdTraitsSm90<64>>(rep, "d64");
  check_dq_order_of<Impl, sm90::BwdTraitsSm90<128>>(rep, "d128");
}

// The d256 redesign's dq_accum order: DqTransposedFragmentOrder::elems must give, for slot(cw, h, j, thread), the
// (query, d) elements of the dQ^T accumulator (m64n64 slice h of warpgroup cw: accumulator row = d, column = query;
// floats 4 j .. 4 j + 3 at rows g, g, g + 8, g + 8 and columns 2 t, 2 t + 1, 2 t, 2 t + 1 of column tile j), each
// element of the 64 x 256 tile exactly once.
void check_dq_transposed_order(Report& rep) {
  using Order = sm90::DqTransposedFragmentOrder;
  rep.begin();
  std::vector<int> seen(Order::kTileRows * Order::kCols, 0);
  for (int cw = 0; cw < 2; ++cw) {
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < 8; ++j) {
        for (int thread = 0; thread < 128; ++thread) {
          const int slot = Order::slot(cw, h, j, thread);
          int row[4], col[4];
          Order::elems(slot, row, col);
          const int g = thread % 32 / 4, t = thread % 4, w = thread / 32;
          for (int e = 0; e < 4; ++e) {
            ++rep.cases;
            const int want_d = 128 * cw + 64 * h + 16 * w + g + 8 * (e / 2), want_q = 8 * j + 2 * t + e % 2;
            if (slot < 0 || slot >= Order::kSlots || row[e] != want_q || col[e] != want_d) {
              rep.fail("dq transposed order", "cw=%d h=%d j=%d thread=%d e=%d: (%d, %d), want (%d, %d)", cw, h, j,
                       thread, e, row[e], col[e], want_q, want_d);
              if (rep.stop()) return;
              continue;
            }
            ++seen[row[e] * Order::kCols + col[e]];
          }
        }
      }
    }
  }
  for (int i = 0; i < int(seen.size()); ++i) {
    ++rep.cases;
    if (seen[i] != 1) rep.fail("dq transposed order", "element (%d, %d) covered %d times", i / 256, i % 256, seen[i]);
  }
}

// ---- constants ------------------------------------------------------------------------------------------------------
void check_constants(Report& rep) {
  auto expect = [&](const char* name, long got, long want) {
    ++rep.cases;
    if (got != want) rep.fail("constants", "%s = %ld, model %ld", name, got, want);
  };
  expect("kSwizzleBytes", sm90::kSwizzleBytes, model::kRowBytes);
  expect("kSwizzleRows", sm90::kSwizzleRows, model::kPeriodBytes / model::kRowBytes);
  expect("kSwizzleChunkBytes", sm90::kSwizzleChunkBytes, model::kChunkBytes);
  expect("kSwizzleAtomBytes", sm90::kSwizzleAtomBytes, model::kPeriodBytes);
  // K-major swizzled operands leave the leading offset unused; CUTLASS encodes 1 (16 bytes) there.
  expect("kKMajorLeadingBytes", sm90::kKMajorLeadingBytes, 16);
}

template <class Impl>
Report check_all(bool verbose) {
  Report rep;
  rep.verbose = verbose;
  static const std::vector<uint32_t> leads = kernel_leads(), offsets = kernel_offsets();
  check_swizzle<Impl>(rep);
  check_stmatrix<Impl>(rep);
  check_stmatrix_needs_alignment<Impl>(rep);
  check_stmatrix_trans<Impl>(rep);
  check_descriptors<Impl>(rep, leads, offsets);
  check_operands<Impl>(rep);
  check_dq_order<Impl>(rep);
  return rep;
}

struct MutantResult {
  const char* name;
  Report rep;
};
template <class M>
MutantResult run_mutant(const char* name) {
  return {name, check_all<M>(false)};
}

int main() {
  Report real = check_all<Real>(true);
  check_constants(real);
  check_dq_transposed_order(real);
  const MutantResult mutants[] = {
      run_mutant<SwizzleRowMod4>("swizzled_chunk_offset XOR row % 4"),
      run_mutant<SwizzleNone>("swizzled_chunk_offset unswizzled"),
      run_mutant<SwizzleRowDiv2>("swizzled_chunk_offset XOR (row / 2) % 8"),
      run_mutant<LaneMatricesSwapped>("stmatrix_x4_lane_offset matrix bits swapped"),
      run_mutant<LaneRowFromQuad>("stmatrix_x4_lane_offset row lane / 4"),
      run_mutant<PairAdded>("stmatrix_x4_pair_offset added"),
      run_mutant<PairOneChunk>("stmatrix_x4_pair_offset one chunk per pair"),
      run_mutant<TransX4MatricesSwapped>("stmatrix_x4_trans_lane_offset matrix bits swapped"),
      run_mutant<DescLeadShifted>("make_desc_sw128 leading field at bit 17"),
      run_mutant<DescStride512>("make_desc_sw128 stride 512"),
      run_mutant<DescSwizzle64B>("make_desc_sw128 64-byte swizzle mode"),
      run_mutant<DescStart16Bit>("make_desc_sw128 start masked to 64 KB"),
      run_mutant<AdvanceUnscaled>("desc_advance bytes unscaled"),
      run_mutant<DqPairsHalvesSwapped>("DqFragmentOrder::pairs halves swapped"),
      run_mutant<DqPairsWarpgroupOnColumns>("DqFragmentOrder::pairs warpgroups always on columns"),
      run_mutant<AdvanceLeadField>("desc_advance into the leading field"),
  };
  long undetected = 0;
  for (const MutantResult& m : mutants) {
    if (m.rep.bad == 0) {
      ++undetected;
      std::printf("mutant not detected: %s\n", m.name);
    }
  }
  if (real.bad || undetected) {
    if (real.bad) std::printf("%ld of %ld cases failed\n", real.bad, real.cases);
    return 1;
  }
  std::printf("ok %ld\n", real.cases);
  for (const MutantResult& m : mutants) {
    std::string by;
    for (const std::string& c : m.rep.failed_checks) by += (by.empty() ? "" : ", ") + c;
    std::printf("mutant detected: %s (by %s)\n", m.name, by.c_str());
  }
  return 0;
}
