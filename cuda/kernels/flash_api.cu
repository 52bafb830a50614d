// Kernel selection: compute capability, dtype, head-dim class.
#include <cstdlib>
#include <cstring>

#include "flash_api.h"
#include "flash_launch_sm80.cuh"

#if defined(JAX_FLASH_HAVE_SM90A)
namespace jax_flash::cuda::sm90 {
template <typename T, int kD>
cudaError_t launch_fwd_sm90(const FlashParams& p, cudaStream_t stream);
template <typename T, int kD>
cudaError_t launch_bwd_sm90(const FlashParams& p, cudaStream_t stream);
}  // namespace jax_flash::cuda::sm90
#endif

namespace jax_flash::cuda {
namespace {

constexpr int kMaxGridYZ = 65535;

// A (non-negative) attribute of the current device, queried once per device (once_per_device caches nonzero
// values, so it holds the attribute + 1).
template <cudaDeviceAttr kAttr>
cudaError_t cached_device_attribute(int* value) {
  int stored = 0;
  const cudaError_t e = once_per_device(
      [](int dev, int* v) {
        int attr = 0;
        const cudaError_t err = cudaDeviceGetAttribute(&attr, kAttr, dev);
        *v = attr + 1;
        return err;
      },
      &stored);
  if (e == cudaSuccess) *value = stored - 1;
  return e;
}

// Compute capability (major * 10 + minor) of the current device; 0 on error.
int current_cc() {
  int major = 0, minor = 0;
  if (cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(&major) != cudaSuccess ||
      cached_device_attribute<cudaDevAttrComputeCapabilityMinor>(&minor) != cudaSuccess) {
    return 0;
  }
  return major * 10 + minor;
}

int head_dim_class(int d) { return d <= 64 ? 64 : d <= 128 ? 128 : 256; }

template <typename T>
cudaError_t forward_sm80(const FlashParams& p, cudaStream_t s) {
  switch (head_dim_class(p.head_dim)) {
    case 64: return launch_fwd_sm80<T, 64>(p, s);
    case 128: return launch_fwd_sm80<T, 128>(p, s);
    default: return launch_fwd_sm80<T, 256>(p, s);
  }
}

// JAX_FLASH_FORCE_SM80=1 makes Hopper run the sm_80-class kernels (for comparisons and tests of both paths);
// JAX_FLASH_FORCE_SM80=small-smem also picks the sm_80-class backward kernel as on a device with 99 KB of shared
// memory a block (sm_86, sm_89), so that the per-warp fallback is tested on a large GPU too.
const char* force_sm80_value() {
  static const char* value = [] {
    const char* v = std::getenv("JAX_FLASH_FORCE_SM80");
    return v == nullptr ? "" : v;
  }();
  return value;
}
bool force_sm80() { return *force_sm80_value() != '\0' && std::strcmp(force_sm80_value(), "0") != 0; }
bool force_small_smem() { return std::strcmp(force_sm80_value(), "small-smem") == 0; }
constexpr int kSmallSmemOptinBytes = 99 * 1024;  // sm_86 / sm_89

// The sm_90a kernels run on compute capability 9.0 exactly (sm_90a code runs nowhere else). TMA needs 16-byte
// aligned base addresses (XLA's buffers are; the forward also stores O through a tensor map) and at least one key.
bool use_sm90(const FlashParams& p) {
#if defined(JAX_FLASH_HAVE_SM90A)
  const auto aligned = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
  return current_cc() == 90 && !force_sm80() && p.seqlen_k > 0 && aligned(p.q) && aligned(p.k) && aligned(p.v) &&
         aligned(p.o) && aligned(p.dout);
#else
  (void)p;
  return false;
#endif
}

#if defined(JAX_FLASH_HAVE_SM90A)
template <typename T>
cudaError_t forward_sm90(const FlashParams& p, cudaStream_t s) {
  switch (head_dim_class(p.head_dim)) {
    case 64: return sm90::launch_fwd_sm90<T, 64>(p, s);
    case 128: return sm90::launch_fwd_sm90<T, 128>(p, s);
    default: return sm90::launch_fwd_sm90<T, 256>(p, s);
  }
}
#endif

template <typename T>
cudaError_t forward(const FlashParams& p, cudaStream_t s) {
#if defined(JAX_FLASH_HAVE_SM90A)
  if (use_sm90(p)) return forward_sm90<T>(p, s);
#endif
  return forward_sm80<T>(p, s);
}

template <typename T>
cudaError_t backward_sm80(const FlashParams& p, cudaStream_t s) {
  int smem = kSmallSmemOptinBytes;
  if (!force_small_smem()) {
    if (cudaError_t e = cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(&smem); e != cudaSuccess) {
      return e;
    }
  }
  switch (head_dim_class(p.head_dim)) {
    case 64: return launch_bwd_sm80<T, 64>(p, s, smem);
    case 128: return launch_bwd_sm80<T, 128>(p, s, smem);
    default: return launch_bwd_sm80<T, 256>(p, s, smem);
  }
}

// Hopper backward: every head-dim class (256 on the kernel that splits the head dim between its warpgroups).
bool use_sm90_backward(const FlashParams& p) { return use_sm90(p); }

template <typename T>
cudaError_t backward(const FlashParams& p, cudaStream_t s) {
#if defined(JAX_FLASH_HAVE_SM90A)
  if (use_sm90_backward(p)) {
    switch (head_dim_class(p.head_dim)) {
      case 64: return sm90::launch_bwd_sm90<T, 64>(p, s);
      case 128: return sm90::launch_bwd_sm90<T, 128>(p, s);
      default: return sm90::launch_bwd_sm90<T, 256>(p, s);
    }
  }
#endif
  return backward_sm80<T>(p, s);
}

}  // namespace

const char* UnsupportedReason(const FlashParams& p) {
  if (p.dtype == DType::kF32) return "the CUDA kernels take bfloat16 or float16, got float32";
  if (p.heads_q > kMaxGridYZ || p.batch > kMaxGridYZ) {
    return "the CUDA kernels support at most 65535 heads and 65535 batch elements (batch includes vmapped axes)";
  }
  const int cc = current_cc();
  if (cc == 0) return "could not query the CUDA device";
  if (cc < 80) return "the CUDA kernels need compute capability 8.0 or newer";
  return "";
}

const char* BackwardUnsupportedReason(const FlashParams& p) {
  // Without a query row or a key there is no dQ accumulation, so any backward is deterministic.
  if (!p.deterministic || p.batch == 0 || p.heads_q == 0 || p.seqlen_q == 0 || p.seqlen_k == 0) return "";
  if (use_sm90_backward(p) && head_dim_class(p.head_dim) <= 128) return "";
  return "deterministic=True needs the sm_90a backward kernel for head_dim <= 128: compute capability 9.0 and "
         "JAX_FLASH_FORCE_SM80 unset (the other backward kernels add dQ in no fixed order)";
}

cudaError_t RunFlashForward(const FlashParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads_q == 0) return cudaSuccess;
  return p.dtype == DType::kBF16 ? forward<__nv_bfloat16>(p, stream) : forward<__half>(p, stream);
}

cudaError_t RunFlashBackward(const FlashParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.heads_q == 0) return cudaSuccess;
  if (p.seqlen_q == 0) {  // nothing attends: dK = dV = 0
    const size_t bytes = size_t(p.batch) * p.seqlen_k * p.heads_kv * p.head_dim * 2;
    if (cudaError_t e = cudaMemsetAsync(p.dk, 0, bytes, stream); e != cudaSuccess) return e;
    return cudaMemsetAsync(p.dv, 0, bytes, stream);
  }
  return p.dtype == DType::kBF16 ? backward<__nv_bfloat16>(p, stream) : backward<__half>(p, stream);
}

}  // namespace jax_flash::cuda
