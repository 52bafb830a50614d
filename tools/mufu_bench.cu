// Throughput of the softmax's transcendental variants on one GPU, in elements per clock per SM: the hardware
// ex2 / tanh (f32 and packed f16x2 / bf16x2) and an FMA-pipe polynomial 2^x, alone and in the soft-capped
// softmax's mix (a tanh and an exp per score). Also each variant's largest relative error against double
// precision over a score range. Decides how the capped kernels spend their MUFU (NOTES, session 27).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda tools/mufu_bench.cu -o /tmp/mufu && /tmp/mufu
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernels/common/exp2_fma.cuh"
#include "cuda_check.h"

__device__ __forceinline__ float ex2_f32(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float tanh_f32(float x) {
  float y;
  asm volatile("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t ex2_f16x2(uint32_t x) {
  uint32_t y;
  asm volatile("ex2.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t tanh_f16x2(uint32_t x) {
  uint32_t y;
  asm volatile("tanh.approx.f16x2 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t ex2_bf16x2(uint32_t x) {
  uint32_t y;
  asm volatile("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack_f16(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ float2 unpack_f16(uint32_t v) {
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}
__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ float2 unpack_bf16(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
// 2^x on the FMA pipe: the kernels' exp2_fma (cuda/kernels/common/exp2_fma.cuh).
__device__ __forceinline__ float ex2_poly(float x) { return jax_flash::cuda::exp2_fma(x); }

constexpr int kChains = 16;
constexpr int kIters = 2048;

// mode: 0 ex2 f32, 1 tanh f32, 2 ex2 f16x2 (2 per op), 3 tanh f16x2, 4 ex2 bf16x2, 5 ex2 poly, 6 capped mix
// (tanh f32 + ex2 f32), 7 capped mix with every other exp by the polynomial, 8 capped mix with tanh f16x2,
// 9 capped mix with tanh f16x2 and every other exp by the polynomial, 10 capped mix with ex2 f16x2.
template <int kMode>
__global__ void bench(float* out, long long* clocks, float seed) {
  float v[kChains];
#pragma unroll
  for (int c = 0; c < kChains; ++c) v[c] = -0.001f * (threadIdx.x % 7 + c) + seed;
  const long long t0 = clock64();
  for (int it = 0; it < kIters; ++it) {
    if constexpr (kMode == 0) {
#pragma unroll
      for (int c = 0; c < kChains; ++c) v[c] = ex2_f32(v[c]) - 1.001f;
    } else if constexpr (kMode == 1) {
#pragma unroll
      for (int c = 0; c < kChains; ++c) v[c] = tanh_f32(v[c]) - 0.5f;
    } else if constexpr (kMode == 2 || kMode == 3 || kMode == 4) {
      uint32_t* u = reinterpret_cast<uint32_t*>(v);
#pragma unroll
      for (int c = 0; c < kChains; ++c) u[c] = kMode == 2 ? ex2_f16x2(u[c]) : kMode == 3 ? tanh_f16x2(u[c]) : ex2_bf16x2(u[c]);
    } else if constexpr (kMode == 5) {
#pragma unroll
      for (int c = 0; c < kChains; ++c) v[c] = ex2_poly(v[c]) - 1.001f;
    } else {
      // the capped softmax's per-score work: t = tanh(pre s); p = 2^(t a - m); sum += p; (s feeds back)
      float sum = 0.f;
      float t[kChains];
      if constexpr (kMode == 8 || kMode == 9) {
#pragma unroll
        for (int c = 0; c < kChains; c += 2) {
          const float2 tt = unpack_f16(tanh_f16x2(pack_f16(0.02f * v[c], 0.02f * v[c + 1])));
          t[c] = tt.x;
          t[c + 1] = tt.y;
        }
      } else {
#pragma unroll
        for (int c = 0; c < kChains; ++c) t[c] = tanh_f32(0.02f * v[c]);
      }
      if constexpr (kMode == 10) {
#pragma unroll
        for (int c = 0; c < kChains; c += 2) {
          const float2 e = unpack_f16(ex2_f16x2(pack_f16(fmaf(t[c], 72.f, -60.f), fmaf(t[c + 1], 72.f, -60.f))));
          v[c] = e.x;
          v[c + 1] = e.y;
          sum += e.x + e.y;
        }
      } else {
#pragma unroll
        for (int c = 0; c < kChains; ++c) {
          const float x = fmaf(t[c], 72.f, -60.f);
          const float e = ((kMode == 7 || kMode == 9) && (c % 2)) ? ex2_poly(x) : ex2_f32(x);
          v[c] = e;
          sum += e;
        }
      }
      v[0] += sum * 1e-30f;
    }
  }
  const long long t1 = clock64();
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < kChains; ++c) acc += v[c];
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
  if (threadIdx.x == 0) clocks[blockIdx.x] = t1 - t0;
}

__global__ void errors(float* err) {  // the largest relative errors of the variants over 2^20 points each
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  const float x = -30.f + 30.f * i / float(1 << 20);  // exp arguments in [-30, 0)
  const double want = exp2((double)x);
  auto rel = [&](float got) { return float(fabs(got - want) / want); };
  atomicMax(reinterpret_cast<int*>(&err[0]), __float_as_int(rel(ex2_f32(x))));
  atomicMax(reinterpret_cast<int*>(&err[1]), __float_as_int(rel(ex2_poly(x))));
  atomicMax(reinterpret_cast<int*>(&err[2]), __float_as_int(rel(unpack_f16(ex2_f16x2(pack_f16(x, x))).x)));
  atomicMax(reinterpret_cast<int*>(&err[3]), __float_as_int(rel(unpack_bf16(ex2_bf16x2(pack_bf16(x, x))).x)));
  const float y = -4.f + 8.f * i / float(1 << 20);  // tanh arguments in [-4, 4): absolute error
  const double tw = tanh((double)y);
  atomicMax(reinterpret_cast<int*>(&err[4]), __float_as_int(float(fabs(tanh_f32(y) - tw))));
  atomicMax(reinterpret_cast<int*>(&err[5]), __float_as_int(float(fabs(unpack_f16(tanh_f16x2(pack_f16(y, y))).x - tw))));
  if (i == 0) {  // special values of the polynomial: -inf -> 0, nan -> nan, 0 -> 1
    err[6] = ex2_poly(-INFINITY);
    err[7] = ex2_poly(NAN);
    err[8] = ex2_poly(0.f);
    err[9] = ex2_poly(-126.5f);
  }
}

template <int kMode>
void run(const char* name, double per_op, int sms, float* out, long long* clocks) {
  const int blocks = sms * 4, threads = 256;  // 32 warps an SM
  bench<kMode><<<blocks, threads>>>(out, clocks, -0.5f);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
  bench<kMode><<<blocks, threads>>>(out, clocks, -0.5f);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<long long> c(blocks);
  CUDA_CHECK(cudaMemcpy(c.data(), clocks, blocks * sizeof(long long), cudaMemcpyDeviceToHost));
  long long mx = 0;
  for (long long x : c) mx = x > mx ? x : mx;
  // every block of an SM runs at once (4 x 256 threads fit), so an SM's elements over the slowest block's clocks
  const double elems = 4.0 * threads * kChains * kIters * per_op;
  std::printf("%-44s %7.2f elements / clock / SM\n", name, elems / mx);
}

int main() {
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs\n", prop.name, sms);
  float* out;
  long long* clocks;
  CUDA_CHECK(cudaMalloc(&out, sms * 4 * 256 * sizeof(float)));
  CUDA_CHECK(cudaMalloc(&clocks, sms * 4 * sizeof(long long)));
  run<0>("ex2.approx.ftz.f32", 1, sms, out, clocks);
  run<1>("tanh.approx.f32", 1, sms, out, clocks);
  run<2>("ex2.approx.f16x2 (2 per op)", 2, sms, out, clocks);
  run<3>("tanh.approx.f16x2 (2 per op)", 2, sms, out, clocks);
  run<4>("ex2.approx.ftz.bf16x2 (2 per op)", 2, sms, out, clocks);
  run<5>("ex2 polynomial (FMA pipe)", 1, sms, out, clocks);
  run<6>("capped score: tanh f32 + ex2 f32", 1, sms, out, clocks);
  run<7>("capped score: tanh f32 + ex2 f32/poly halves", 1, sms, out, clocks);
  run<8>("capped score: tanh f16x2 + ex2 f32", 1, sms, out, clocks);
  run<9>("capped score: tanh f16x2 + ex2 f32/poly", 1, sms, out, clocks);
  run<10>("capped score: tanh f32 + ex2 f16x2", 1, sms, out, clocks);
  float* err;
  CUDA_CHECK(cudaMalloc(&err, 10 * sizeof(float)));
  CUDA_CHECK(cudaMemset(err, 0, 10 * sizeof(float)));
  errors<<<(1 << 20) / 256, 256>>>(err);
  CUDA_CHECK(cudaGetLastError());
  float e[10];
  CUDA_CHECK(cudaMemcpy(e, err, sizeof(e), cudaMemcpyDeviceToHost));
  std::printf("max relative error of 2^x, x in [-30, 0): ex2 f32 %.2e, polynomial %.2e, ex2 f16x2 %.2e, ex2 bf16x2 %.2e\n",
              e[0], e[1], e[2], e[3]);
  std::printf("max absolute error of tanh(y), y in [-4, 4): tanh f32 %.2e, tanh f16x2 %.2e\n", e[4], e[5]);
  std::printf("polynomial: 2^-inf = %g, 2^nan = %g, 2^0 = %g, 2^-126.5 = %g\n", e[6], e[7], e[8], e[9]);
  return 0;
}
