// Kernel selection: compute capability, dtype, head-dim class and the requested kernel family.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "kernels/common/launch_utils.h"
#include "kernels/decode/decode_traits.h"
#include "kernels/flash_api.h"
#if defined(JAX_FLASH_HAVE_SM90A)
#include "kernels/sm90/kernel_traits_sm90.h"
#endif

namespace jax_flash::cuda {
namespace {

constexpr int kMaxGridYZ = 65535;
constexpr int kSmallSmemOptinBytes = 99 * 1024;  // sm_86 / sm_89

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

// Calls launch(HeadDim<kD>{}) for the head-dim class kD of head_dim (64, 128 or 256; other head dims are padded up
// to their class inside the kernels).
template <int kD>
using HeadDim = std::integral_constant<int, kD>;
template <typename Launch>
cudaError_t for_head_dim_class(int head_dim, Launch&& launch) {
  switch (head_dim_class(head_dim)) {
    case 64:
      return launch(HeadDim<64>{});
    case 128:
      return launch(HeadDim<128>{});
    default:
      return launch(HeadDim<256>{});
  }
}

// The sm_90a kernels run on compute capability 9.0 exactly (sm_90a code runs nowhere else) unless the call asks
// for the sm_80-class family. TMA needs 16-byte aligned base addresses (XLA's buffers are; the forward also stores
// O through a tensor map) and at least one key.
bool sm90_family(KernelChoice choice) {
  return choice == KernelChoice::kAuto || choice == KernelChoice::kSm90DecodeCpAsync;
}
bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

bool use_sm90(const FlashParams& p, KernelChoice choice) {
#if defined(JAX_FLASH_HAVE_SM90A)
  const auto aligned = aligned16;
  return sm90_family(choice) && current_cc() == 90 && p.seqlen_k > 0 && aligned(p.q) && aligned(p.k) &&
         aligned(p.v) && aligned(p.o) && aligned(p.dout);
#else
  (void)p;
  (void)choice;
  return false;
#endif
}

template <typename T>
cudaError_t forward(const FlashParams& p, KernelChoice choice, cudaStream_t s) {
#if defined(JAX_FLASH_HAVE_SM90A)
  if (use_sm90(p, choice)) {
    return for_head_dim_class(p.head_dim, [&](auto d) { return sm90::launch_fwd_sm90<T, decltype(d)::value>(p, s); });
  }
#endif
  return for_head_dim_class(p.head_dim, [&](auto d) { return launch_fwd_sm80<T, decltype(d)::value>(p, s); });
}

template <typename T>
cudaError_t backward(const FlashParams& p, KernelChoice choice, cudaStream_t s) {
#if defined(JAX_FLASH_HAVE_SM90A)
  if (use_sm90(p, choice)) {
    return for_head_dim_class(p.head_dim, [&](auto d) { return sm90::launch_bwd_sm90<T, decltype(d)::value>(p, s); });
  }
#endif
  int smem = kSmallSmemOptinBytes;
  if (choice != KernelChoice::kSm80SmallSmem) {
    if (cudaError_t e = cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(&smem); e != cudaSuccess) {
      return e;
    }
  }
  return for_head_dim_class(p.head_dim, [&](auto d) { return launch_bwd_sm80<T, decltype(d)::value>(p, s, smem); });
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

int Sm80SmemBytes(int head_dim, bool backward, int smem_optin_bytes) {
  switch (head_dim_class(head_dim)) {
    case 64:
      return sm80_smem_bytes<64>(backward, smem_optin_bytes);
    case 128:
      return sm80_smem_bytes<128>(backward, smem_optin_bytes);
    default:
      return sm80_smem_bytes<256>(backward, smem_optin_bytes);
  }
}

namespace {

// Whether the sm_80-class kernel fits (false only where a device answers with less shared memory than it needs).
bool sm80_fits(int head_dim, bool backward, KernelChoice choice) {
  int smem = kSmallSmemOptinBytes;
  if (choice != KernelChoice::kSm80SmallSmem &&
      cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(&smem) != cudaSuccess) {
    return true;
  }
  return Sm80SmemBytes(head_dim, backward, smem) <= smem;
}

constexpr const char* kForwardTooBig =
    "the sm_80-class forward kernel at head dim 256 needs 128 KB of shared memory per block, more than this GPU has "
    "(sm_86 / sm_89: 99 KB); jax_flash.dot_product_attention runs its XLA path there";
constexpr const char* kBackwardTooBig =
    "the sm_80-class backward kernel at head dim 256 needs 201 KB of shared memory per block, more than this GPU has "
    "(sm_80: 163 KB, sm_86 / sm_89: 99 KB); jax_flash.dot_product_attention runs its XLA path there";

}  // namespace

bool AttentionFitsDevice(int head_dim, bool backward, KernelChoice choice) {
#if defined(JAX_FLASH_HAVE_SM90A)
  if (sm90_family(choice) && current_cc() == 90) return true;  // the sm_90a kernels (and sm_80's on 227 KB)
#endif
  return sm80_fits(head_dim, backward, choice);
}

const char* ForwardUnsupportedReason(const FlashParams& p, KernelChoice choice) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads_q == 0 || use_sm90(p, choice)) return "";
  return sm80_fits(p.head_dim, false, choice) ? "" : kForwardTooBig;
}

const char* BackwardUnsupportedReason(const FlashParams& p, KernelChoice choice) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads_q == 0) return "";
  if (!use_sm90(p, choice) && !sm80_fits(p.head_dim, true, choice)) return kBackwardTooBig;
  // Without a key there is no dQ accumulation, so any backward is deterministic.
  if (!p.deterministic || p.seqlen_k == 0) return "";
  if (use_sm90(p, choice) && p.head_dim <= 128) return "";
  return "deterministic=True needs the sm_90a backward kernel for head_dim <= 128: compute capability 9.0 and no "
         "forced sm_80-class kernel (the other backward kernels add dQ in no fixed order)";
}

cudaError_t RunFlashForward(const FlashParams& p, KernelChoice choice, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads_q == 0) return cudaSuccess;
  return p.dtype == DType::kBF16 ? forward<__nv_bfloat16>(p, choice, stream) : forward<__half>(p, choice, stream);
}

namespace {

// The sm_90a decode kernels run on compute capability 9.0 (sm_90a built, no forced sm_80-class kernel) for more
// than 32 packed rows at head dims up to 128 (at 17-32 rows the mma.sync kernel measured level or faster): the TMA
// kernel for 65-128 rows over dense or paged caches (unless the call asks for the cp.async one), the cp.async wgmma
// kernel for the rest; the mma.sync kernel everywhere else.
enum class DecodeKernel { kMmaSync, kWgmmaCpAsync, kTma };
DecodeKernel decode_kernel(int head_dim, int packed_rows, KernelChoice choice) {
#if defined(JAX_FLASH_HAVE_SM90A)
  if (sm90_family(choice) && head_dim_class(head_dim) <= 128 && packed_rows >= decode::kWgmmaMinRows &&
      packed_rows <= kMaxDecodeRows && current_cc() == 90) {
    return packed_rows > decode::kWgmmaGroupRows && choice == KernelChoice::kAuto ? DecodeKernel::kTma
                                                                                    : DecodeKernel::kWgmmaCpAsync;
  }
#else
  (void)head_dim;
  (void)packed_rows;
  (void)choice;
#endif
  return DecodeKernel::kMmaSync;
}

}  // namespace

DecodeLaunchShape GetDecodeLaunchShape(int head_dim, int packed_rows, KernelChoice choice) {
  const int kd = head_dim_class(head_dim);
  switch (decode_kernel(head_dim, packed_rows, choice)) {
    case DecodeKernel::kTma:
#if defined(JAX_FLASH_HAVE_SM90A)
      return {kd <= 64 ? sm90::FwdKernelTraitsSm90<__nv_bfloat16, sm90::DecodeTmaTileTraits<64>>::kSmemBytes
                       : sm90::FwdKernelTraitsSm90<__nv_bfloat16, sm90::DecodeTmaTileTraits<128>>::kSmemBytes,
              sm90::FwdKernelTraitsSm90<__nv_bfloat16, sm90::DecodeTmaTileTraits<128>>::kThreads};
#endif
    case DecodeKernel::kWgmmaCpAsync: {
      const int groups = decode::WgmmaGroups(packed_rows);
      return {decode::WgmmaSmemBytes(kd, groups), decode::WgmmaThreads(groups)};
    }
    case DecodeKernel::kMmaSync:
      break;
  }
  const int row_tiles = decode::RowTiles(packed_rows);
  if (packed_rows < 1 || row_tiles == 0) return {0, 0};
  return {decode::SmemBytes(kd, row_tiles), decode::Threads(kd, row_tiles)};
}

bool DecodeFitsDevice(int head_dim, int packed_rows, KernelChoice choice) {
  int smem = kSmallSmemOptinBytes;
  if (choice != KernelChoice::kSm80SmallSmem &&
      cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(&smem) != cudaSuccess) {
    return true;  // no device answers: nothing runs here
  }
  return GetDecodeLaunchShape(head_dim, packed_rows, choice).smem_bytes <= smem;
}

const char* DecodeUnsupportedReason(const FlashParams& p, KernelChoice choice) {
  if (const char* why = UnsupportedReason(p); why[0] != '\0') return why;
  const int rows = p.group_size() * p.seqlen_q;
  if (rows > kMaxDecodeRows) {
    return "decode packs at most 128 query rows (query heads per kv head x query rows) per kv head";
  }
  int smem = 0;
  if (choice == KernelChoice::kSm80SmallSmem) {
    smem = kSmallSmemOptinBytes;
  } else if (cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(&smem) != cudaSuccess) {
    return "could not query the CUDA device's shared memory";
  }
  if (GetDecodeLaunchShape(p.head_dim, rows, choice).smem_bytes > smem) {
    return "the decode kernel at this head dim needs more shared memory per block than this GPU has (above head dim "
           "64 more than the 99 KB of sm_86 / sm_89 GPUs)";
  }
  return "";
}

cudaError_t RunFlashDecode(const FlashParams& p, KernelChoice choice, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads_q == 0) return cudaSuccess;
  [[maybe_unused]] const DecodeKernel kernel =
      decode_kernel(p.head_dim, p.group_size() * p.seqlen_q, choice);
  auto run = [&](auto t) -> cudaError_t {
    using T = decltype(t);
#if defined(JAX_FLASH_HAVE_SM90A)
    // TMA reads q (and a dense cache) through 16-byte aligned tensor maps, a paged cache's gather copies 16-byte
    // chunks (XLA's buffers always are aligned; the launch shape, and with it the split count, assumes so), of at
    // least one key (a tensor map has no empty dimension).
    if (kernel == DecodeKernel::kTma && p.seqlen_k > 0 && aligned16(p.q) && aligned16(p.k) && aligned16(p.v)) {
      if (head_dim_class(p.head_dim) == 64) return sm90::launch_decode_tma<T, 64>(p, stream);
      return sm90::launch_decode_tma<T, 128>(p, stream);
    }
    if (kernel != DecodeKernel::kMmaSync) {
      if (head_dim_class(p.head_dim) == 64) return sm90::launch_decode_wgmma<T, 64>(p, stream);
      return sm90::launch_decode_wgmma<T, 128>(p, stream);
    }
#endif
    return for_head_dim_class(p.head_dim, [&](auto d) { return launch_decode<T, decltype(d)::value>(p, stream); });
  };
  return p.dtype == DType::kBF16 ? run(__nv_bfloat16{}) : run(__half{});
}

cudaError_t RunFlashBackward(const FlashParams& p, KernelChoice choice, cudaStream_t stream) {
  if (p.batch == 0 || p.heads_q == 0) return cudaSuccess;
  if (p.seqlen_q == 0) {  // nothing attends: dK = dV = 0
    const size_t bytes = size_t(p.batch) * p.seqlen_k * p.heads_kv * p.head_dim * 2;
    if (cudaError_t e = cudaMemsetAsync(p.dk, 0, bytes, stream); e != cudaSuccess) return e;
    return cudaMemsetAsync(p.dv, 0, bytes, stream);
  }
  return p.dtype == DType::kBF16 ? backward<__nv_bfloat16>(p, choice, stream) : backward<__half>(p, choice, stream);
}

}  // namespace jax_flash::cuda
