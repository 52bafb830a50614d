// XLA FFI handlers for the CPU target, and the nanobind module that hands them to Python.
#include <nanobind/nanobind.h>

#include <exception>
#include <string>

#include "cpu/attention_cpu.h"
#include "ffi/validation.h"
#include "segment_operands.h"

namespace nb = nanobind;

namespace jax_flash {
namespace {

// Runs a CPU kernel, turning a C++ exception (e.g. std::bad_alloc for per-thread buffers) into an ffi::Error.
template <typename F>
ffi::Error RunCatching(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_flash: CPU kernel failed: ") + e.what());
  }
  return ffi::Error::Success();
}

ffi::Error FlashForwardCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> q_lens,
                               ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_offsets,
                               ffi::Buffer<ffi::S32> kv_offsets, ffi::Buffer<ffi::S32> q_seg,
                               ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> q_seg_meta,
                               ffi::Buffer<ffi::S32> kv_seg_meta,
                               ffi::Buffer<ffi::S32> q_seg_runs, ffi::Buffer<ffi::S32> kv_seg_runs,
                               ffi::Buffer<ffi::F32> sinks, float scale,
                               bool is_causal, int64_t window_left, int64_t window_right, float softcap,
                               bool has_segments, bool has_sinks, int32_t kernel, ffi::Result<ffi::AnyBuffer> o,
                               ffi::Result<ffi::Buffer<ffi::F32>> lse,
                               ffi::Result<ffi::Buffer<ffi::S32>> counter) {
  KernelChoice choice;  // validated; the CPU has one kernel
  if (auto e = ToKernelChoice(kernel, &choice); e.failure()) return e;
  FlashParams p{};
  if (auto e = FillCommonParams(q, k, v, q_lens, kv_lens, q_offsets, kv_offsets, scale, is_causal, window_left,
                                window_right, &p);
      e.failure()) {
    return e;
  }
  if (auto e = FillScoreModifiers(q_seg, kv_seg, q_seg_meta, kv_seg_meta, q_seg_runs, kv_seg_runs, has_segments,
                                  softcap, &p);
      e.failure()) {
    return e;
  }
  if (auto e = FillSinks(sinks, has_sinks, &p); e.failure()) return e;
  if (auto e = CheckForwardResults(q, o, lse, counter); e.failure()) return e;
  p.o = o->untyped_data();
  p.lse = lse->typed_data();
  return RunCatching([&] { cpu::FlashForward(p); });
}

ffi::Error FlashBackwardCpuImpl(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                                ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout, ffi::Buffer<ffi::S32> q_lens,
                                ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> q_offsets,
                                ffi::Buffer<ffi::S32> kv_offsets, ffi::Buffer<ffi::S32> q_seg,
                                ffi::Buffer<ffi::S32> kv_seg, ffi::Buffer<ffi::S32> q_seg_meta,
                                ffi::Buffer<ffi::S32> kv_seg_meta,
                                ffi::Buffer<ffi::S32> q_seg_runs, ffi::Buffer<ffi::S32> kv_seg_runs, float scale,
                                bool is_causal,
                                int64_t window_left, int64_t window_right, float softcap, bool has_segments,
                                bool deterministic, int32_t kernel,
                                ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                                ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
                                ffi::Result<ffi::Buffer<ffi::F32>> row_stats,
                                ffi::Result<ffi::Buffer<ffi::S32>> dq_semaphore) {
  // The CPU backward is deterministic whatever `deterministic` says (fixed work split, no atomics).
  KernelChoice choice;  // validated; the CPU has one kernel
  if (auto e = ToKernelChoice(kernel, &choice); e.failure()) return e;
  FlashParams p{};
  if (auto e = FillCommonParams(q, k, v, q_lens, kv_lens, q_offsets, kv_offsets, scale, is_causal, window_left,
                                window_right, &p);
      e.failure()) {
    return e;
  }
  if (auto e = FillScoreModifiers(q_seg, kv_seg, q_seg_meta, kv_seg_meta, q_seg_runs, kv_seg_runs, has_segments,
                                  softcap, &p);
      e.failure()) {
    return e;
  }
  if (auto e = FillBackwardParams(q, k, o, lse, dout, dq, dk, dv, dq_accum, row_stats, deterministic, dq_semaphore, &p);
      e.failure()) {
    return e;
  }
  return RunCatching([&] { cpu::FlashBackward(p); });
}

ffi::Error SegmentOperandsCpuImpl(ffi::Buffer<ffi::S32> q_ids, ffi::Buffer<ffi::S32> kv_ids,
                                  ffi::Result<ffi::Buffer<ffi::S32>> q_meta, ffi::Result<ffi::Buffer<ffi::S32>> kv_meta,
                                  ffi::Result<ffi::Buffer<ffi::S32>> q_runs,
                                  ffi::Result<ffi::Buffer<ffi::S32>> kv_runs) {
  SegmentOperandsParams p;
  if (auto e = FillSegmentOperandsParams(q_ids, kv_ids, q_meta, kv_meta, q_runs, kv_runs, &p); e.failure()) return e;
  return RunCatching([&] { cpu::SegmentOperands(p); });
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashForwardCpu, jax_flash::FlashForwardCpuImpl,
                              jax_flash::BindForward(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashBackwardCpu, jax_flash::FlashBackwardCpuImpl,
                              jax_flash::BindBackward(xla::ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxFlashSegmentOperandsCpu, jax_flash::SegmentOperandsCpuImpl,
                              jax_flash::BindSegmentOperands(xla::ffi::Ffi::Bind()));

NB_MODULE(_jax_flash_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_flash_fwd"] = nb::capsule(reinterpret_cast<void*>(JaxFlashForwardCpu));
    d["jax_flash_bwd"] = nb::capsule(reinterpret_cast<void*>(JaxFlashBackwardCpu));
    d["jax_flash_segment_operands"] = nb::capsule(reinterpret_cast<void*>(JaxFlashSegmentOperandsCpu));
    return d;
  });
}
