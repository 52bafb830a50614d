// The operands the attention kernels take segment ids through (SegmentPolicy and RunPolicy in mask.h), derived from
// the ids by the target jax_flash_segment_operands (a CPU function and a CUDA kernel pair, same results).
//
// Per batch element b, for ids q [seqlen_q] and kv [seqlen_k]:
//   q_meta [ceil(seqlen_q / 16)][4]: for query chunk c (rows [16 c, 16 c + 16)) the smallest and largest id of its
//     rows, then [first, end): the hull of the keys whose 16-key chunks have an id range meeting chunk c's
//     ([INT32_MAX, 0) when none does). kv_meta likewise with the roles swapped.
//   q_runs [seqlen_q][2]: [first, last + 1) of the keys holding row i's id; a row whose id no key holds gets the
//     empty interval [x, x) at x = the largest end of the rows before it (0 at the start). kv_runs likewise.
//     These are exact (the batch element takes RunPolicy) when every id a row holds is one contiguous run of keys
//     and vice versa, and both bounds never decrease along the positions on both sides, as packed documents are
//     (whole or in parts); otherwise, or when a side has more than kMaxSegmentRuns runs of equal ids, every entry
//     of both arrays is -1 (segment_runs_exact reads q_runs[0][0] < 0) and the batch element takes the ids.
#pragma once

#include <cstdint>

namespace jax_flash {

// Runs of equal ids per side and batch element that the runs take as intervals (beyond: the ids path, correct
// and slower): the CUDA kernel keeps each side's runs in shared memory.
inline constexpr int kMaxSegmentRuns = 2048;

struct SegmentOperandsParams {
  const int32_t* q_ids;  // [batch][seqlen_q]
  const int32_t* kv_ids;  // [batch][seqlen_k]
  int32_t* q_meta;  // [batch][ceil(seqlen_q / 16)][4]
  int32_t* kv_meta;  // [batch][ceil(seqlen_k / 16)][4]
  int32_t* q_runs;  // [batch][seqlen_q][2]
  int32_t* kv_runs;  // [batch][seqlen_k][2]
  int64_t batch;
  int seqlen_q;
  int seqlen_k;
};

namespace cpu {
void SegmentOperands(const SegmentOperandsParams& p);
}  // namespace cpu

}  // namespace jax_flash
