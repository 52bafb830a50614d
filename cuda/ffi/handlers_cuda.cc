// XLA FFI handlers for the CUDA target, and the nanobind module that hands them to Python.
// Handlers never synchronise and only enqueue work on XLA's stream, so they are command-buffer (CUDA graph) safe.
#include <nanobind/nanobind.h>

#include <string>

#include "ffi/validation.h"
#include "kernels/flash_api.h"
#include "kernels/segment_operands_launch.h"

namespace nb = nanobind;

namespace jax_flash {
namespace {

ffi::Error CudaError(cudaError_t err, const char* what) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_flash: ") + what + " failed: " + cudaGetErrorString(err));
}

ffi::Error FlashForwardCudaImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                                ffi::Buffer<ffi::S32> q_offsets, ffi::Buffer<ffi::S32> kv_offsets,
                                ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                                ffi::Buffer<ffi::S32> q_seg_meta, ffi::Buffer<ffi::S32> kv_seg_meta,
                                ffi::Buffer<ffi::S32> q_seg_runs, ffi::Buffer<ffi::S32> kv_seg_runs,
                                ffi::Buffer<ffi::F32> sinks, float scale, bool is_causal, int64_t window_left,
                                int64_t window_right, float softcap, bool has_segments, bool has_sinks,
                                int32_t kernel, ffi::Result<ffi::AnyBuffer> o,
                                ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                ffi::Result<ffi::Buffer<ffi::S32>> counter) {
  KernelChoice choice;
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
  p.fwd_counter = counter->typed_data();
  if (const char* why = cuda::UnsupportedReason(p); why[0] != '\0') return Invalid(why);
  if (const char* why = cuda::ForwardUnsupportedReason(p, choice); why[0] != '\0') return Invalid(why);
  if (cudaError_t err = cuda::RunFlashForward(p, choice, stream); err != cudaSuccess) {
    return CudaError(err, "forward kernel");
  }
  return ffi::Error::Success();
}

ffi::Error FlashBackwardCudaImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                 ffi::AnyBuffer o, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer dout,
                                 ffi::Buffer<ffi::S32> q_lens, ffi::Buffer<ffi::S32> kv_lens,
                                 ffi::Buffer<ffi::S32> q_offsets, ffi::Buffer<ffi::S32> kv_offsets,
                                 ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> kv_seg,
                                 ffi::Buffer<ffi::S32> q_seg_meta, ffi::Buffer<ffi::S32> kv_seg_meta,
                                 ffi::Buffer<ffi::S32> q_seg_runs, ffi::Buffer<ffi::S32> kv_seg_runs, float scale,
                                 bool is_causal, int64_t window_left, int64_t window_right, float softcap,
                                 bool has_segments, bool deterministic, int32_t kernel,
                                 ffi::Result<ffi::AnyBuffer> dq, ffi::Result<ffi::AnyBuffer> dk,
                                 ffi::Result<ffi::AnyBuffer> dv, ffi::Result<ffi::Buffer<ffi::F32>> dq_accum,
                                 ffi::Result<ffi::Buffer<ffi::F32>> row_stats,
                                 ffi::Result<ffi::Buffer<ffi::S32>> dq_semaphore) {
  KernelChoice choice;
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
  if (const char* why = cuda::UnsupportedReason(p); why[0] != '\0') return Invalid(why);
  if (const char* why = cuda::BackwardUnsupportedReason(p, choice); why[0] != '\0') return Invalid(why);
  if (cudaError_t err = cuda::RunFlashBackward(p, choice, stream); err != cudaSuccess) {
    return CudaError(err, "backward kernels");
  }
  return ffi::Error::Success();
}

ffi::Error FlashDecodeCudaImpl(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k_cache,
                               ffi::AnyBuffer v_cache, ffi::Buffer<ffi::S32> kv_lens,
                               ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::F32> sinks, float scale,
                               bool is_causal, int64_t window_left, int64_t window_right, float softcap, bool paged,
                               bool has_sinks, bool balance_splits, bool equal_lengths, int32_t kernel,
                               ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                               ffi::Result<ffi::Buffer<ffi::F32>> o_partial,
                               ffi::Result<ffi::Buffer<ffi::F32>> lse_partial,
                               ffi::Result<ffi::Buffer<ffi::S32>> counter) {
  KernelChoice choice;
  if (auto e = ToKernelChoice(kernel, &choice); e.failure()) return e;
  FlashParams p{};
  if (auto e = FillDecodeParams(q, k_cache, v_cache, kv_lens, page_table, sinks, scale, is_causal, window_left,
                                window_right, softcap, paged, has_sinks, balance_splits, equal_lengths, o, lse,
                                o_partial, lse_partial, counter, &p);
      e.failure()) {
    return e;
  }
  if (const char* why = cuda::DecodeUnsupportedReason(p, choice); why[0] != '\0') return Invalid(why);
  if (cudaError_t err = cuda::RunFlashDecode(p, choice, stream); err != cudaSuccess) {
    return CudaError(err, "decode kernels");
  }
  return ffi::Error::Success();
}

ffi::Error SegmentOperandsCudaImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> q_ids, ffi::Buffer<ffi::S32> kv_ids,
                                   ffi::Result<ffi::Buffer<ffi::S32>> q_meta,
                                   ffi::Result<ffi::Buffer<ffi::S32>> kv_meta,
                                   ffi::Result<ffi::Buffer<ffi::S32>> q_runs,
                                   ffi::Result<ffi::Buffer<ffi::S32>> kv_runs) {
  SegmentOperandsParams p;
  if (auto e = FillSegmentOperandsParams(q_ids, kv_ids, q_meta, kv_meta, q_runs, kv_runs, &p); e.failure()) return e;
  if (cudaError_t err = cuda::RunSegmentOperands(p, stream); err != cudaSuccess) {
    return CudaError(err, "segment operand kernels");
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_flash

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashForwardCuda, jax_flash::FlashForwardCudaImpl,
    jax_flash::BindForward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashBackwardCuda, jax_flash::FlashBackwardCudaImpl,
    jax_flash::BindBackward(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashDecodeCuda, jax_flash::FlashDecodeCudaImpl,
    jax_flash::BindDecode(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    JaxFlashSegmentOperandsCuda, jax_flash::SegmentOperandsCudaImpl,
    jax_flash::BindSegmentOperands(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});

NB_MODULE(_jax_flash_cuda, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_flash_fwd"] = nb::capsule(reinterpret_cast<void*>(JaxFlashForwardCuda));
    d["jax_flash_bwd"] = nb::capsule(reinterpret_cast<void*>(JaxFlashBackwardCuda));
    d["jax_flash_decode"] = nb::capsule(reinterpret_cast<void*>(JaxFlashDecodeCuda));
    d["jax_flash_segment_operands"] = nb::capsule(reinterpret_cast<void*>(JaxFlashSegmentOperandsCuda));
    return d;
  });
  // The decode split kernel's dynamic shared memory (bytes) and threads per block for a head dim, a number of packed
  // query rows and a KernelChoice on the current device (jax_flash._ffi.decode_splits sizes the grid from them);
  // (0, 0) past 128 rows.
  m.def("decode_launch_shape", [](int head_dim, int packed_rows, int kernel) {
    jax_flash::KernelChoice choice;
    if (jax_flash::ToKernelChoice(kernel, &choice).failure()) throw nb::value_error("unknown kernel choice");
    const auto shape = jax_flash::cuda::GetDecodeLaunchShape(head_dim, packed_rows, choice);
    return nb::make_tuple(shape.smem_bytes, shape.threads);
  });
  // Whether that kernel fits the current device's shared memory per block (jax_flash._ffi.decode_fits_device).
  m.def("decode_fits_device", [](int head_dim, int packed_rows, int kernel) {
    jax_flash::KernelChoice choice;
    if (jax_flash::ToKernelChoice(kernel, &choice).failure()) throw nb::value_error("unknown kernel choice");
    return jax_flash::cuda::DecodeFitsDevice(head_dim, packed_rows, choice);
  });
  // Whether the attention kernel of a forward (or backward) call fits the current device's shared memory per block
  // (jax_flash._ffi.attention_fits_device).
  m.def("attention_fits_device", [](int head_dim, bool backward, int kernel) {
    jax_flash::KernelChoice choice;
    if (jax_flash::ToKernelChoice(kernel, &choice).failure()) throw nb::value_error("unknown kernel choice");
    return jax_flash::cuda::AttentionFitsDevice(head_dim, backward, choice);
  });
  // The sm_80-class kernels' shared memory per block at head_dim for a device of smem_optin_bytes (tests).
  m.def("sm80_smem_bytes", [](int head_dim, bool backward, int smem_optin_bytes) {
    return jax_flash::cuda::Sm80SmemBytes(head_dim, backward, smem_optin_bytes);
  });
  m.def("device_count", []() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
}
