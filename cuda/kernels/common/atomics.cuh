// Float32 reductions into global memory (the dQ accumulator).
#pragma once

#include <cuda_runtime.h>

namespace jax_flash::cuda {

// dst[0] += a, dst[1] += b (fire-and-forget; one vector reduction on sm_90).
__device__ __forceinline__ void atomic_add_f32x2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}

// dst[0..3] += a, b, c, d (16-byte aligned; one vector reduction on sm_90: a warp of consecutive float4 slots sends
// whole 128-byte lines, the fragment order the d256 backward adds dQ^T in; tools/dq_reduce_bench.cu measures it).
__device__ __forceinline__ void atomic_add_f32x4(float* dst, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
  atomicAdd(dst + 2, c);
  atomicAdd(dst + 3, d);
#endif
}

}  // namespace jax_flash::cuda
