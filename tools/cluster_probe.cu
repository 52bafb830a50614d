// What the decode split kernel's cluster merge (cuda/kernels/decode/cluster_merge.cuh) relies on, asked of the GPU:
//   1. whether CTAs of a thread-block cluster may exit while the others still pass cluster barriers (the cluster
//      barrier then waits for non-exited threads only) and read the shared memory of CTAs that have not exited:
//      half the CTAs of each cluster exit at once, the others run two cluster.sync() with distributed shared memory
//      reads between them; a hang is reported after 5 s (the host polls the stream) instead of waiting forever;
//   2. how many clusters of 2-16 CTAs of 128 threads and the split kernel's shared memory (d128: 103168 bytes, two
//      CTAs an SM) the device places at once (cudaOccupancyMaxActiveClusters; past 8 with the non-portable size
//      allowed), against the SM count.
//   nvcc -std=c++17 -arch=sm_90a -o /tmp/cluster_probe tools/cluster_probe.cu && /tmp/cluster_probe
// (H200, session 57: early exit completes; clusters of 8 place 240 of the 264 two-an-SM slots, of 16 224.)
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "cuda_check.h"

namespace cg = cooperative_groups;

// Odd ranks exit at once; even ranks publish their rank, sync, read every even rank's value, sync again.
__global__ void early_exit_kernel(int* out) {
  extern __shared__ int smem[];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank());
  if (rank % 2 == 1) return;
  if (threadIdx.x == 0) smem[0] = 1000 + rank;
  cluster.sync();
  int sum = 0;
  for (int s = 0; s < int(cluster.num_blocks()); s += 2) sum += *cluster.map_shared_rank(smem, s);
  cluster.sync();
  if (threadIdx.x == 0) out[blockIdx.x] = sum;
}

// The occupancy query's kernel: the split kernel's launch shape, nothing else.
__global__ void shape_kernel(int* out) {
  extern __shared__ int smem[];
  if (out != nullptr && threadIdx.x == 0) out[blockIdx.x] = smem[0];
}

// A launch of `grid` CTAs of 128 threads with `smem` bytes of dynamic shared memory in clusters of `size` along x
// (the attribute lives in *attribute, which the config points to).
cudaLaunchConfig_t cluster_launch(int grid, int smem, int size, cudaLaunchAttribute* attribute) {
  attribute->id = cudaLaunchAttributeClusterDimension;
  attribute->val.clusterDim.x = unsigned(size);
  attribute->val.clusterDim.y = 1;
  attribute->val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(128);
  config.dynamicSmemBytes = smem;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

int main() {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  // 1. early exit
  for (int size : {2, 4, 8}) {
    const int grid = 16 * size;
    int* out = nullptr;
    CUDA_CHECK(cudaMalloc(&out, grid * sizeof(int)));
    CUDA_CHECK(cudaMemset(out, 0, grid * sizeof(int)));
    cudaLaunchAttribute attribute{};
    const cudaLaunchConfig_t config = cluster_launch(grid, 1024, size, &attribute);
    CUDA_CHECK(cudaLaunchKernelEx(&config, early_exit_kernel, out));
    const auto start = std::chrono::steady_clock::now();
    cudaError_t state;
    while ((state = cudaStreamQuery(nullptr)) == cudaErrorNotReady) {
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(5)) {
        std::printf("early exit, clusters of %d: HANG (no completion in 5 s)\n", size);
        std::fflush(stdout);
        std::_Exit(3);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    CUDA_CHECK(state);
    int host[128];
    CUDA_CHECK(cudaMemcpy(host, out, grid * sizeof(int), cudaMemcpyDeviceToHost));
    int expect = 0;
    for (int s = 0; s < size; s += 2) expect += 1000 + s;
    int good = 0;
    for (int i = 0; i < grid; i += 2) good += host[i] == expect;
    std::printf("early exit, clusters of %d: completed, %d of %d waiting CTAs read every even rank (%d)\n", size,
                good, grid / 2, expect);
    CUDA_CHECK(cudaFree(out));
  }

  // 2. placement of clusters at the split kernel's launch shape
  CUDA_CHECK(cudaFuncSetAttribute(shape_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  for (int smem : {103168, 50000}) {
    CUDA_CHECK(cudaFuncSetAttribute(shape_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    int per_sm = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, shape_kernel, 128, smem));
    std::printf("smem %d bytes: %d CTAs an SM; clusters placed at once by size:", smem, per_sm);
    for (int size = 2; size <= 16; ++size) {
      cudaLaunchAttribute attribute{};
      const cudaLaunchConfig_t config = cluster_launch(size * 64, smem, size, &attribute);
      int clusters = 0;
      CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, shape_kernel, &config));
      std::printf(" %d:%d (%d CTAs)", size, clusters, clusters * size);
    }
    std::printf("\n");
  }
  return 0;
}
