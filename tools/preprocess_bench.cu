// The backward preprocess's memory traffic (session 49): does it gain from writing dq_accum's zeros as a stream of
// their own (cudaMemsetAsync or a write-only kernel) beside a read-only preprocess? L2 flushed between runs. Times
// the package's kernel (common/bwd_pre_post.cuh) at head dim 128 as the backward launches it, and its read-only half:
// the same kernel with head_dim_rounded = 0, whose zeroing loop then has no column to write.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda tools/preprocess_bench.cu -o /tmp/pre && /tmp/pre
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_check.h"
#include "kernels/common/bwd_pre_post.cuh"

using jax_flash::FlashParams;
using jax_flash::cuda::flash_bwd_preprocess_kernel;
using jax_flash::cuda::kPreprocessRows;
using jax_flash::cuda::kPreprocessThreads;

constexpr int kD = 128;

// x[i] = a small value that depends on i (bfloat16): inputs whose statistics differ per row.
__global__ void pattern_kernel(__nv_bfloat16* x, long n, unsigned salt) {
  for (long i = long(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += long(gridDim.x) * blockDim.x) {
    const unsigned hsh = (unsigned(i) ^ salt) * 2654435761u;
    x[i] = __float2bfloat16(float(int(hsh >> 24) - 128) / 128.f);
  }
}

// Writes v to n float4s, grid-stride: dq_accum's zeros alone (v = 0), and the flush that evicts the L2 between runs.
__global__ void fill_kernel(float4* p, long n, float v) {
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
    float *lse, *dq, *stats;
    CUDA_CHECK(cudaMalloc(&o, elems * 2));
    CUDA_CHECK(cudaMalloc(&dout, elems * 2));
    CUDA_CHECK(cudaMalloc(&lse, rows * 4));
    CUDA_CHECK(cudaMalloc(&dq, elems * 4));
    CUDA_CHECK(cudaMalloc(&stats, 2 * rows * 4));
    pattern_kernel<<<sms * 8, 256>>>(o, elems, 1u);
    pattern_kernel<<<sms * 8, 256>>>(dout, elems, 2u);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaMemset(lse, 0, rows * 4));
    FlashParams p{};  // the fields the preprocess reads; S is a multiple of every backward's query tile
    p.o = o;
    p.dout = dout;
    p.lse = lse;
    p.row_stats = stats;
    p.dq_accum = dq;
    p.batch = sh.B;
    p.seqlen_q = p.seqlen_q_rounded = sh.S;
    p.heads_q = sh.H;
    p.head_dim = p.head_dim_rounded = kD;
    const unsigned grid = unsigned(rows / kPreprocessRows);
    auto preprocess = [&](bool with_zeros) {
      FlashParams q = p;
      if (!with_zeros) q.head_dim_rounded = 0;
      flash_bwd_preprocess_kernel<__nv_bfloat16, 1><<<grid, kPreprocessThreads>>>(q);
    };
    auto memset = [&] { CUDA_CHECK(cudaMemsetAsync(dq, 0, elems * 4)); };
    auto zero = [&] { fill_kernel<<<sms * 8, 256>>>(reinterpret_cast<float4*>(dq), elems / 4, 0.f); };
    // Median and minimum of 12 timed runs (after 3 untimed), each after the flush.
    auto run = [&](const char* name, auto f) {
      std::vector<float> t;
      for (int it = 0; it < 15; ++it) {
        fill_kernel<<<sms * 4, 512>>>(flush, flush_bytes / 16, float(it));
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
    run("preprocess (reads + zeroes, as main)", [&] { preprocess(true); });
    run("preprocess reads only", [&] { preprocess(false); });
    run("cudaMemsetAsync(dq_accum)", memset);
    run("zero kernel (float4, grid-stride)", zero);
    run("memset + reads only", [&] { memset(); preprocess(false); });
    run("reads only + memset", [&] { preprocess(false); memset(); });
    run("zero kernel + reads only", [&] { zero(); preprocess(false); });
    for (void* ptr : {static_cast<void*>(o), static_cast<void*>(dout), static_cast<void*>(lse),
                      static_cast<void*>(dq), static_cast<void*>(stats)}) {
      CUDA_CHECK(cudaFree(ptr));
    }
  }
  CUDA_CHECK(cudaFree(flush));
  return 0;
}
