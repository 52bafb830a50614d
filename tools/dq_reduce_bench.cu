// How fast a full grid can add float32 dQ tiles into a global accumulator, by the ways a backward kernel can do it:
// red.global.add (.f32, .v2.f32, .v4.f32) straight from registers, and the TMA bulk reduce from shared memory (what
// the d64/d128 backward does), the first four in a coalesced order (float slot j * 256 + thread), the last as
// session 5's d256 v1 added its wgmma accumulator fragments into row-major [row][256] tiles (a warp instruction
// spans 8 rows). The d256 redesign (docs/d256_bwd_plan.md) adds dQ^T from registers; this measures
// whether the L2 keeps up with the rate it needs. Each CTA (two 128-thread "warpgroups", as the backward's
// consumers) walks query tiles of 64 rows x 256 floats (64 KB) of one of `heads` accumulators, adding a tile of ones
// per step, CTAs of one head starting together so several add into the same tile at once (as key blocks of one head
// do). Prints GB/s of reduce traffic, the float32 sum check, and the d256 backward TFLOP/s that rate would carry
// at 64 x 80 tiles (5 GEMMs of 64 x 80 x 256 per 64 KB of dQ).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a tools/dq_reduce_bench.cu -o /tmp/dqr && /tmp/dqr
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"

constexpr int kThreads = 256;              // two warpgroups
constexpr int kTileFloats = 64 * 256;      // one query tile of dQ at head dim 256
constexpr int kPerThread = kTileFloats / kThreads;  // 64 floats, as a dQ^T accumulator of FA3's d256 design

enum Method { kRedF32 = 0, kRedV2 = 1, kRedV4 = 2, kBulk = 3, kRowV2 = 4 };
const char* kNames[] = {"red.global.add.f32", "red.global.add.v2.f32", "red.global.add.v4.f32",
                        "cp.reduce.async.bulk .add.f32 (smem)", "red.global.add.v2.f32 row-major"};

__device__ __forceinline__ void red_v4(float* p, float a, float b, float c, float d) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d) : "memory");
}
__device__ __forceinline__ void red_v2(float* p, float a, float b) {
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};" ::"l"(p), "f"(a), "f"(b) : "memory");
}
__device__ __forceinline__ void red_f32(float* p, float a) {
  asm volatile("red.global.add.f32 [%0], %1;" ::"l"(p), "f"(a) : "memory");
}

// Tiles per head `tiles`; CTA c works on head c % heads and starts at tile (c / heads) * stride % tiles, then walks
// `steps` tiles in order (wrapping). Every method adds 1.0 to each float of each tile it visits.
template <int kMethod>
__global__ void __launch_bounds__(kThreads) reduce_kernel(float* acc, int heads, int tiles, int steps, int stride) {
  extern __shared__ float4 smem4[];  // kBulk: the tile staged in shared memory
  const int head = blockIdx.x % heads;
  int tile = (blockIdx.x / heads) * stride % tiles;
  const int tid = threadIdx.x;
  if constexpr (kMethod == kBulk) {
    for (int i = tid; i < kTileFloats / 4; i += kThreads) smem4[i] = make_float4(1.f, 1.f, 1.f, 1.f);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
  }
  float v[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) v[i] = 1.f;
  for (int s = 0; s < steps; ++s, tile = tile + 1 == tiles ? 0 : tile + 1) {
    float* t = acc + (int64_t(head) * tiles + tile) * kTileFloats;
    if constexpr (kMethod == kRedV4) {  // fragment order: float4 slot j * kThreads + tid (coalesced per j)
#pragma unroll
      for (int j = 0; j < kPerThread / 4; ++j) {
        red_v4(t + 4 * (j * kThreads + tid), v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
      }
    } else if constexpr (kMethod == kRedV2) {
#pragma unroll
      for (int j = 0; j < kPerThread / 2; ++j) red_v2(t + 2 * (j * kThreads + tid), v[2 * j], v[2 * j + 1]);
    } else if constexpr (kMethod == kRowV2) {  // session 5's v1: [row][256] rows, wgmma accumulator fragments
      const int wg = tid / 128, w = (tid / 32) % 4, g = (tid % 32) / 4, q = tid % 4;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          red_v2(t + (16 * w + g + 8 * half) * 256 + 128 * wg + 8 * j + 2 * q, v[4 * j + 2 * half],
                 v[4 * j + 2 * half + 1]);
        }
      }
    } else if constexpr (kMethod == kRedF32) {
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) red_f32(t + j * kThreads + tid, v[j]);
    } else {  // one thread issues the tile's bulk reduce in two 32 KB halves (one per "warpgroup", as the d128 writer)
      if (tid == 0) {
        for (int h = 0; h < 2; ++h) {
          const uint32_t src = uint32_t(__cvta_generic_to_shared(smem4)) + h * (kTileFloats * 2);
          asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(
                           t + h * (kTileFloats / 2)),
                       "r"(src), "r"(kTileFloats * 2)
                       : "memory");
        }
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");  // at most two tiles in flight
      }
    }
  }
  if constexpr (kMethod == kBulk) {
    if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
}

template <int kMethod>
void run(int sms, int ctas_per_head, int tiles, int steps) {
  const int heads = sms / ctas_per_head;
  const int grid = heads * ctas_per_head;
  const size_t floats = size_t(heads) * tiles * kTileFloats;
  float* acc;
  CUDA_CHECK(cudaMalloc(&acc, floats * sizeof(float)));
  const int smem = kMethod == kBulk ? kTileFloats * int(sizeof(float)) : 0;
  if (smem > 48 * 1024) {
    CUDA_CHECK(cudaFuncSetAttribute(reduce_kernel<kMethod>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  const int stride = 0;  // the CTAs of a head start on the same tile: the contention of key blocks walking together
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int rep = 0; rep < 4; ++rep) {
    CUDA_CHECK(cudaMemset(acc, 0, floats * sizeof(float)));
    CUDA_CHECK(cudaEventRecord(a));
    reduce_kernel<kMethod><<<grid, kThreads, smem>>>(acc, heads, tiles, steps, stride);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaEventRecord(b));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (rep > 0 && ms < best) best = ms;  // the first run warms up
  }
  // Check: each tile of a head got ctas_per_head adds per full lap of its CTAs.
  std::vector<float> host(floats);
  CUDA_CHECK(cudaMemcpy(host.data(), acc, floats * sizeof(float), cudaMemcpyDeviceToHost));
  double sum = 0;
  for (float x : host) sum += x;
  const double expect = double(grid) * steps * kTileFloats;
  const double bytes = double(grid) * steps * kTileFloats * sizeof(float);
  const double gbps = bytes / (best * 1e-3) / 1e9;
  const double flop_per_byte = 5.0 * 2 * 64 * 80 * 256 / (kTileFloats * sizeof(float));  // d256, 64 x 80 tiles
  std::printf("%-38s ctas/head %3d  acc %6.1f MB  %8.3f ms  %7.0f GB/s  carries %5.0f TFLOP/s  sum %s\n",
              kNames[kMethod], ctas_per_head, floats * 4 / 1e6, best, gbps, gbps * flop_per_byte / 1e3,
              sum == expect ? "ok" : "WRONG");
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  CUDA_CHECK(cudaFree(acc));
}

int main() {
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("%s, %d SMs; a CTA per SM, %d threads; tiles of 64 x 256 float32 (64 KB)\n", prop.name, sms, kThreads);
  const int steps = 64;
  for (int ctas_per_head : {1, 4, 33}) {
    const int tiles = 64;  // 4096 query rows per head: 4 MB a head
    run<kRedF32>(sms, ctas_per_head, tiles, steps);
    run<kRedV2>(sms, ctas_per_head, tiles, steps);
    run<kRedV4>(sms, ctas_per_head, tiles, steps);
    run<kBulk>(sms, ctas_per_head, tiles, steps);
    run<kRowV2>(sms, ctas_per_head, tiles, steps);
  }
  return 0;
}
