// Host-side launch helpers shared by every CUDA launcher: grid arithmetic and per-device cached queries.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

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

}  // namespace jax_flash::cuda
