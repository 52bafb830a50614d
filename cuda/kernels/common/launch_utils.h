// Host-side launch helpers shared by every CUDA launcher: grid arithmetic and per-device cached queries.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

namespace jax_flash::cuda {

inline int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// A value computed once per device and cached: compute(dev, &value) runs on the first call for the current device
// (value 0 means "not computed yet", so compute must produce a nonzero value). Each instantiation has its own
// cache, and every call site passes its own lambda type, so callers never share one. No lock and no device
// synchronisation: two first calls may both compute, which is harmless for idempotent queries.
template <typename Compute>
cudaError_t once_per_device(Compute&& compute, int* value) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  std::atomic<int>& slot = cache[dev % kMaxDevices];
  int v = slot.load(std::memory_order_acquire);
  if (v == 0) {
    if (cudaError_t e = compute(dev, &v); e != cudaSuccess) return e;
    slot.store(v, std::memory_order_release);
  }
  *value = v;
  return cudaSuccess;
}

// Raises a kernel's dynamic shared-memory limit once per device (kernels above 48 KB need it). Templated on the
// kernel itself so each kernel has its own cache.
template <auto kKernel>
cudaError_t ensure_smem_limit(int bytes) {
  int done = 0;
  return once_per_device(
      [&](int, int* v) {
        *v = 1;
        return cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      },
      &done);
}

// CTAs of `kernel` that fit on one SM with `smem_bytes` of dynamic shared memory, times the SMs of the current
// device: the grid of a persistent kernel. Queried once per kernel and device (no synchronisation).
template <auto kernel>
cudaError_t resident_ctas(int threads, int smem_bytes, int* ctas) {
  return once_per_device(
      [&](int dev, int* value) {
        int sms = 0, per_sm = 0;
        if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev); e != cudaSuccess) {
          return e;
        }
        if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes);
            e != cudaSuccess) {
          return e;
        }
        *value = sms * per_sm;
        return per_sm < 1 ? cudaErrorInvalidConfiguration : cudaSuccess;
      },
      ctas);
}

// Calls f(std::bool_constant<flag>{}...) with each runtime flag turned into a compile-time constant, so one call
// site picks among the 2^n instantiations of a kernel whose features are compiled in or out (segment ids, a soft
// cap, ordered dQ additions): f(segments, soft_cap) reads them as decltype(segments)::value.
template <typename F>
decltype(auto) with_static_flags(F&& f) {
  return f();
}
template <typename F, typename... Flags>
decltype(auto) with_static_flags(F&& f, bool flag, Flags... rest) {
  auto bind = [&](auto value) {
    return with_static_flags([&](auto... more) { return f(value, more...); }, rest...);
  };
  return flag ? bind(std::true_type{}) : bind(std::false_type{});
}

}  // namespace jax_flash::cuda
