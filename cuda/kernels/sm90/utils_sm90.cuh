// PTX wrappers for the sm_90a kernels: mbarriers, TMA (cp.async.bulk.tensor), wgmma fences, register
// reallocation (setmaxnreg) and named barriers; and a visitor over a wgmma accumulator fragment. Device code only.
// The helpers emit sm_90a instructions, so kernel bodies that call them are guarded by JAX_FLASH_SM90A (defined
// only when compiling for the sm_90a target) and trap otherwise. Address arithmetic of the shared-memory layouts
// (swizzle, stmatrix lanes, wgmma descriptors) is in smem_layout.h.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/common/shared_memory.cuh"
#include "kernels/sm90/smem_layout.h"

namespace jax_flash::cuda::sm90 {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAX_FLASH_SM90A 1
#endif

inline constexpr int kWarpRows = 16;          // accumulator rows of one warp in a 64-row wgmma

// The kernel's dynamic shared memory as a Storage struct, its start rounded up to 1024 bytes (the 128-byte swizzle
// repeats every 1024 bytes); launchers ask for sizeof(Storage) + 1024.
template <typename Storage>
__device__ __forceinline__ Storage& shared_storage() {
  extern __shared__ unsigned char smem_raw[];
  return *reinterpret_cast<Storage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
}
// ---- mbarriers ------------------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}

// Makes barrier initialisation visible to the async proxy (TMA) before any thread uses the barrier.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Arrives and tells the barrier to also wait for `bytes` of TMA transactions.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

// One arrival on the barrier once every cp.async this thread issued before has landed (the barrier's expected
// arrivals count it: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Blocks until the barrier's phase with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA ------------------------------------------------------------------------------------------------------
// Loads the box at coordinates (c0, c1, c2, c3) of a 4-d tensor map into shared memory; completion is counted on
// `bar` in bytes. Out-of-bounds elements are zero-filled.
__device__ __forceinline__ void tma_load_4d(void* smem, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_addr(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

// The same with an L2 cache policy for the lines it reads (l2_policy.cuh).
__device__ __forceinline__ void tma_load_4d(void* smem, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%3, "
      "%4, %5, %6}], [%2], %7;\n" ::"r"(smem_addr(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "l"(policy)
      : "memory");
}

// The same for a 5-d tensor map (c0 the innermost coordinate; the TMA decode kernel's query boxes).
__device__ __forceinline__ void tma_load_5d(void* smem, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2,
                                            int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6, "
      "%7}], [%2];\n" ::"r"(smem_addr(smem)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4)
      : "memory");
}

// Copies `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory; completion is
// counted on `bar` in bytes.
__device__ __forceinline__ void bulk_load_1d(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(smem)),
      "l"(reinterpret_cast<uint64_t>(gmem)), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// Adds (float32) `bytes` (a multiple of 16; both addresses 16-byte aligned) of shared memory into global memory;
// each element's add is atomic. Tracked by this thread's bulk async-group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, const float* smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                   reinterpret_cast<uint64_t>(gmem)),
               "r"(smem_addr(smem)), "r"(bytes)
               : "memory");
}

// Stores the shared-memory tile `smem` into the box at (c0, c1, c2, c3) of a 4-d tensor map; elements outside the
// tensor are skipped. Tracked by this thread's bulk async-group.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* smem, int c0, int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(smem)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// Adds a shared-memory box into the tensor's elements (in their type: bf16 / f16 adds round once each).
__device__ __forceinline__ void tma_reduce_add_4d(const CUtensorMap* map, const void* smem, int c0, int c1, int c2,
                                                  int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
          reinterpret_cast<uint64_t>(map)),
      "r"(smem_addr(smem)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void bulk_commit_group() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until at most kPending of this thread's bulk groups still read their shared-memory source.
template <int kPending>
__device__ __forceinline__ void bulk_wait_group_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
}
// Waits until at most kPending of this thread's bulk groups are incomplete (their global writes done).
template <int kPending>
__device__ __forceinline__ void bulk_wait_group() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// Orders this thread's completed async-proxy global writes (bulk reductions) before its later generic accesses.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// ---- inter-CTA ordering (deterministic reductions) ------------------------------------------------------------
__device__ __forceinline__ int ld_acquire_gpu(const int32_t* addr) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_gpu_add(int32_t* addr, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Orders this thread's ordinary shared-memory writes before later async-proxy (TMA, wgmma) reads.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Stores four 8x8 16-bit matrices; register i holds matrix i in the mma accumulator layout (lane l: row l / 4,
// columns 2 (l % 4), +1), and lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3)
               : "memory");
}
// Transposed: matrix i's rows in memory are its columns (smem_layout.h, stmatrix_x4_trans_lane_offset).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void stmatrix_x2_trans(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(addr), "r"(r0), "r"(r1)
               : "memory");
}

// A warp's piece of a wgmma accumulator (16 rows, kTiles 8-column tiles; lane = 4 g + t holds rows g and g + 8) as
// 16-bit values (ET::pack) into 128-byte-swizzled TMA boxes of 64 columns, box_bytes apart, with stmatrix:
// value(x, r) is what accumulator element x of row g + 8 r stores. lane_addr: the boxes' 1024-byte-aligned base
// plus the warp's stmatrix_x4_lane_offset. The forward's O and the backward's dK/dV epilogues.
template <typename ET, int kTiles, typename Value>
__device__ __forceinline__ void stmatrix_acc_to_boxes(uint32_t lane_addr, uint32_t box_bytes, const float* acc,
                                                      Value&& value) {
  constexpr int kPairsPerBox = kSwizzleBytes / (16 * 2);  // pairs of 8-column tiles in a 128-byte row
#pragma unroll
  for (int j2 = 0; j2 < kTiles / 2; ++j2) {
    const uint32_t addr = stmatrix_x4_pair_offset(lane_addr, j2 % kPairsPerBox) + (j2 / kPairsPerBox) * box_bytes;
    const float* a8 = acc + 8 * j2;  // column tiles 2 j2, 2 j2 + 1 of rows g, g + 8
    stmatrix_x4(addr, ET::pack(value(a8[0], 0), value(a8[1], 0)), ET::pack(value(a8[2], 1), value(a8[3], 1)),
                ET::pack(value(a8[4], 0), value(a8[5], 0)), ET::pack(value(a8[6], 1), value(a8[7], 1)));
  }
}

// ---- wgmma ----------------------------------------------------------------------------------------------------
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// wgmma_wait<kPending> that the assembler cannot schedule before `after` is computed. A first wait predicated on
// `after < floor` never runs for floor = -inf (the caller passes -inf as a value the assembler cannot fold, e.g. from
// a kernel parameter) but depends on `after`, and the real wait cannot pass it, so the work `after` depends on stays
// ahead of the wait. (ptxas otherwise hoists a wait to just after the previous one when the instructions between
// only touch registers, and that work then runs after the wgmma it was meant to overlap. No path skips the wait,
// as ptxas's wgmma pipeline analysis needs: a branch around it serialised every wgmma of the kernels that read O
// after it.)
template <int kPending>
__device__ __forceinline__ void wgmma_wait_after(float after, float floor) {
  asm volatile(
      "{\n"
      ".reg .pred below;\n"
      "setp.lt.f32 below, %0, %1;\n"
      "@below wgmma.wait_group.sync.aligned %2;\n"
      "wgmma.wait_group.sync.aligned %2;\n"
      "}\n" ::"f"(after),
      "f"(floor), "n"(kPending)
      : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across a wgmma wait (the registers are written
// asynchronously).
// Also keeps registers that an in-flight wgmma reads (A fragments) alive, and unchanged, until after the wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
template <int M, int N>
__device__ __forceinline__ void fence_regs(uint32_t (&a)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i) {
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(a[i][j])::"memory");
  }
}

// ---- warp-specialisation helpers ------------------------------------------------------------------------------
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Lane 0's value: the compiler then treats it as warp-uniform and keeps what derives from it (warpgroup index,
// descriptors) in uniform registers.
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffff, v, 0); }

// Barrier among `threads` threads (a multiple of 32) on hardware barrier `id` (0 is __syncthreads').
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Visits this thread's part of an m64nN wgmma accumulator: rows g and g + 8 (r = 0, 1) of its warp's 16 from row0,
// columns col0 + 8 j + 2 t and +1 (accumulator entries i = 4 j + 2 r and i + 1), those below `rows` and `cols`:
// f(row, col, i, r).
template <int kTiles, typename F>
__device__ __forceinline__ void for_each_acc_pair(int row0, int rows, int col0, int cols, int g, int t, F&& f) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + g + 8 * r;
    if (row < rows) {
#pragma unroll
      for (int j = 0; j < kTiles; ++j) {
        const int col = col0 + j * 8 + 2 * t;
        if (col < cols) f(row, col, 4 * j + 2 * r, r);
      }
    }
  }
}

}  // namespace jax_flash::cuda::sm90
