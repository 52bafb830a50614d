// The backward preprocess's memory traffic (session 49): does it gain from writing dq_accum's zeros as a stream of
// their own (cudaMemsetAsync or a write-only kernel) beside a read-only preprocess? L2 flushed between runs.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a tools/preprocess_bench.cu -o /tmp/pre && /tmp/pre
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <type_traits>
#include <vector>

#include "cuda_check.h"

constexpr int kThreads = 256, kLanes = 16, kD = 128;  // as the package's preprocess (common/bwd_pre_post.cuh)

// The package's preprocess at head dim 128, rows [b, h, i], 16 lanes a row: lse * log2(e) and dsum = rowsum(dO * O),
// and with kZero the row's dq_accum zeros (kStreaming: st.global.cs).
template <bool kZero, bool kStreaming>
__global__ void __launch_bounds__(kThreads) pre(const __nv_bfloat16* o, const __nv_bfloat16* dout, const float* lse,
    float* dq, float* dsum, float* lse2, int B, int H, int S) {
  const long rows = long(B) * H * S;
  const long row = (long(blockIdx.x) * kThreads + threadIdx.x) / kLanes;
  const int sub = threadIdx.x % kLanes;
  const bool valid = row < rows;
  const int i = int(row % S), h = int(row / S % H), b = int(row / S / H);
  float acc = 0.f, l2 = 0.f;
  if (valid) {
    l2 = lse[(long(b) * H + h) * S + i] * 1.4426950408889634f;
    const long off = (long(b) * S + i) * H * kD + long(h) * kD;
    const uint4 ov = *reinterpret_cast<const uint4*>(o + off + sub * 8);
    const uint4 dv = *reinterpret_cast<const uint4*>(dout + off + sub * 8);
    const uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
    for (int w = 0; w < 4; ++w) {
      float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ow[w]));
      float2 c = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&dw[w]));
      acc += a.x * c.x + a.y * c.y;
    }
    if (kZero) {
      float4* accum = reinterpret_cast<float4*>(dq + ((long(b) * H + h) * S + i) * kD);
      for (int c = sub; c < kD / 4; c += kLanes) {
        if (kStreaming) __stcs(accum + c, make_float4(0.f, 0.f, 0.f, 0.f));
        else accum[c] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
  for (int m = kLanes / 2; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffff, acc, m);
  if (valid && sub == 0) { lse2[(long(b) * H + h) * S + i] = l2; dsum[(long(b) * H + h) * S + i] = acc; }
}
// dq_accum's zeros alone.
__global__ void zero_kernel(float4* p, long n) {
  for (long i = long(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += long(gridDim.x) * blockDim.x)
    p[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}
// Evicts the L2 between runs.
__global__ void flush_kernel(float4* p, long n, float v) {
  for (long i = long(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += long(gridDim.x) * blockDim.x)
    p[i] = make_float4(v, v, v, v);
}

int main() {
  int sms;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs\n", prop.name, sms);
  const long flush_bytes = 512l << 20;  // written between runs: larger than any L2
  float4* flush;
  CUDA_CHECK(cudaMalloc(&flush, flush_bytes));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  struct Shape {
    int B, S, H;
  };
  for (Shape sh : {Shape{4, 8192, 16}, Shape{16, 1024, 16}, Shape{1, 16384, 16}}) {
    const long rows = long(sh.B) * sh.H * sh.S, elems = rows * kD;
    __nv_bfloat16 *o, *dout;
    float *lse, *dq, *dsum, *lse2;
    CUDA_CHECK(cudaMalloc(&o, elems * 2));
    CUDA_CHECK(cudaMalloc(&dout, elems * 2));
    CUDA_CHECK(cudaMalloc(&lse, rows * 4));
    CUDA_CHECK(cudaMalloc(&dq, elems * 4));
    CUDA_CHECK(cudaMalloc(&dsum, rows * 4));
    CUDA_CHECK(cudaMalloc(&lse2, rows * 4));
    CUDA_CHECK(cudaMemset(o, 0x3c, elems * 2));
    CUDA_CHECK(cudaMemset(dout, 0x3c, elems * 2));
    CUDA_CHECK(cudaMemset(lse, 0, rows * 4));
    const unsigned grid = unsigned((rows * kLanes + kThreads - 1) / kThreads);
    auto preprocess = [&](auto zero, auto streaming) {
      pre<decltype(zero)::value, decltype(streaming)::value>
          <<<grid, kThreads>>>(o, dout, lse, dq, dsum, lse2, sh.B, sh.H, sh.S);
    };
    auto memset = [&] { CUDA_CHECK(cudaMemsetAsync(dq, 0, elems * 4)); };
    auto zero = [&] { zero_kernel<<<sms * 8, 256>>>(reinterpret_cast<float4*>(dq), elems / 4); };
    using Yes = std::true_type;
    using No = std::false_type;
    // Median and minimum of 12 timed runs (after 3 untimed), each after the flush.
    auto run = [&](const char* name, auto f) {
      std::vector<float> t;
      for (int it = 0; it < 15; ++it) {
        flush_kernel<<<sms * 4, 512>>>(flush, flush_bytes / 16, float(it));
        CUDA_CHECK(cudaEventRecord(e0));
        f();
        CUDA_CHECK(cudaEventRecord(e1));
        CUDA_CHECK(cudaEventSynchronize(e1));
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 3) t.push_back(ms * 1000.f);
      }
      CUDA_CHECK(cudaGetLastError());
      std::sort(t.begin(), t.end());
      std::printf("  %-44s median %8.1f us  min %8.1f\n", name, t[t.size() / 2], t[0]);
    };
    std::printf("B %d S %d H %d D %d: O+dO %.0f MB, dq_accum %.0f MB\n", sh.B, sh.S, sh.H, kD, elems * 4 / 1e6,
                elems * 4 / 1e6);
    run("preprocess (reads + zeroes, as main)", [&] { preprocess(Yes{}, No{}); });
    run("preprocess, zeroes streaming (st.cs)", [&] { preprocess(Yes{}, Yes{}); });
    run("preprocess reads only", [&] { preprocess(No{}, No{}); });
    run("cudaMemsetAsync(dq_accum)", memset);
    run("zero kernel (float4, grid-stride)", zero);
    run("memset + reads only", [&] { memset(); preprocess(No{}, No{}); });
    run("reads only + memset", [&] { preprocess(No{}, No{}); memset(); });
    run("zero kernel + reads only", [&] { zero(); preprocess(No{}, No{}); });
    for (void* ptr : {static_cast<void*>(o), static_cast<void*>(dout), static_cast<void*>(lse),
                      static_cast<void*>(dq), static_cast<void*>(dsum), static_cast<void*>(lse2)}) {
      CUDA_CHECK(cudaFree(ptr));
    }
  }
  CUDA_CHECK(cudaFree(flush));
  return 0;
}
