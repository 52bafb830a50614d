// The backward preprocess's memory traffic (session 49): does it gain from writing dq_accum's zeros as a stream of
// their own (cudaMemsetAsync or a write-only kernel) beside a read-only preprocess? (Session 54: or from
// FlashAttention-3's tile shape, checked against the package's statistics?) L2 flushed between runs. Times
// the package's kernel (common/bwd_pre_post.cuh) at head dim 128 as the backward launches it, and its read-only half:
// the same kernel with head_dim_rounded = 0, whose zeroing loop then has no column to write.
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda tools/preprocess_bench.cu -o /tmp/pre && /tmp/pre
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "cuda_check.h"
#include "kernels/common/bwd_pre_post.cuh"

using jax_flash::FlashParams;
using jax_flash::cuda::flash_bwd_preprocess_kernel;
using jax_flash::cuda::kPreprocessLanesPerRow;
using jax_flash::cuda::kPreprocessThreads;

constexpr int kD = 128;

// A tile-shaped preprocess (session 54; FlashAttention-3's hopper preprocess has this shape): one block of 256
// threads per (64 query rows, head, batch), 16 threads a row, each thread's four rows 16 apart with all eight 16-byte
// loads of O and dO issued before any is used; lse read and the statistics written by 64 threads, coalesced; the
// tile's 32 KB of dq_accum zeroed as 8 float4 stores a thread. Head dim 128, seqlen a multiple of 64 (the bench's).
__global__ void __launch_bounds__(256, 2) preprocess_tile64(const FlashParams p) {
  constexpr int kRows = 64, kPasses = 4;
  const int t = threadIdx.x, sub = t % 16;
  const int m0 = blockIdx.x * kRows, h = blockIdx.y, b = blockIdx.z;
  const float lse = t < kRows ? p.lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + m0 + t] : 0.f;
  uint4 ov[kPasses], dv[kPasses];
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const int i = m0 + t / 16 + 16 * k;
    const int64_t off = (int64_t(b) * p.seqlen_q + i) * p.q_row_stride() + int64_t(h) * p.head_dim + sub * 8;
    ov[k] = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.o) + off);
    dv[k] = *reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(p.dout) + off);
  }
  float4* accum = reinterpret_cast<float4*>(p.dq_accum_of(b, h) + int64_t(m0) * p.head_dim_rounded);
#pragma unroll
  for (int k = 0; k < 8; ++k) accum[t + 256 * k] = make_float4(0.f, 0.f, 0.f, 0.f);
  float acc[kPasses];
#pragma unroll
  for (int k = 0; k < kPasses; ++k) {
    const uint32_t ow[4] = {ov[k].x, ov[k].y, ov[k].z, ov[k].w}, dw[4] = {dv[k].x, dv[k].y, dv[k].z, dv[k].w};
    acc[k] = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float2 a = jax_flash::cuda::ElemTraits<__nv_bfloat16>::unpack(ow[w]);
      const float2 c = jax_flash::cuda::ElemTraits<__nv_bfloat16>::unpack(dw[w]);
      acc[k] += a.x * c.x + a.y * c.y;
    }
#pragma unroll
    for (int mask = 8; mask > 0; mask /= 2) acc[k] += __shfl_xor_sync(0xffffffff, acc[k], mask);
  }
  if (sub == 0) {
#pragma unroll
    for (int k = 0; k < kPasses; ++k) p.dsum_of(b, h)[m0 + t / 16 + 16 * k] = acc[k];
  }
  if (t < kRows) p.lse_log2_of(b, h)[m0 + t] = lse * 1.4426950408889634f;
}

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
    const unsigned grid = unsigned((rows * kPreprocessLanesPerRow + kPreprocessThreads - 1) / kPreprocessThreads);
    auto preprocess = [&](bool with_zeros) {
      FlashParams q = p;
      if (!with_zeros) q.head_dim_rounded = 0;
      flash_bwd_preprocess_kernel<__nv_bfloat16><<<grid, kPreprocessThreads>>>(q);
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
    auto tile64 = [&] { preprocess_tile64<<<dim3(sh.S / 64, sh.H, sh.B), 256>>>(p); };
    run("tile-shaped (64 rows a block, 4 a thread)", tile64);
    {  // the tile-shaped statistics against the package kernel's
      std::vector<float> want(2 * rows), got(2 * rows);
      preprocess(true);
      CUDA_CHECK(cudaMemcpy(want.data(), stats, 2 * rows * 4, cudaMemcpyDeviceToHost));
      CUDA_CHECK(cudaMemset(stats, 0xff, 2 * rows * 4));
      tile64();
      CUDA_CHECK(cudaMemcpy(got.data(), stats, 2 * rows * 4, cudaMemcpyDeviceToHost));
      double worst = 0;
      for (long k = 0; k < 2 * rows; ++k) worst = std::max(worst, double(std::fabs(want[k] - got[k])));
      std::printf("  tile-shaped statistics vs the package's: max |diff| %.3g\n", worst);
    }
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
