// Shared by the CPU and CUDA FFI handlers: buffer validation and FlashParams construction.
//
// Arguments arrive as q [..., Sq, Hq, D], k/v [..., Sk, Hkv, D], q_lens/kv_lens int32 [...]; every leading
// dimension (the batch, plus any added by vmap) is folded into one batch dimension.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "flash_params.h"
#include "kernels/decode/decode_traits.h"  // kMaxDecodeSplits
#include "mask.h"  // kSegmentChunk
#include "segment_operands.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash {

namespace ffi = xla::ffi;

inline constexpr int kMaxHeadDim = 256;
inline constexpr int kHeadDimMultiple = 8;
// Query and key sequences of the attention targets: the masks take differences of int32 positions (mask.h), and
// the Python API checks the same bound (jax_flash.attention.MAX_SEQ_LEN). Offsets, internal operands of sequence
// sharding, lie in [0, kMaxSeqLen] too (not checked here: device values).
inline constexpr int64_t kMaxSeqLen = int64_t(1) << 30;

inline std::string ShapeString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

inline const char* DTypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::S32: return "int32";
    default: return "an unsupported dtype";
  }
}

inline bool ToDType(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kF32; return true;
    case ffi::DataType::BF16: *out = DType::kBF16; return true;
    case ffi::DataType::F16: *out = DType::kF16; return true;
    default: return false;
  }
}

inline ffi::Error Invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_flash: " + msg);
}

// The kernels take scale * log2(e) as a float32 and assume it positive and normal (fast math flushes a subnormal to
// 0, and a running max of -inf times 0 is NaN). The Python wrappers fold a negative or tiny scale into the query.
inline ffi::Error CheckKernelScale(float scale) {
  const float scale_log2 = scale * kLog2e;
  if (!std::isfinite(scale) || !std::isfinite(scale_log2) || !(scale_log2 >= FLT_MIN)) {
    char got[32];
    std::snprintf(got, sizeof(got), "%.9g", scale);
    return Invalid(std::string("scale must be finite and > 0 with scale * log2(e) a normal float32, got ") + got +
                   " (jax_flash's Python API folds other scales into the query)");
  }
  return ffi::Error::Success();
}

// Checks that `buf` has dimensions `expect` exactly.
template <typename Buf>
ffi::Error ExpectShape(const Buf& buf, ffi::AnyBuffer::Dimensions expect, const char* name) {
  auto dims = buf.dimensions();
  bool same = dims.size() == expect.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = dims[i] == expect[i];
  if (!same) {
    return Invalid(std::string(name) + " has shape " + ShapeString(dims) + ", expected " + ShapeString(expect));
  }
  return ffi::Error::Success();
}

// Validates q, k, v, the length arrays and the mask attributes, and fills the shape/mask/input fields of `p`.
inline ffi::Error FillCommonParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                   ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                                   ffi::Buffer<ffi::S32> q_offsets, ffi::Buffer<ffi::S32> kv_offsets, float scale,
                                   bool is_causal, int64_t window_left, int64_t window_right, FlashParams* p) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() < 3) return Invalid("query must have rank >= 3 ([..., seq, heads, head_dim]), got shape " + ShapeString(qd));
  if (kd.size() != qd.size()) {
    return Invalid("key has shape " + ShapeString(kd) + ", expected the same rank as query " + ShapeString(qd));
  }
  if (auto e = ExpectShape(v, kd, "value"); e.failure()) return e;
  const size_t r = qd.size();
  int64_t batch = 1;
  for (size_t i = 0; i + 3 < r; ++i) {
    if (qd[i] != kd[i]) {
      return Invalid("query " + ShapeString(qd) + " and key " + ShapeString(kd) + " differ in a batch dimension");
    }
    batch *= qd[i];
  }
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type()) {
    return Invalid(std::string("query, key and value must share a dtype, got ") + DTypeName(q.element_type()) +
                   ", " + DTypeName(k.element_type()) + ", " + DTypeName(v.element_type()));
  }
  if (!ToDType(q.element_type(), &p->dtype)) {
    return Invalid(std::string("unsupported dtype ") + DTypeName(q.element_type()) +
                   "; expected bfloat16, float16 or float32");
  }
  const int64_t d = qd[r - 1];
  if (kd[r - 1] != d) return Invalid("key head_dim " + std::to_string(kd[r - 1]) + " != query head_dim " + std::to_string(d));
  if (d <= 0 || d > kMaxHeadDim || d % kHeadDimMultiple != 0) {
    return Invalid("head_dim must be a positive multiple of 8 up to 256, got " + std::to_string(d));
  }
  const int64_t hq = qd[r - 2], hkv = kd[r - 2];
  if (hkv <= 0 || hq <= 0 || hq % hkv != 0) {
    return Invalid("query heads (" + std::to_string(hq) + ") must be a positive multiple of key/value heads (" +
                   std::to_string(hkv) + ")");
  }
  if (static_cast<int64_t>(q_lens.element_count()) != batch || static_cast<int64_t>(kv_lens.element_count()) != batch) {
    return Invalid("query_seq_lengths/key_value_seq_lengths must hold one length per batch element (" +
                   std::to_string(batch) + "), got shapes " + ShapeString(q_lens.dimensions()) + " and " +
                   ShapeString(kv_lens.dimensions()));
  }
  if (static_cast<int64_t>(q_offsets.element_count()) != batch ||
      static_cast<int64_t>(kv_offsets.element_count()) != batch) {
    return Invalid("q_offsets/kv_offsets must hold one position per batch element (" + std::to_string(batch) +
                   "), got shapes " + ShapeString(q_offsets.dimensions()) + " and " +
                   ShapeString(kv_offsets.dimensions()));
  }
  if (window_left < -1 || window_right < -1) return Invalid("window sizes must be >= 0 (or -1 for unbounded)");
  if (auto e = CheckKernelScale(scale); e.failure()) return e;
  if (batch > INT32_MAX || hq > INT32_MAX || hkv > INT32_MAX) return Invalid("dimension too large");
  if (qd[r - 3] > kMaxSeqLen || kd[r - 3] > kMaxSeqLen) {
    return Invalid("sequence lengths above 2^30 are not supported, got query " + std::to_string(qd[r - 3]) +
                   " and key " + std::to_string(kd[r - 3]));
  }

  p->batch = static_cast<int>(batch);
  p->seqlen_q = static_cast<int>(qd[r - 3]);
  p->seqlen_k = static_cast<int>(kd[r - 3]);
  p->heads_q = static_cast<int>(hq);
  p->heads_kv = static_cast<int>(hkv);
  p->head_dim = static_cast<int>(d);
  p->scale = scale;
  p->scale_log2 = scale * kLog2e;
  p->causal = is_causal;
  // Positions (lengths, offsets: at most kMaxSeqLen) are int32, so a window of 2^30 or more reaches every key a call
  // can hold: unbounded (-1). The kernels drop a window side that no (row, key) pair of a batch element reaches
  // (mask_for_batch: that needs the offsets, which are device values); callers with static knowledge drop it before
  // (jax_flash.attention).
  p->window_left = window_left < 0 || window_left >= kMaxSeqLen ? -1 : static_cast<int>(window_left);
  p->window_right = window_right < 0 || window_right >= kMaxSeqLen ? -1 : static_cast<int>(window_right);
  p->q_lens = q_lens.typed_data();
  p->kv_lens = kv_lens.typed_data();
  p->q_offsets = q_offsets.typed_data();
  p->kv_offsets = kv_offsets.typed_data();
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  return ffi::Error::Success();
}

// Segment ids (int32 [..., Sq] and [..., Sk]) with their chunk metadata ([..., ceil(Sq / 16), 4] and
// [..., ceil(Sk / 16), 4]; the segment_operands target) when has_segments (else placeholders, never read), and
// the soft cap (0: none). After FillCommonParams.
inline ffi::Error FillScoreModifiers(ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                                     ffi::Buffer<ffi::S32> q_meta, ffi::Buffer<ffi::S32> kv_meta,
                                     ffi::Buffer<ffi::S32> q_runs, ffi::Buffer<ffi::S32> kv_runs,
                                     bool has_segments, float softcap, FlashParams* p) {
  p->q_segment_ids = p->kv_segment_ids = p->q_segment_meta = p->kv_segment_meta = nullptr;
  p->q_segment_runs = p->kv_segment_runs = nullptr;
  if (has_segments) {
    const int64_t b = p->batch;
    const int64_t q_chunks = (p->seqlen_q + kSegmentChunk - 1) / kSegmentChunk;
    const int64_t kv_chunks = (p->seqlen_k + kSegmentChunk - 1) / kSegmentChunk;
    const struct {
      ffi::Buffer<ffi::S32>* buf;
      int64_t expect;
      const char* name;
      const char* what;
    } checks[] = {{&q_seg, b * p->seqlen_q, "q_segment_ids", "batch x seqlen_q"},
                  {&kv_seg, b * p->seqlen_k, "kv_segment_ids", "batch x seqlen_k"},
                  {&q_meta, b * q_chunks * 4, "q_segment_meta", "batch x ceil(seqlen_q / 16) x 4"},
                  {&kv_meta, b * kv_chunks * 4, "kv_segment_meta", "batch x ceil(seqlen_k / 16) x 4"},
                  {&q_runs, b * p->seqlen_q * 2, "q_segment_runs", "batch x seqlen_q x 2"},
                  {&kv_runs, b * p->seqlen_k * 2, "kv_segment_runs", "batch x seqlen_k x 2"}};
    for (const auto& c : checks) {
      if (static_cast<int64_t>(c.buf->element_count()) != c.expect) {
        return Invalid(std::string(c.name) + " has shape " + ShapeString(c.buf->dimensions()) + ", expected " +
                       c.what + " = " + std::to_string(c.expect) + " elements");
      }
    }
    p->q_segment_ids = q_seg.typed_data();
    p->kv_segment_ids = kv_seg.typed_data();
    p->q_segment_meta = q_meta.typed_data();
    p->kv_segment_meta = kv_meta.typed_data();
    p->q_segment_runs = q_runs.typed_data();
    p->kv_segment_runs = kv_runs.typed_data();
  }
  // 0 (either sign, by its bits: XLA's CPU threads read a subnormal as 0 too) is no cap. A cap c reaches the kernels
  // as scale / c and c / scale, which their fast math would flush to 0 if subnormal: c and both must be normal.
  uint32_t bits = 0;
  std::memcpy(&bits, &softcap, sizeof(bits));
  p->softcap_pre = p->softcap_post = 0.f;
  if ((bits & 0x7fffffffu) == 0) return ffi::Error::Success();
  if (!std::isfinite(softcap) || !(softcap >= FLT_MIN)) {
    return Invalid("logits_soft_cap must be finite and > 0 (0: none), a normal float32");
  }
  p->softcap_pre = p->scale / softcap;
  p->softcap_post = softcap / p->scale;
  if (!std::isfinite(p->softcap_pre) || !std::isfinite(p->softcap_post) || !(p->softcap_pre >= FLT_MIN) ||
      !(p->softcap_post >= FLT_MIN)) {
    return Invalid("logits_soft_cap / scale out of float32 range (scale / logits_soft_cap and logits_soft_cap / "
                   "scale must be normal float32 numbers)");
  }
  return ffi::Error::Success();
}

// Sinks: float32 [..., Hq] (one logit per batch element and query head) when has_sinks (else a placeholder).
inline ffi::Error FillSinks(ffi::Buffer<ffi::F32> sinks, bool has_sinks, FlashParams* p) {
  p->sinks = nullptr;
  if (!has_sinks) return ffi::Error::Success();
  if (static_cast<int64_t>(sinks.element_count()) != int64_t(p->batch) * p->heads_q) {
    return Invalid("sinks has shape " + ShapeString(sinks.dimensions()) + ", expected batch x heads_q = " +
                   std::to_string(int64_t(p->batch) * p->heads_q) + " elements");
  }
  p->sinks = sinks.typed_data();
  return ffi::Error::Success();
}

// The `kernel` attribute as a KernelChoice.
inline ffi::Error ToKernelChoice(int32_t kernel, KernelChoice* choice) {
  if (kernel < 0 || kernel >= kNumKernelChoices) {
    return Invalid("kernel must be 0 (auto), 1 (sm_80-class), 2 (sm_80-class, small shared memory) or 3 (auto, "
                   "decode on the cp.async kernel), got " + std::to_string(kernel));
  }
  *choice = static_cast<KernelChoice>(kernel);
  return ffi::Error::Success();
}

// Dimensions of lse and dq_semaphore for query dims [..., Sq, Hq, D]: [..., Hq, Sq].
inline std::vector<int64_t> RowStatDims(ffi::AnyBuffer::Dimensions qd) {
  std::vector<int64_t> out(qd.begin(), qd.end() - 3);
  out.push_back(qd[qd.size() - 2]);
  out.push_back(qd[qd.size() - 3]);
  return out;
}

// Dimensions of the backward's row statistics for query dims [..., Sq, Hq, D]: [..., Hq, 2, Sq rounded up to
// kRowStatsAlign].
inline std::vector<int64_t> RowStatsWorkspaceDims(ffi::AnyBuffer::Dimensions qd) {
  std::vector<int64_t> out(qd.begin(), qd.end() - 3);
  const int64_t rows = qd[qd.size() - 3];
  out.push_back(qd[qd.size() - 2]);
  out.push_back(2);
  out.push_back((rows + kRowStatsAlign - 1) / kRowStatsAlign * kRowStatsAlign);
  return out;
}

// Dimensions of the backward's dQ accumulator for query dims [..., Sq, Hq, D]: [..., Hq, Sq rounded up to
// kRowStatsAlign, head_dim_class(D)].
inline std::vector<int64_t> DqAccumWorkspaceDims(ffi::AnyBuffer::Dimensions qd) {
  std::vector<int64_t> out = RowStatsWorkspaceDims(qd);
  out[out.size() - 2] = out.back();
  out.back() = head_dim_class(int(qd[qd.size() - 1]));
  return out;
}

// Dimensions of the forward's work-counter workspace for query dims [..., Sq, Hq, D]: [..., 1] (the kernels use its
// first int; one per batch element keeps the shape vmap-able like the other results).
inline std::vector<int64_t> ForwardCounterDims(ffi::AnyBuffer::Dimensions qd) {
  std::vector<int64_t> out(qd.begin(), qd.end() - 3);
  out.push_back(1);
  return out;
}

inline ffi::Error CheckForwardResults(ffi::AnyBuffer q, ffi::Result<ffi::AnyBuffer>& o,
                                      ffi::Result<ffi::Buffer<ffi::F32>>& lse,
                                      ffi::Result<ffi::Buffer<ffi::S32>>& counter) {
  if (auto e = ExpectShape(*o, q.dimensions(), "output"); e.failure()) return e;
  if (o->element_type() != q.element_type()) return Invalid("output dtype must match query dtype");
  auto stat = RowStatDims(q.dimensions());
  if (auto e = ExpectShape(*lse, ffi::AnyBuffer::Dimensions(stat.data(), stat.size()), "lse"); e.failure()) return e;
  auto counter_dims = ForwardCounterDims(q.dimensions());
  return ExpectShape(*counter, ffi::AnyBuffer::Dimensions(counter_dims.data(), counter_dims.size()),
                     "forward work counter");
}

// Validates the backward-only buffers and fills the remaining fields of `p` (after FillCommonParams).
inline ffi::Error FillBackwardParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer o,
                                     ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                                     ffi::Result<ffi::AnyBuffer>& dq, ffi::Result<ffi::AnyBuffer>& dk,
                                     ffi::Result<ffi::AnyBuffer>& dv,
                                     ffi::Result<ffi::Buffer<ffi::F32>>& dq_accum,
                                     ffi::Result<ffi::Buffer<ffi::F32>>& row_stats, bool deterministic,
                                     ffi::Result<ffi::Buffer<ffi::S32>>& dq_semaphore, FlashParams* p) {
  auto stat = RowStatDims(q.dimensions());
  ffi::AnyBuffer::Dimensions stat_dims(stat.data(), stat.size());
  if (auto e = ExpectShape(o, q.dimensions(), "output"); e.failure()) return e;
  if (auto e = ExpectShape(dout, q.dimensions(), "output cotangent"); e.failure()) return e;
  if (auto e = ExpectShape(lse, stat_dims, "lse"); e.failure()) return e;
  if (auto e = ExpectShape(*dq, q.dimensions(), "dq"); e.failure()) return e;
  if (auto e = ExpectShape(*dk, k.dimensions(), "dk"); e.failure()) return e;
  if (auto e = ExpectShape(*dv, k.dimensions(), "dv"); e.failure()) return e;
  auto dq_accum_dims = DqAccumWorkspaceDims(q.dimensions());
  if (auto e = ExpectShape(*dq_accum, ffi::AnyBuffer::Dimensions(dq_accum_dims.data(), dq_accum_dims.size()),
                           "dq_accum");
      e.failure()) {
    return e;
  }
  auto row_stats_dims = RowStatsWorkspaceDims(q.dimensions());
  if (auto e = ExpectShape(*row_stats, ffi::AnyBuffer::Dimensions(row_stats_dims.data(), row_stats_dims.size()),
                           "row_stats");
      e.failure()) {
    return e;
  }
  if (auto e = ExpectShape(*dq_semaphore, stat_dims, "dq_semaphore"); e.failure()) return e;
  for (auto t : {o.element_type(), dout.element_type(), dq->element_type(), dk->element_type(), dv->element_type()}) {
    if (t != q.element_type()) return Invalid("output, cotangent and gradients must have the query dtype");
  }
  p->o = o.untyped_data();
  p->lse = lse.typed_data();
  p->dout = dout.untyped_data();
  p->dq = dq->untyped_data();
  p->dk = dk->untyped_data();
  p->dv = dv->untyped_data();
  p->dq_accum = dq_accum->typed_data();
  p->head_dim_rounded = int(dq_accum_dims.back());
  p->row_stats = row_stats->typed_data();
  p->seqlen_q_rounded = int(row_stats_dims.back());
  p->deterministic = deterministic;
  p->dq_semaphore = dq_semaphore->typed_data();
  return ffi::Error::Success();
}

// Decode (CUDA only): q [B, Tq, Hq, D]; caches dense [B, S, Hkv, D] or, when paged, [num_pages, page_size, Hkv, D]
// with page_table int32 [B, max_pages]; kv_lens int32 [B]; sinks float32 [B, Hq] when has_sinks; results o like q,
// lse [B, Hq, Tq], and the splits' workspace o_partial [splits, B, Tq, Hq, D] and lse_partial [splits, B, Hq, Tq]
// (float32; the number of splits is their leading dimension) and the work counter int32 [1] (workspace). Fills
// every field the decode kernels read.
inline constexpr int64_t kMaxDecodeQueryRows = 16;
inline ffi::Error FillDecodeParams(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> kv_lens,
                                   ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::F32> sinks, float scale,
                                   bool is_causal, int64_t window_left, int64_t window_right, float softcap,
                                   bool paged, bool has_sinks, bool balance_splits, bool equal_lengths,
                                   ffi::Result<ffi::AnyBuffer>& o,
                                   ffi::Result<ffi::Buffer<ffi::F32>>& lse,
                                   ffi::Result<ffi::Buffer<ffi::F32>>& o_partial,
                                   ffi::Result<ffi::Buffer<ffi::F32>>& lse_partial,
                                   ffi::Result<ffi::Buffer<ffi::S32>>& counter, FlashParams* p) {
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  if (qd.size() != 4) return Invalid("decode query must have shape [batch, rows, heads, head_dim], got " + ShapeString(qd));
  if (kd.size() != 4) return Invalid("decode caches must be 4-d, got key cache " + ShapeString(kd));
  if (auto e = ExpectShape(v, kd, "value cache"); e.failure()) return e;
  const int64_t batch = qd[0], rows = qd[1], hq = qd[2], d = qd[3], hkv = kd[2];
  if (rows < 1 || rows > kMaxDecodeQueryRows) {
    return Invalid("decode takes 1 to 16 query rows, got " + std::to_string(rows));
  }
  if (q.element_type() != k.element_type() || q.element_type() != v.element_type()) {
    return Invalid(std::string("query and caches must share a dtype, got ") + DTypeName(q.element_type()) + ", " +
                   DTypeName(k.element_type()) + ", " + DTypeName(v.element_type()));
  }
  if (!ToDType(q.element_type(), &p->dtype)) return Invalid(std::string("unsupported dtype ") + DTypeName(q.element_type()));
  if (kd[3] != d) return Invalid("cache head_dim " + std::to_string(kd[3]) + " != query head_dim " + std::to_string(d));
  if (d <= 0 || d > kMaxHeadDim || d % kHeadDimMultiple != 0) {
    return Invalid("head_dim must be a positive multiple of 8 up to 256, got " + std::to_string(d));
  }
  if (hkv <= 0 || hq <= 0 || hq % hkv != 0) {
    return Invalid("query heads (" + std::to_string(hq) + ") must be a positive multiple of the caches' heads (" +
                   std::to_string(hkv) + ")");
  }
  int64_t capacity = 0, max_pages = 0;
  if (paged) {
    auto pd = page_table.dimensions();
    if (pd.size() != 2 || pd[0] != batch) {
      return Invalid("page_table has shape " + ShapeString(pd) + ", expected [batch = " + std::to_string(batch) +
                     ", max_pages]");
    }
    if (kd[0] < 1 || kd[1] < 1) return Invalid("a paged cache needs at least one page of at least one key, got " + ShapeString(kd));
    if (kd[0] * kd[1] > INT32_MAX) {
      return Invalid("a paged cache holds at most 2^31 - 1 keys (pages x page_size), got " + ShapeString(kd));
    }
    max_pages = pd[1];
    capacity = max_pages * kd[1];
  } else {
    if (kd[0] != batch) {
      return Invalid("dense cache " + ShapeString(kd) + " and query " + ShapeString(qd) + " differ in batch");
    }
    capacity = kd[1];
  }
  if (auto e = ExpectShape(kv_lens, ffi::AnyBuffer::Dimensions(&batch, 1), "kv_lengths"); e.failure()) return e;
  if (batch > INT32_MAX || capacity > INT32_MAX || kd[0] > INT32_MAX) return Invalid("dimension too large");
  if (window_left < -1 || window_right < -1) return Invalid("window sizes must be >= 0 (or -1 for unbounded)");
  if (auto e = CheckKernelScale(scale); e.failure()) return e;
  if (auto e = ExpectShape(*o, qd, "output"); e.failure()) return e;
  if (o->element_type() != q.element_type()) return Invalid("output dtype must match query dtype");
  const int64_t stat[] = {batch, hq, rows};
  if (auto e = ExpectShape(*lse, ffi::AnyBuffer::Dimensions(stat, 3), "lse"); e.failure()) return e;
  auto od = o_partial->dimensions();
  const int64_t splits = od.size() == 5 ? od[0] : 0;
  const int64_t o_part[] = {splits, batch, rows, hq, d};
  const int64_t lse_part[] = {splits, batch, hq, rows};
  if (splits < 1 || splits > cuda::decode::kMaxDecodeSplits) {
    return Invalid("o_partial must be [splits, B, Tq, Hq, D] with 1 <= splits <= " +
                   std::to_string(cuda::decode::kMaxDecodeSplits) + ", got " + ShapeString(od));
  }
  if (auto e = ExpectShape(*o_partial, ffi::AnyBuffer::Dimensions(o_part, 5), "o_partial"); e.failure()) return e;
  if (auto e = ExpectShape(*lse_partial, ffi::AnyBuffer::Dimensions(lse_part, 4), "lse_partial"); e.failure()) return e;
  const int64_t one = 1;
  if (auto e = ExpectShape(*counter, ffi::AnyBuffer::Dimensions(&one, 1), "decode work counter"); e.failure()) return e;

  p->batch = static_cast<int>(batch);
  p->seqlen_q = static_cast<int>(rows);
  p->seqlen_k = static_cast<int>(capacity);
  p->heads_q = static_cast<int>(hq);
  p->heads_kv = static_cast<int>(hkv);
  p->head_dim = static_cast<int>(d);
  p->scale = scale;
  p->scale_log2 = scale * kLog2e;
  p->causal = is_causal;
  constexpr int64_t kUnreachable = int64_t(1) << 30;  // as FillCommonParams
  p->window_left = window_left < 0 || window_left >= kUnreachable ? -1 : static_cast<int>(window_left);
  p->window_right = window_right < 0 || window_right >= kUnreachable ? -1 : static_cast<int>(window_right);
  p->kv_lens = kv_lens.typed_data();
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->page_table = paged ? page_table.typed_data() : nullptr;
  p->page_size = paged ? static_cast<int>(kd[1]) : 0;
  p->page_shift = -1;
  for (int shift = 0; shift < 31; ++shift) {
    if (p->page_size == (1 << shift)) p->page_shift = shift;
  }
  p->max_pages = static_cast<int>(max_pages);
  p->num_pages = paged ? static_cast<int>(kd[0]) : 0;
  p->num_splits = static_cast<int>(splits);
  p->balance_splits = balance_splits;
  p->equal_lengths = equal_lengths;
  p->o = o->untyped_data();
  p->lse = lse->typed_data();
  p->o_partial = o_partial->typed_data();
  p->lse_partial = lse_partial->typed_data();
  p->decode_counter = counter->typed_data();
  // Soft cap and sinks as the attention targets (no segment ids in decode).
  ffi::Buffer<ffi::S32> none = kv_lens;
  if (auto e = FillScoreModifiers(none, none, none, none, none, none, false, softcap, p); e.failure()) return e;
  return FillSinks(sinks, has_sinks, p);
}

inline constexpr int64_t kMaxSegmentPositions = int64_t(1) << 30;

// The segment-operands target: q_ids int32 [..., T] and kv_ids int32 [..., S] with the same leading dims; results
// [..., ceil(T / 16), 4], [..., ceil(S / 16), 4], [..., T, 2], [..., S, 2] (segment_operands.h).
inline ffi::Error FillSegmentOperandsParams(ffi::Buffer<ffi::S32> q_ids, ffi::Buffer<ffi::S32> kv_ids,
                                            ffi::Result<ffi::Buffer<ffi::S32>>& q_meta,
                                            ffi::Result<ffi::Buffer<ffi::S32>>& kv_meta,
                                            ffi::Result<ffi::Buffer<ffi::S32>>& q_runs,
                                            ffi::Result<ffi::Buffer<ffi::S32>>& kv_runs, SegmentOperandsParams* p) {
  const auto qd = q_ids.dimensions(), kd = kv_ids.dimensions();
  bool lead_ok = qd.size() >= 1 && qd.size() == kd.size();
  for (size_t i = 0; lead_ok && i + 1 < qd.size(); ++i) lead_ok = qd[i] == kd[i];
  if (!lead_ok) {
    return Invalid("segment ids must have the same leading dims, got q_segment_ids " + ShapeString(qd) +
                   " and kv_segment_ids " + ShapeString(kd));
  }
  const int64_t t = qd.back(), s = kd.back();
  if (t > kMaxSegmentPositions || s > kMaxSegmentPositions) {  // (the kernels' position arithmetic stays in int)
    return Invalid("segment ids longer than 2^30 positions: got q_segment_ids " + ShapeString(qd) +
                   " and kv_segment_ids " + ShapeString(kd));
  }
  std::vector<int64_t> lead(qd.begin(), qd.end() - 1);
  int64_t batch = 1;
  for (int64_t d : lead) batch *= d;
  const auto with = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> dims(lead);
    dims.insert(dims.end(), tail);
    return dims;
  };
  const int64_t q_chunks = (t + kSegmentChunk - 1) / kSegmentChunk, kv_chunks = (s + kSegmentChunk - 1) / kSegmentChunk;
  const struct {
    ffi::Result<ffi::Buffer<ffi::S32>>* buf;
    std::vector<int64_t> dims;
    const char* name;
  } results[] = {{&q_meta, with({q_chunks, 4}), "q_segment_meta"},
                 {&kv_meta, with({kv_chunks, 4}), "kv_segment_meta"},
                 {&q_runs, with({t, 2}), "q_segment_runs"},
                 {&kv_runs, with({s, 2}), "kv_segment_runs"}};
  for (const auto& r : results) {
    if (auto e = ExpectShape(**r.buf, ffi::AnyBuffer::Dimensions(r.dims.data(), r.dims.size()), r.name);
        e.failure()) {
      return e;
    }
  }
  *p = SegmentOperandsParams{q_ids.typed_data(), kv_ids.typed_data(), q_meta->typed_data(), kv_meta->typed_data(),
                             q_runs->typed_data(), kv_runs->typed_data(), batch, int(t), int(s)};
  return ffi::Error::Success();
}

// The argument lists of the attention targets, shared by the CPU and CUDA handlers (which may first bind a context such
// as the CUDA stream). Handler parameters follow this order.
template <typename Binding>
auto BindForward(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // q [..., Sq, Hq, D]
      .template Arg<ffi::AnyBuffer>()                  // k [..., Sk, Hkv, D]
      .template Arg<ffi::AnyBuffer>()                  // v [..., Sk, Hkv, D]
      .template Arg<ffi::Buffer<ffi::S32>>()           // q_lens [...]: valid query rows per batch element
      .template Arg<ffi::Buffer<ffi::S32>>()           // kv_lens [...]: valid keys per batch element
      .template Arg<ffi::Buffer<ffi::S32>>()           // q_offsets [...]: global position of query row 0
      .template Arg<ffi::Buffer<ffi::S32>>()           // kv_offsets [...]: global position of key 0
      .template Arg<ffi::Buffer<ffi::S32>>()           // q_segment_ids [..., Sq] (if has_segments)
      .template Arg<ffi::Buffer<ffi::S32>>()           // kv_segment_ids [..., Sk] (if has_segments)
      .template Arg<ffi::Buffer<ffi::S32>>()           // q_segment_meta [..., ceil(Sq / 16), 4] (if has_segments)
      .template Arg<ffi::Buffer<ffi::S32>>()           // kv_segment_meta [..., ceil(Sk / 16), 4] (if has_segments)
      .template Arg<ffi::Buffer<ffi::S32>>()           // q_segment_runs [..., Sq, 2] (if has_segments)
      .template Arg<ffi::Buffer<ffi::S32>>()           // kv_segment_runs [..., Sk, 2] (if has_segments)
      .template Arg<ffi::Buffer<ffi::F32>>()           // sinks [..., Hq] (if has_sinks)
      .template Attr<float>("scale")                   // logit scale
      .template Attr<bool>("is_causal")                // top-left aligned causal mask
      .template Attr<int64_t>("window_left")           // local window, keys before the query; -1 unbounded
      .template Attr<int64_t>("window_right")          // local window, keys after the query; -1 unbounded
      .template Attr<float>("softcap")                 // logit soft cap c > 0; 0 none
      .template Attr<bool>("has_segments")             // the segment operands hold ids (else placeholders)
      .template Attr<bool>("has_sinks")                // the sinks operand holds sinks (else a placeholder)
      .template Attr<int32_t>("kernel")                // CUDA kernel family (KernelChoice); the CPU has one
      .template Ret<ffi::AnyBuffer>()                  // o [..., Sq, Hq, D]
      .template Ret<ffi::Buffer<ffi::F32>>()           // lse [..., Hq, Sq]
      .template Ret<ffi::Buffer<ffi::S32>>();          // work counter [..., 1] (workspace)
}

template <typename Binding>
auto BindBackward(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // q [..., Sq, Hq, D]
      .template Arg<ffi::AnyBuffer>()                  // k [..., Sk, Hkv, D]
      .template Arg<ffi::AnyBuffer>()                  // v [..., Sk, Hkv, D]
      .template Arg<ffi::AnyBuffer>()                  // o [..., Sq, Hq, D]
      .template Arg<ffi::Buffer<ffi::F32>>()           // lse [..., Hq, Sq]
      .template Arg<ffi::AnyBuffer>()                  // dout [..., Sq, Hq, D]
      .template Arg<ffi::Buffer<ffi::S32>>()           // q_lens [...]
      .template Arg<ffi::Buffer<ffi::S32>>()           // kv_lens [...]
      .template Arg<ffi::Buffer<ffi::S32>>()           // q_offsets [...]
      .template Arg<ffi::Buffer<ffi::S32>>()           // kv_offsets [...]
      .template Arg<ffi::Buffer<ffi::S32>>()           // q_segment_ids [..., Sq] (if has_segments)
      .template Arg<ffi::Buffer<ffi::S32>>()           // kv_segment_ids [..., Sk] (if has_segments)
      .template Arg<ffi::Buffer<ffi::S32>>()           // q_segment_meta [..., ceil(Sq / 16), 4] (if has_segments)
      .template Arg<ffi::Buffer<ffi::S32>>()           // kv_segment_meta [..., ceil(Sk / 16), 4] (if has_segments)
      .template Arg<ffi::Buffer<ffi::S32>>()           // q_segment_runs [..., Sq, 2] (if has_segments)
      .template Arg<ffi::Buffer<ffi::S32>>()           // kv_segment_runs [..., Sk, 2] (if has_segments)
      .template Attr<float>("scale")                   // logit scale
      .template Attr<bool>("is_causal")                // top-left aligned causal mask
      .template Attr<int64_t>("window_left")           // -1 unbounded
      .template Attr<int64_t>("window_right")          // -1 unbounded
      .template Attr<float>("softcap")                 // logit soft cap c > 0; 0 none
      .template Attr<bool>("has_segments")             // the segment operands hold ids (else placeholders)
      .template Attr<bool>("deterministic")            // bitwise-reproducible dQ (CPU: always)
      .template Attr<int32_t>("kernel")                // CUDA kernel family (KernelChoice); the CPU has one
      .template Ret<ffi::AnyBuffer>()                  // dq [..., Sq, Hq, D]
      .template Ret<ffi::AnyBuffer>()                  // dk [..., Sk, Hkv, D]
      .template Ret<ffi::AnyBuffer>()                  // dv [..., Sk, Hkv, D]
      .template Ret<ffi::Buffer<ffi::F32>>()           // dq_accum [..., Hq, Sq rounded, D class]: f32 workspace
      .template Ret<ffi::Buffer<ffi::F32>>()           // row_stats [..., Hq, 2, Sq rounded]: f32 workspace
      .template Ret<ffi::Buffer<ffi::S32>>();          // dq_semaphore [..., Hq, Sq]: int32 workspace
}

template <typename Binding>
auto BindDecode(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // q [B, Tq, Hq, D]
      .template Arg<ffi::AnyBuffer>()                  // key cache: [B, S, Hkv, D], or [pages, page_size, Hkv, D]
      .template Arg<ffi::AnyBuffer>()                  // value cache: as the key cache
      .template Arg<ffi::Buffer<ffi::S32>>()           // kv_lens [B]: valid keys, this step's included
      .template Arg<ffi::Buffer<ffi::S32>>()           // page_table [B, max_pages] (if paged)
      .template Arg<ffi::Buffer<ffi::F32>>()           // sinks [B, Hq] (if has_sinks)
      .template Attr<float>("scale")                   // logit scale
      .template Attr<bool>("is_causal")                // bottom-right causal: row t at kv_len - Tq + t
      .template Attr<int64_t>("window_left")           // keys before the row's position; -1 unbounded
      .template Attr<int64_t>("window_right")          // keys after the row's position; -1 unbounded
      .template Attr<float>("softcap")                 // logit soft cap c > 0; 0 none
      .template Attr<bool>("paged")                    // the caches are pages addressed through page_table
      .template Attr<bool>("has_sinks")                // the sinks operand holds sinks (else a placeholder)
      .template Attr<bool>("balance_splits")           // splits of one size across the batch (FlashParams)
      .template Attr<bool>("equal_lengths")            // every kv_lens entry the same (FlashParams)
      .template Attr<int32_t>("kernel")                // KernelChoice: 0 auto, 1 / 2 the sm_80-class kernel
      .template Ret<ffi::AnyBuffer>()                  // o [B, Tq, Hq, D]
      .template Ret<ffi::Buffer<ffi::F32>>()           // lse [B, Hq, Tq]
      .template Ret<ffi::Buffer<ffi::F32>>()           // o_partial [splits, B, Tq, Hq, D]: workspace
      .template Ret<ffi::Buffer<ffi::F32>>()           // lse_partial [splits, B, Hq, Tq]: workspace
      .template Ret<ffi::Buffer<ffi::S32>>();          // work counter [1]: workspace (persistent TMA decode grids)
}

template <typename Binding>
auto BindSegmentOperands(Binding b) {
  return std::move(b).template Arg<ffi::Buffer<ffi::S32>>()  // q_segment_ids [..., T]
      .template Arg<ffi::Buffer<ffi::S32>>()                  // kv_segment_ids [..., S]
      .template Ret<ffi::Buffer<ffi::S32>>()                  // q_segment_meta [..., ceil(T / 16), 4]
      .template Ret<ffi::Buffer<ffi::S32>>()                  // kv_segment_meta [..., ceil(S / 16), 4]
      .template Ret<ffi::Buffer<ffi::S32>>()                  // q_segment_runs [..., T, 2]
      .template Ret<ffi::Buffer<ffi::S32>>();                 // kv_segment_runs [..., S, 2]
}

}  // namespace jax_flash
