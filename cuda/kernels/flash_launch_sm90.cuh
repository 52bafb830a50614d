// Launchers of the sm_90a kernels, instantiated per (dtype, head-dim class) in flash_sm90_hdim*.cu. Tensor maps
// (TMA descriptors) are encoded on the host for each call: a few microseconds, no device synchronisation, and they
// travel by value as __grid_constant__ kernel parameters, so a captured CUDA graph keeps them.
#pragma once

#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <tuple>

#include "flash_bwd_sm90_tma_wgmma_ws.cuh"
#include "flash_fwd_sm90_tma_wgmma_ws.cuh"
#include "flash_launch_sm80.cuh"  // ensure_smem_limit, ceil_div

namespace jax_flash::cuda::sm90 {

// cuTensorMapEncodeTiled from the driver, looked up once (the runtime is linked statically; no libcuda link).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      return PFN_cuTensorMapEncodeTiled_v12000{nullptr};
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// A [batch][seqlen][heads][head_dim] tensor seen as 4-d (head_dim, seqlen, heads, batch), boxes of
// kColBlock columns x box_rows rows of one (head, batch), 128-byte swizzled in shared memory.
template <typename T>
cudaError_t make_bthd_tensor_map(CUtensorMap* map, const void* base, int batch, int seqlen, int heads, int head_dim,
                                 int box_rows) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const CUtensorMapDataType dtype =
      std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const cuuint64_t elem = sizeof(T);
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(seqlen), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {elem * heads * head_dim, elem * head_dim, elem * seqlen * heads * head_dim};
  const cuuint32_t box[4] = {cuuint32_t(kColBlock), cuuint32_t(box_rows), 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = encode(map, dtype, 4, const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <typename T, int kD>
cudaError_t launch_fwd_sm90(const FlashParams& p, cudaStream_t stream) {
  using Traits = FwdKernelTraitsSm90<T, FwdTraitsSm90<kD>>;
  constexpr auto kernel = flash_fwd_sm90_kernel<T, Traits>;
  if (cudaError_t e = ensure_smem_limit<kernel>(Traits::kSmemBytes); e != cudaSuccess) return e;
  CUtensorMap tm_q, tm_k, tm_v;
  if (cudaError_t e = make_bthd_tensor_map<T>(&tm_q, p.q, p.batch, p.seqlen_q, p.heads_q, p.head_dim, Traits::kBlockM);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = make_bthd_tensor_map<T>(&tm_k, p.k, p.batch, p.seqlen_k, p.heads_kv, p.head_dim, Traits::kBlockN);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = make_bthd_tensor_map<T>(&tm_v, p.v, p.batch, p.seqlen_k, p.heads_kv, p.head_dim, Traits::kBlockN);
      e != cudaSuccess) {
    return e;
  }
  const dim3 grid(ceil_div(p.seqlen_q, Traits::kBlockM), p.heads_q, p.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p, tm_q, tm_k, tm_v);
  return cudaGetLastError();
}

// dq_accum = 0, dsum = rowsum(dO * O) (sm_80-class kernel), the sm_90a main kernel, dq = scale * dq_accum.
template <typename T, int kD>
cudaError_t launch_bwd_sm90(const FlashParams& p, cudaStream_t stream) {
  using Traits = BwdKernelTraitsSm90<T, BwdTraitsSm90<kD>>;
  const int64_t q_elems = int64_t(p.batch) * p.seqlen_q * p.heads_q * p.head_dim;
  if (cudaError_t e = cudaMemsetAsync(p.dq_accum, 0, q_elems * sizeof(float), stream); e != cudaSuccess) return e;
  const int64_t rows = int64_t(p.batch) * p.seqlen_q * p.heads_q;
  flash_bwd_preprocess_kernel<T><<<ceil_div(rows * kWarpSize, kPreprocessThreads), kPreprocessThreads, 0, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;

  constexpr auto kernel = flash_bwd_sm90_kernel<T, Traits>;
  if (cudaError_t e = ensure_smem_limit<kernel>(Traits::kSmemBytes); e != cudaSuccess) return e;
  CUtensorMap tm_q, tm_k, tm_v, tm_do;
  for (auto [map, ptr, seqlen, heads, box] :
       {std::tuple{&tm_q, p.q, p.seqlen_q, p.heads_q, Traits::kBlockM},
        std::tuple{&tm_do, static_cast<const void*>(p.dout), p.seqlen_q, p.heads_q, Traits::kBlockM},
        std::tuple{&tm_k, p.k, p.seqlen_k, p.heads_kv, Traits::kBlockN},
        std::tuple{&tm_v, p.v, p.seqlen_k, p.heads_kv, Traits::kBlockN}}) {
    if (cudaError_t e = make_bthd_tensor_map<T>(map, ptr, p.batch, seqlen, heads, p.head_dim, box); e != cudaSuccess) {
      return e;
    }
  }
  const dim3 grid(ceil_div(p.seqlen_k, Traits::kBlockN), p.heads_kv, p.batch);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p, tm_q, tm_k, tm_v, tm_do);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;

  flash_bwd_convert_dq_kernel<T><<<ceil_div(q_elems / 2, kPreprocessThreads), kPreprocessThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda::sm90

// Explicit instantiation for one (dtype, head-dim class).
#define JAX_FLASH_INSTANTIATE_SM90(T, D) \
  template cudaError_t jax_flash::cuda::sm90::launch_fwd_sm90<T, D>(const FlashParams&, cudaStream_t);

// The backward has a Hopper kernel for these head-dim classes (others run the sm_80-class backward).
#define JAX_FLASH_INSTANTIATE_SM90_BWD(T, D) \
  template cudaError_t jax_flash::cuda::sm90::launch_bwd_sm90<T, D>(const FlashParams&, cudaStream_t);
