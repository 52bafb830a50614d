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

}  // namespace jax_flash::cuda
