// The backward preprocess's memory traffic (session 49): does it gain from writing dq_accum's zeros as a stream of
// their own (cudaMemsetAsync or a write-only kernel) beside a read-only preprocess? L2 flushed between runs.
// Build and run on the GPU: nvcc -O3 -arch=sm_90a -std=c++17 -o /tmp/preprocess_bench tools/preprocess_bench.cu
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA error %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

constexpr int kThreads = 256, kLanes = 16, kD = 128;
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
__global__ void zero_kernel(float4* p, long n) {
  for (long i = long(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += long(gridDim.x) * blockDim.x)
    p[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}
__global__ void flush_kernel(float4* p, long n, float v) {
  for (long i = long(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += long(gridDim.x) * blockDim.x)
    p[i] = make_float4(v, v, v, v);
}

int main() {
  int sms; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
  printf("device %s, %d SMs\n", prop.name, sms);
  const long flush_n = 512l << 20;  // 512 MB flush buffer (float4 count below)
  float4* flush; CK(cudaMalloc(&flush, flush_n));
  struct Shape { int B, S, H; };
  for (Shape sh : {Shape{4, 8192, 16}, Shape{16, 1024, 16}, Shape{1, 16384, 16}}) {
    const long rows = long(sh.B) * sh.H * sh.S, elems = rows * kD;
    __nv_bfloat16 *o, *dout; float *lse, *dq, *dsum, *lse2;
    CK(cudaMalloc(&o, elems * 2)); CK(cudaMalloc(&dout, elems * 2)); CK(cudaMalloc(&lse, rows * 4));
    CK(cudaMalloc(&dq, elems * 4)); CK(cudaMalloc(&dsum, rows * 4)); CK(cudaMalloc(&lse2, rows * 4));
    CK(cudaMemset(o, 0x3c, elems * 2)); CK(cudaMemset(dout, 0x3c, elems * 2)); CK(cudaMemset(lse, 0, rows * 4));
    const unsigned grid = unsigned((rows * kLanes + kThreads - 1) / kThreads);
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    auto run = [&](const char* name, auto f) {
      std::vector<float> t;
      for (int it = 0; it < 15; ++it) {
        flush_kernel<<<sms * 4, 512>>>(flush, flush_n / 16, float(it));
        CK(cudaEventRecord(e0)); f(); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
        float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); if (it >= 3) t.push_back(ms * 1000.f);
      }
      CK(cudaGetLastError());
      std::sort(t.begin(), t.end());
      printf("  %-44s median %8.1f us  min %8.1f\n", name, t[t.size() / 2], t[0]);
    };
    printf("B %d S %d H %d D %d: O+dO %.0f MB, dq_accum %.0f MB\n", sh.B, sh.S, sh.H, kD, elems * 4 / 1e6, elems * 4 / 1e6);
    run("preprocess (reads + zeroes, as main)", [&] { pre<true, false><<<grid, kThreads>>>(o, dout, lse, dq, dsum, lse2, sh.B, sh.H, sh.S); });
    run("preprocess, zeroes streaming (st.cs)", [&] { pre<true, true><<<grid, kThreads>>>(o, dout, lse, dq, dsum, lse2, sh.B, sh.H, sh.S); });
    run("preprocess reads only", [&] { pre<false, false><<<grid, kThreads>>>(o, dout, lse, dq, dsum, lse2, sh.B, sh.H, sh.S); });
    run("cudaMemsetAsync(dq_accum)", [&] { CK(cudaMemsetAsync(dq, 0, elems * 4)); });
    run("zero kernel (float4, grid-stride)", [&] { zero_kernel<<<sms * 8, 256>>>(reinterpret_cast<float4*>(dq), elems / 4); });
    run("memset + reads only", [&] { CK(cudaMemsetAsync(dq, 0, elems * 4)); pre<false, false><<<grid, kThreads>>>(o, dout, lse, dq, dsum, lse2, sh.B, sh.H, sh.S); });
    run("reads only + memset", [&] { pre<false, false><<<grid, kThreads>>>(o, dout, lse, dq, dsum, lse2, sh.B, sh.H, sh.S); CK(cudaMemsetAsync(dq, 0, elems * 4)); });
    run("zero kernel + reads only", [&] { zero_kernel<<<sms * 8, 256>>>(reinterpret_cast<float4*>(dq), elems / 4); pre<false, false><<<grid, kThreads>>>(o, dout, lse, dq, dsum, lse2, sh.B, sh.H, sh.S); });
    CK(cudaFree(o)); CK(cudaFree(dout)); CK(cudaFree(lse)); CK(cudaFree(dq)); CK(cudaFree(dsum)); CK(cudaFree(lse2));
  }
  return 0;
}
