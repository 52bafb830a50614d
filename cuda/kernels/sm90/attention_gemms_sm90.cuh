// The two products of an attention tile as wgmma issue loops over 128-byte-swizzled shared-memory tiles (column
// blocks of 64 elements, sm90/smem_layout.h), shared by the forward main loop and the decode kernel. Each issues its
// products and commits them as one wgmma group; the caller fences before and waits after. Descriptors are built once
// per operand and advanced by compile-time offsets (the block distances are constants at every call site).
#pragma once

#include <cstdint>

#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/smem_layout.h"
#include "kernels/sm90/utils_sm90.cuh"
#include "kernels/sm90/wgmma_sm90.cuh"

namespace jax_flash::cuda::sm90 {

// S (64 x kN) = Q K^T over head dim kD: Q's 64 rows at q_base, K's kN rows at k_base, both K-major with their 64-wide
// column blocks q_block_bytes / k_block_bytes apart.
template <int kN, int kD, typename T>
__device__ __forceinline__ void issue_qk(float (&acc)[kN / 2], uint32_t q_base, uint32_t q_block_bytes,
                                         uint32_t k_base, uint32_t k_block_bytes) {
  constexpr int kKStepsPerColBlock = kColBlock / kWgmmaK;  // 16-element K slices per 128-byte row
  const uint64_t desc_q0 = make_desc_sw128(q_base, kKMajorLeadingBytes);
  const uint64_t desc_k0 = make_desc_sw128(k_base, kKMajorLeadingBytes);
#pragma unroll
  for (int kk = 0; kk < kD / kWgmmaK; ++kk) {
    const uint32_t k_off = (kk % kKStepsPerColBlock) * (kWgmmaK * sizeof(T));  // inside the 128-byte row
    const uint64_t desc_q = desc_advance(desc_q0, (kk / kKStepsPerColBlock) * q_block_bytes + k_off);
    const uint64_t desc_k = desc_advance(desc_k0, (kk / kKStepsPerColBlock) * k_block_bytes + k_off);
    Wgmma<kN, T, 0>::ss(acc, desc_q, desc_k, kk > 0);
  }
  wgmma_commit();
}

// O (64 x kD) += P V over kKeys keys: P as wgmma A fragments (16 keys per step), V's rows at v_base read N-major, its
// 64-wide column blocks v_block_bytes apart.
template <int kKeys, int kD, typename T>
__device__ __forceinline__ void issue_pv(float (&acc_o)[kD / 2], const uint32_t (&a_p)[kKeys / kWgmmaK][4],
                                         uint32_t v_base, uint32_t v_block_bytes) {
  const uint64_t desc_v0 = make_desc_sw128(v_base, v_block_bytes);
#pragma unroll
  for (int kk = 0; kk < kKeys / kWgmmaK; ++kk) {
    Wgmma<kD, T, 1>::rs(acc_o, a_p[kk], desc_advance(desc_v0, kk * kWgmmaK * kSwizzleBytes), 1);
  }
  wgmma_commit();
}

}  // namespace jax_flash::cuda::sm90
