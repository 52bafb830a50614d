// TMA tensor maps (descriptors) of the sm_90a kernels' operands, encoded on the host per call (a few microseconds,
// no device synchronisation); they travel by value as __grid_constant__ kernel parameters, so a captured CUDA graph
// keeps them.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <initializer_list>
#include <type_traits>

#include "flash_params.h"
#include "kernels/sm90/kernel_traits_sm90.h"  // kColBlock

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

// The L2 fill a load's miss triggers, unless a map asks for another: 256 bytes (the forward's and backward's maps: a
// 128-byte box row also brings the next 128 bytes into L2; the decode kernel's K/V maps take none).
inline constexpr CUtensorMapL2promotion kDefaultL2Promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B;

// A tensor of `rank` (<= 5) dims seen by TMA: dims[0] the innermost (contiguous) one, strides[i] the bytes between
// consecutive indices of dims[i + 1], boxes of box[i] along each, 128-byte swizzled in shared memory (box[0] *
// elem_bytes = 128), with `promotion` as its L2 fill.
inline cudaError_t encode_tensor_map(CUtensorMap* map, CUtensorMapDataType dtype, const void* base, int rank,
                                     const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                     CUtensorMapL2promotion promotion = kDefaultL2Promotion) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint32_t elem_strides[5] = {1, 1, 1, 1, 1};
  const CUresult r = encode(map, dtype, cuuint32_t(rank), const_cast<void*>(base), dims, strides, box, elem_strides,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <typename T>
constexpr CUtensorMapDataType tensor_map_dtype() {
  return std::is_same_v<T, __half> ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
}

// A [batch][seqlen][heads][head_dim] tensor of T seen as 4-d (head_dim, seqlen, heads, batch), boxes of kColBlock
// columns x box_rows rows of one (head, batch).
template <typename T>
cudaError_t make_bthd_tensor_map(CUtensorMap* map, const void* base, int batch, int seqlen, int heads, int head_dim,
                                 int box_rows, CUtensorMapL2promotion promotion = kDefaultL2Promotion) {
  const cuuint64_t elem = sizeof(T);
  const cuuint64_t dims[4] = {cuuint64_t(head_dim), cuuint64_t(seqlen), cuuint64_t(heads), cuuint64_t(batch)};
  const cuuint64_t strides[3] = {elem * heads * head_dim, elem * head_dim, elem * seqlen * heads * head_dim};
  const cuuint32_t box[4] = {cuuint32_t(kColBlock), cuuint32_t(box_rows), 1, 1};
  return encode_tensor_map(map, tensor_map_dtype<T>(), base, 4, dims, strides, box, promotion);
}

// Decode's query q [batch][Tq][heads_q][head_dim] seen as 5-d (head_dim, group, Tq, heads_kv, batch) (group = query
// heads per kv head), boxes of (kColBlock columns, group, Tq, 1, 1): the packed rows of one (kv head, batch) in
// row-major order, row t group + j holding step t of query head hk group + j.
template <typename T>
cudaError_t make_decode_q_tensor_map(CUtensorMap* map, const FlashParams& p) {
  const cuuint64_t elem = sizeof(T);
  const int group = p.group_size();
  const cuuint64_t dims[5] = {cuuint64_t(p.head_dim), cuuint64_t(group), cuuint64_t(p.seqlen_q), cuuint64_t(p.heads_kv),
                              cuuint64_t(p.batch)};
  const cuuint64_t strides[4] = {elem * p.head_dim, elem * p.heads_q * p.head_dim, elem * group * p.head_dim,
                                 elem * p.seqlen_q * p.heads_q * p.head_dim};
  const cuuint32_t box[5] = {cuuint32_t(kColBlock), cuuint32_t(group), cuuint32_t(p.seqlen_q), 1, 1};
  return encode_tensor_map(map, tensor_map_dtype<T>(), p.q, 5, dims, strides, box);
}

// Tensor maps for several [batch][seqlen][heads][head_dim] tensors: {map, base, seqlen, heads, box rows} each.
struct TensorMapSpec {
  CUtensorMap* map;
  const void* base;
  int seqlen;
  int heads;
  int box_rows;
  CUtensorMapL2promotion promotion = kDefaultL2Promotion;
};
template <typename T>
cudaError_t make_bthd_tensor_maps(const FlashParams& p, std::initializer_list<TensorMapSpec> specs) {
  for (const TensorMapSpec& s : specs) {
    if (cudaError_t e =
            make_bthd_tensor_map<T>(s.map, s.base, p.batch, s.seqlen, s.heads, p.head_dim, s.box_rows, s.promotion);
        e != cudaSuccess) {
      return e;
    }
  }
  return cudaSuccess;
}

}  // namespace jax_flash::cuda::sm90
