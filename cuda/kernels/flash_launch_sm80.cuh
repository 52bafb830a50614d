// Launchers of the sm_80-class kernels, instantiated per (dtype, head-dim class) in flash_*_sm80_hdim*.cu.
#pragma once

#include <atomic>

#include "flash_bwd_sm80_mma_cpasync.cuh"
#include "flash_bwd_sm80_mma_cpasync_cta.cuh"
#include "flash_fwd_sm80_mma_cpasync.cuh"

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

template <typename T, int kD>
cudaError_t launch_fwd_sm80(const FlashParams& p, cudaStream_t stream) {
  using Traits = FwdKernelTraits<FwdTraitsSm80<kD>>;
  constexpr int kSmemBytes = Traits::kSmemElems * int(sizeof(T));
  constexpr auto kernel = flash_fwd_sm80_kernel<T, Traits>;
  if (cudaError_t e = ensure_smem_limit<kernel>(kSmemBytes); e != cudaSuccess) return e;
  const dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch);
  kernel<<<grid, Traits::kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// The backward sequence every main backward kernel shares: dq_accum = 0, dsum = rowsum(dO * O), the main kernel
// (launch_main(), which returns its launch error; skipped without keys), dq = scale * dq_accum.
template <typename T, typename LaunchMain>
cudaError_t launch_bwd_sequence(const FlashParams& p, cudaStream_t stream, LaunchMain&& launch_main) {
  const int64_t q_elems = int64_t(p.batch) * p.seqlen_q * p.heads_q * p.head_dim;
  if (cudaError_t e = cudaMemsetAsync(p.dq_accum, 0, q_elems * sizeof(float), stream); e != cudaSuccess) return e;
  if (p.deterministic) {
    const size_t stat_elems = size_t(p.batch) * p.heads_q * p.seqlen_q;
    if (cudaError_t e = cudaMemsetAsync(p.dq_semaphore, 0, stat_elems * sizeof(int32_t), stream); e != cudaSuccess) {
      return e;
    }
  }
  if (q_elems > 0) {
    const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads_q;
    flash_bwd_preprocess_kernel<T><<<ceil_div(rows * kWarpSize, kPreprocessThreads), kPreprocessThreads, 0, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  if (p.seqlen_k > 0) {
    if (cudaError_t e = launch_main(); e != cudaSuccess) return e;
  }
  if (q_elems > 0) {
    flash_bwd_convert_dq_kernel<T><<<ceil_div(q_elems / 2, kPreprocessThreads), kPreprocessThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  return cudaSuccess;
}

// The sm_80-class main backward kernel with the given traits (the tile sweep passes its own).
template <typename T, typename Traits>
cudaError_t launch_bwd_sm80_main(const FlashParams& p, cudaStream_t stream) {
  constexpr auto kernel = flash_bwd_sm80_kernel<T, Traits>;
  if (cudaError_t e = ensure_smem_limit<kernel>(Traits::kSmemBytes); e != cudaSuccess) return e;
  const dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.heads_kv, p.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// The CTA-wide main backward kernel with the given traits.
template <typename T, typename Traits>
cudaError_t launch_bwd_sm80_cta_main(const FlashParams& p, cudaStream_t stream) {
  constexpr auto kernel = flash_bwd_sm80_cta_kernel<T, Traits>;
  constexpr int kSmemBytes = int(sizeof(BwdCtaSharedStorage<T, Traits>));
  if (cudaError_t e = ensure_smem_limit<kernel>(kSmemBytes); e != cudaSuccess) return e;
  const dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.heads_kv, p.batch);
  kernel<<<grid, Traits::kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

// The CTA-wide kernel where a block may have the shared memory it needs (smem_optin_bytes: the device's opt-in
// limit, 163 / 227 KB on sm_80 / sm_90), the per-warp kernel elsewhere (sm_86, sm_89: 99 KB, above head dim 64)
// and for head dim 256 on sm_80 (the CTA-wide tiles need 209 KB there).
template <typename T, int kD>
cudaError_t launch_bwd_sm80(const FlashParams& p, cudaStream_t stream, int smem_optin_bytes) {
  using CtaTraits = BwdCtaKernelTraits<BwdCtaTraitsSm80<kD>>;
  if (smem_optin_bytes >= int(sizeof(BwdCtaSharedStorage<T, CtaTraits>))) {
    return launch_bwd_sequence<T>(p, stream, [&] { return launch_bwd_sm80_cta_main<T, CtaTraits>(p, stream); });
  }
  using Traits = BwdKernelTraits<BwdTraitsSm80<kD>>;
  return launch_bwd_sequence<T>(p, stream, [&] { return launch_bwd_sm80_main<T, Traits>(p, stream); });
}

}  // namespace jax_flash::cuda

// Explicit instantiation for one (dtype, head-dim class).
#define JAX_FLASH_INSTANTIATE_SM80(T, D)                                                              \
  template cudaError_t jax_flash::cuda::launch_fwd_sm80<T, D>(const FlashParams&, cudaStream_t);      \
  template cudaError_t jax_flash::cuda::launch_bwd_sm80<T, D>(const FlashParams&, cudaStream_t, int);
