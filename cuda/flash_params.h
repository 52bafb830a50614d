// The one contract between the host (FFI handlers) and the kernels, CPU and CUDA alike.
//
// Layout is jax.nn.dot_product_attention's BTNH:
//   q, o, dq, dout : [batch, seqlen_q, heads_q,  head_dim]
//   k, v, dk, dv   : [batch, seqlen_k, heads_kv, head_dim]
//   lse            : [batch, heads_q, seqlen_q]            (float32)
//   row_stats      : [batch, heads_q, 2, seqlen_q_rounded] (float32; seqlen_q_rounded = seqlen_q rounded up to
//                    kRowStatsAlign: whole 128-row tiles, so every kernel's query tile can be bulk-copied)
//   dq_accum       : [batch, heads_q, seqlen_q_rounded, head_dim_rounded] (float32; head_dim_rounded: the head-dim
//                    class of the kernels, head_dim_class(head_dim); each kernel family adds into it in its own
//                    order: rows of head_dim_rounded, or per query tile in the order its accumulators hold them)
//   dq_semaphore   : [batch, heads_q, seqlen_q]            (int32; its first ceil(seqlen_q / block) of each row;
//                    without deterministic dQ its first int is the persistent sm_90a backward's work counter)
//   fwd_counter    : [batch, 1]                            (int32; the forward's workspace: the sm_90a forward
//                    grids that take units from a counter use its first int, which their launcher zeroes)
// All arrays are dense and row-major. Query head h reads key/value head h / (heads_q / heads_kv).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define JF_HD __host__ __device__ __forceinline__
#else
#define JF_HD inline
#endif

namespace jax_flash {

inline constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * kLog2e)
// The backward's row statistics are padded to whole tiles of this many query rows (jax_flash/_ffi.py allocates them
// with the same constant; the handler checks the shape).
inline constexpr int kRowStatsAlign = 128;
// Without deterministic dQ, the first ints of dq_semaphore that the backward preprocess zeroes (as many as it holds):
// the persistent sm_90a backward's work counter, then two flags for each unit its last round splits
// (sm90/tile_scheduler_bwd.cuh).
inline constexpr int kBwdCounterInts = 1 + 2 * 1024;
// The kernels' head-dim classes: 64, 128 or 256 columns (head dims in between run padded to the class).
JF_HD constexpr int head_dim_class(int head_dim) { return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256; }

enum class DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Which CUDA kernel family a call may use (an FFI attribute, chosen per call from Python). kAuto: the sm_90a kernels
// on compute capability 9.0, the sm_80-class ones elsewhere. kSm80 runs the sm_80-class kernels on any device;
// kSm80SmallSmem also picks their backward, and decides whether the decode kernel fits, as on a device with 99 KB
// of shared memory a block (sm_86, sm_89), so both sm_80-class backwards and the decode fallback can be tested on
// one GPU. kSm90DecodeCpAsync is kAuto but for decode calls that would
// take the TMA decode kernel, which take the cp.async wgmma one instead (so both can be tested on one GPU). The CPU
// has one kernel and ignores it.
enum class KernelChoice : int { kAuto = 0, kSm80 = 1, kSm80SmallSmem = 2, kSm90DecodeCpAsync = 3 };
inline constexpr int kNumKernelChoices = 4;

struct FlashParams {
  // Shapes.
  int batch;
  int seqlen_q;
  int seqlen_k;
  int heads_q;
  int heads_kv;
  int head_dim;
  DType dtype;

  // Softmax: logits = scale * q.k; scale_log2 = scale * log2(e) so kernels can use exp2.
  float scale;
  float scale_log2;

  // Mask (jax.nn.dot_product_attention semantics; every field combines with every other).
  bool causal;       // key j visible to query i only if j <= i (top-left aligned, at global positions)
  int window_left;   // key j visible only if j >= i - window_left; -1 = unbounded
  int window_right;  // key j visible only if j <= i + window_right; -1 = unbounded
  const int32_t* q_lens;   // [batch] valid query rows; rows >= q_lens[b] give zeros. Never null.
  const int32_t* kv_lens;  // [batch] valid keys; keys >= kv_lens[b] are masked. Never null.
  // [batch] global positions of local query row 0 and local key 0 (a part of a longer sequence: sharding, ring
  // attention); the masks and the lengths above apply to global positions. Zeros for a whole sequence. Never null.
  const int32_t* q_offsets;
  const int32_t* kv_offsets;
  // Packed sequences (null when the call has no segment ids): row i sees key j only if their ids are equal.
  // [batch, seqlen_q] / [batch, seqlen_k] ids, and per 16-position chunk metadata [batch, chunks, 4] (mask.h:
  // SegmentPolicy).
  const int32_t* q_segment_ids;
  const int32_t* kv_segment_ids;
  const int32_t* q_segment_meta;
  const int32_t* kv_segment_meta;
  // [batch, seqlen_q, 2] / [batch, seqlen_k, 2]: each position's run, the positions of the other side with its id
  // ([first, last + 1)), for batch elements whose ids are contiguous runs in the same order; a first row's first
  // bound of -1 marks a batch element whose ids are not (mask.h: RunPolicy, segment_runs_exact). Null with the ids.
  const int32_t* q_segment_runs;
  const int32_t* kv_segment_runs;

  // Score modifiers. Logit soft-capping (softcap_pre = 0: none): the kernels replace each raw score s = q.k by
  // softcap_post * tanh(softcap_pre * s), with softcap_pre = scale / c and softcap_post = c / scale, so that the
  // logit scale * s becomes c * tanh(scale * q.k / c); its derivative is 1 - tanh^2. Attention sinks (forward; null:
  // none): sinks[b * heads_q + h] is a logit with no value added to the softmax denominator of head h's rows.
  float softcap_pre;
  float softcap_post;
  const float* sinks;

  // Decode (kernels/decode): seqlen_q is Tq (query step t of batch b sits at position kv_lens[b] - Tq + t) and
  // seqlen_k the cache capacity. Paged caches (page_table non-null): k, v are [num_pages, page_size, heads_kv,
  // head_dim] and key j of batch b is row j % page_size of page page_table[b * max_pages + j / page_size]; dense
  // caches: [batch, seqlen_k, heads_kv, head_dim]. The key range is split num_splits ways; the splits' float32 O
  // [num_splits, batch, Tq, heads_q, head_dim] and lse [num_splits, batch, heads_q, Tq] are workspace.
  const int32_t* page_table;
  int page_size;
  int page_shift;  // log2(page_size) when it is a power of two, else -1
  int max_pages;
  int num_pages;
  int num_splits;
  // Splits of one size across the batch (the grid holds twice the splits an equal share needs): batch element b
  // takes ceil(tiles_b / share) of its num_splits splits, share at least sum of tiles / (batch * num_splits / 2),
  // raised until the splits fit batch * num_splits / 2 blocks (decode/split_mainloop.cuh split_tiles).
  // Otherwise each element's key range splits into num_splits equal shares.
  bool balance_splits;
  // Every kv_lens entry is the same (the caller gave one length): the launchers rank no batch.
  bool equal_lengths;
  // Each block ranks the batch's lengths and takes the sequences longest first (decode/split_mainloop.cuh
  // batch_element); the decode launchers set it for the kernel they launch (decode::RankBatch).
  bool rank_batch;
  float* o_partial;
  float* lse_partial;
  // Workspace: the work counter of the TMA decode kernel's persistent grids (sm90/flash_decode_tma_sm90.cuh
  // DecodeTmaGrid; launch_decode_tma zeroes it on the stream before such a grid, and no other launch touches it).
  int32_t* decode_counter;

  // Forward.
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // natural-log sum-exp of the scaled logits; +inf for rows that see no key
  // Workspace: the work counter of the sm_90a forward grids that take their units from one (Traits::kWorkCounter;
  // their launcher zeroes it on the stream before the kernel).
  int32_t* fwd_counter;

  // Backward.
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  float* dq_accum;  // float32 dQ accumulator (workspace, zeroed by the launcher), [batch, heads_q] slabs
  int head_dim_rounded;  // head_dim_class(head_dim): the columns of a dq_accum slab
  // Per (batch, query head), seqlen_q_rounded entries each: lse * log2(e), then dsum = rowsum(dout * o); 0 in the
  // padding rows (workspace, written by the backward's preprocessing).
  float* row_stats;
  int seqlen_q_rounded;
  // Bitwise-reproducible dQ: key blocks add into each query tile of dq_accum in ascending order, counted on
  // dq_semaphore (workspace; zeroed by the launcher). Only the sm_90a backward implements it. Without it, the
  // first ints of dq_semaphore are the persistent sm_90a backward's work counter and its split units' flags (the
  // preprocess zeroes kBwdCounterInts of them).
  bool deterministic;
  int32_t* dq_semaphore;
  JF_HD int64_t dq_semaphore_ints() const { return int64_t(batch) * heads_q * seqlen_q; }  // its size (B, Hq, Sq)

  JF_HD int64_t q_row_stride() const { return int64_t(heads_q) * head_dim; }
  JF_HD int64_t kv_row_stride() const { return int64_t(heads_kv) * head_dim; }
  JF_HD int64_t q_batch_stride() const { return int64_t(seqlen_q) * q_row_stride(); }
  JF_HD int64_t kv_batch_stride() const { return int64_t(seqlen_k) * kv_row_stride(); }
  JF_HD int group_size() const { return heads_q / heads_kv; }
  // Row statistics of (batch b, query head h): lse * log2(e) at [0, seqlen_q_rounded), dsum after them.
  JF_HD int64_t row_stats_offset(int b, int h) const { return (int64_t(b) * heads_q + h) * 2 * seqlen_q_rounded; }
  JF_HD float* lse_log2_of(int b, int h) const { return row_stats + row_stats_offset(b, h); }
  JF_HD float* dsum_of(int b, int h) const { return row_stats + row_stats_offset(b, h) + seqlen_q_rounded; }
  // dq_accum slab of (batch b, query head h): seqlen_q_rounded x head_dim_rounded floats.
  JF_HD float* dq_accum_of(int b, int h) const {
    return dq_accum + (int64_t(b) * heads_q + h) * seqlen_q_rounded * head_dim_rounded;
  }
};

}  // namespace jax_flash
