// PTX wrappers and small helpers for the sm_80-class kernels (mma.sync, ldmatrix, cp.async), valid on sm_80+.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/element_traits.cuh"
#include "kernels/common/shared_memory.cuh"
#include "kernels/common/warp_reduce.cuh"

namespace jax_flash::cuda {

// ---- tensor-core MMA: D(16x8,f32) += A(16x16,row) * B(16x8,col) ------------------------------------------------
// Fragment layout (lane = 4*g + t): a[0]=(g, 2t..2t+1) a[1]=(g+8, 2t..) a[2]=(g, 2t+8..) a[3]=(g+8, 2t+8..);
// b[0]=(k 2t..2t+1, n g) b[1]=(k 2t+8.., n g); c[0..1]=(g, 2t..2t+1) c[2..3]=(g+8, 2t..2t+1).
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16x8x16<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                           uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16x8x16<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- ldmatrix ----------------------------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// ---- cp.async (16 bytes, zero-filled when !pred) -------------------------------------------------------------------
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool pred) {
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(src_bytes));
}

// The same with an L2 cache policy for the lines it reads (l2_policy.cuh).
__device__ __forceinline__ void cp_async_16(uint32_t smem_addr, const void* gmem, bool pred, uint64_t policy) {
  const int src_bytes = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(smem_addr), "l"(gmem),
               "r"(src_bytes), "l"(policy));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- swizzled shared-memory tiles ----------------------------------------------------------------------------------
// A tile of kRows x kCols 16-bit elements, row-major, in 16-byte chunks; chunk c of row r lives at chunk
// c ^ (r % 8) so that the 8 rows an ldmatrix (or a cp.async wave) touches fall in distinct banks. kCols >= 64.
template <int kCols>
__device__ __forceinline__ int swz(int row, int col) {
  static_assert(kCols % 64 == 0, "swizzle needs at least 8 chunks per row");
  return row * kCols + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Byte address of (row, chunk) in a swizzled tile at shared address `tile`. For the fixed lane positions the
// kernels use (chunk even-aligned plus 0 or 1), moving right by 2j chunks is `addr ^ (32 * j)` and moving down by a
// multiple of 8 rows is `addr + rows * kCols * 2`, provided `tile` is aligned to its row bytes: the XOR only touches
// the chunk bits. That keeps the per-ldmatrix address arithmetic to one LOP3 (or none).
template <int kCols>
__device__ __forceinline__ uint32_t swz_addr(uint32_t tile, int row, int chunk) {
  return tile + row * (kCols * 2) + ((chunk ^ (row & 7)) << 4);
}
template <int kCols>
inline constexpr int kRowBytes = kCols * 2;

}  // namespace jax_flash::cuda
