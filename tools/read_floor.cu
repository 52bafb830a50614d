// Issue 19's floor: how fast can any kernel stream N bytes from HBM on this GPU, the way bench_decode.py times a call
// (the GPU's span of calls chained back to back, caches that do not fit in L2)? A plain read kernel (16-byte loads
// through the read-only path, 4 or 8 loads a thread in flight, a persistent grid of 1, 2 or 4 blocks an SM) over copies
// of the buffer taken in turn, so that a call never finds its bytes in L2; alone, and followed by a one-block kernel (a
// split kernel's combine launch: the gap a second kernel adds), and that pair with programmatic dependent launch (PDL:
// the read kernel's blocks trigger their dependents as they start, the one-block kernel launched with programmatic
// stream serialisation waits for the read kernel's completion with griddepcontrol.wait). Prints the median time a call
// over 20 chained calls (median of 7) and its share of the HBM peak (H200 4.8 TB/s, H100 3.35 TB/s), with the calls
// launched on a stream and as one CUDA graph (as XLA runs a program's commands).
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Icuda tools/read_floor.cu -o /tmp/rf && /tmp/rf
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "cuda_check.h"

constexpr int kThreads = 512;

template <int kLoads, bool kTrigger>
__global__ void __launch_bounds__(kThreads) read_kernel(const uint4* __restrict__ p, int64_t n, unsigned* out) {
  if constexpr (kTrigger) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  unsigned acc = 0;
  int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  for (; i + (kLoads - 1) * stride < n; i += kLoads * stride) {
    uint4 v[kLoads];
#pragma unroll
    for (int k = 0; k < kLoads; ++k) v[k] = __ldg(p + i + k * stride);
#pragma unroll
    for (int k = 0; k < kLoads; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldg(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u) out[0] = acc;  // never in practice (the buffer is zero); keeps the loads
}

template <bool kWait>
__global__ void tail_kernel(unsigned* out) {
  if constexpr (kWait) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (threadIdx.x == 0 && out[1] == 0x9e3779b9u) out[0] = 1;
}

// One call: the read kernel, then with tail 1 the one-block kernel, with tail 2 that kernel by PDL.
template <int kLoads>
void call(const uint4* p, int64_t n, unsigned* out, int blocks, int tail, cudaStream_t stream) {
  if (tail == 2) {
    read_kernel<kLoads, true><<<blocks, kThreads, 0, stream>>>(p, n, out);
    CUDA_CHECK(cudaGetLastError());
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(1);
    cfg.blockDim = dim3(128);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, tail_kernel<true>, out));
    return;
  }
  read_kernel<kLoads, false><<<blocks, kThreads, 0, stream>>>(p, n, out);
  CUDA_CHECK(cudaGetLastError());
  if (tail == 1) {
    tail_kernel<false><<<1, 128, 0, stream>>>(out);
    CUDA_CHECK(cudaGetLastError());
  }
}

int main() {
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double peak = strstr(prop.name, "H200") ? 4800.0 : 3350.0;  // GB/s
  const int sms = prop.multiProcessorCount;
  const size_t l2 = size_t(prop.l2CacheSize);
  printf("%s, %d SMs, L2 %zu MB, HBM peak taken as %.0f GB/s\n", prop.name, sms, l2 >> 20, peak);
  const size_t pool = size_t(2) << 30;  // copies taken in turn: at least 4x L2 between two reads of one byte
  uint8_t* buf;
  unsigned* out;
  CUDA_CHECK(cudaMalloc(&buf, pool));
  CUDA_CHECK(cudaMemset(buf, 0, pool));
  CUDA_CHECK(cudaMalloc(&out, 64));
  CUDA_CHECK(cudaMemset(out, 0, 64));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  const int kIters = 20, kReps = 7;
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  printf("us a call (%% of the peak): launched on a stream, then as one CUDA graph of the %d calls\n", kIters);
  printf("%6s %6s %6s %5s | %15s | %15s | %15s | %15s | %15s | %15s\n", "MB", "blk/SM", "loads", "copies",
         "stream", "+tail", "+tail PDL", "graph", "graph +tail", "graph +PDL");
  for (size_t mb : {32, 64, 128, 256, 512}) {
    const size_t bytes = mb << 20;
    const int copies = int(std::max<size_t>(1, std::min(pool / bytes, (4 * l2 + bytes - 1) / bytes + 1)));
    for (int bps : {1, 2, 4}) {
      for (int loads : {4, 8}) {
        // The chained calls; tail: their second kernel (0 none, 1 ordinary launch, 2 programmatic dependent launch).
        auto calls = [&](int tail) {
          for (int it = 0; it < kIters; ++it) {
            const uint4* p = reinterpret_cast<const uint4*>(buf + size_t(it % copies) * bytes);
            const int64_t n = int64_t(bytes / 16);
            if (loads == 4) {
              call<4>(p, n, out, sms * bps, tail, stream);
            } else {
              call<8>(p, n, out, sms * bps, tail, stream);
            }
          }
        };
        double best[6];
        for (int mode = 0; mode < 6; ++mode) {
          cudaGraphExec_t exec = nullptr;
          if (mode >= 3) {
            cudaGraph_t graph;
            CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
            calls(mode % 3);
            CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
            CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
            CUDA_CHECK(cudaGraphDestroy(graph));
            CUDA_CHECK(cudaGraphLaunch(exec, stream));  // warm
          }
          std::vector<float> med;
          for (int r = 0; r < kReps; ++r) {
            CUDA_CHECK(cudaEventRecord(e0, stream));
            if (exec) {
              CUDA_CHECK(cudaGraphLaunch(exec, stream));
            } else {
              calls(mode % 3);
            }
            CUDA_CHECK(cudaEventRecord(e1, stream));
            CUDA_CHECK(cudaEventSynchronize(e1));
            float ms;
            CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
            med.push_back(ms * 1000.f / kIters);
          }
          if (exec) CUDA_CHECK(cudaGraphExecDestroy(exec));
          std::sort(med.begin(), med.end());
          best[mode] = med[med.size() / 2];
        }
        printf("%6zu %6d %6d %5d", mb, bps, loads, copies);
        for (double us : best) printf(" | %7.1f (%3.0f%%)", us, 100.0 * bytes / (us * 1e3) / peak);
        printf("\n");
      }
    }
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  CUDA_CHECK(cudaFree(buf));
  CUDA_CHECK(cudaFree(out));
  return 0;
}
