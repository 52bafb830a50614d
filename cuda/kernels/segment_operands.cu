// The segment operands (segment_operands.h) on the GPU: two small kernels, a block per batch element for the runs
// and a thread per 16-position chunk for the metadata. Same results as cpu::SegmentOperands.
#include "kernels/segment_operands_launch.h"

#include <climits>

#include "kernels/common/launch_utils.h"
#include "mask.h"  // kSegmentChunk

namespace jax_flash::cuda {
namespace {

constexpr int kRunsThreads = 1024;
constexpr int kMetaThreads = 256;
constexpr int kMetaTile = 1024;  // the other side's chunk ranges a meta block holds at a time

struct Sum {
  __device__ int operator()(int a, int b) const { return a + b; }
};
struct Max {
  __device__ int operator()(int a, int b) const { return a > b ? a : b; }
};

// Exclusive scan of one value per thread over the block (blockDim.x a multiple of 32); *total: op over all.
template <typename Op>
__device__ int block_exclusive_scan(int v, int identity, Op op, int* total) {
  __shared__ int warp_totals[32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  int incl = v;
  for (int d = 1; d < 32; d *= 2) {
    const int t = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl = op(incl, t);
  }
  if (lane == 31) warp_totals[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < warps ? warp_totals[lane] : identity;
    for (int d = 1; d < 32; d *= 2) {
      const int t = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w = op(w, t);
    }
    warp_totals[lane] = w;  // inclusive over the warps
  }
  __syncthreads();
  int excl = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) excl = identity;
  const int result = op(warp > 0 ? warp_totals[warp - 1] : identity, excl);
  *total = warp_totals[warps - 1];
  __syncthreads();  // warp_totals is reused by the next scan
  return result;
}

// One side's runs of equal ids in shared memory: id and start per run, start[count] = n; lo/hi: the other side's
// interval of each run's id.
struct SideRuns {
  int32_t* id;  // [kMaxSegmentRuns]
  int32_t* start;  // [kMaxSegmentRuns + 1]
  int32_t* lo;  // [kMaxSegmentRuns]
  int32_t* hi;  // [kMaxSegmentRuns]
  int count;
  // This thread's slice of positions [p0, p1) and the runs that start before p0.
  int p0, p1, runs_before;
};

__device__ bool starts_run(const int32_t* ids, int i) { return i == 0 || ids[i] != ids[i - 1]; }

// Splits ids [n] into runs (side->count > kMaxSegmentRuns: too many, nothing stored).
__device__ void find_runs(const int32_t* ids, int n, SideRuns* side) {
  const int per = (n + blockDim.x - 1) / blockDim.x;
  side->p0 = min(int(threadIdx.x) * per, n);
  side->p1 = min(side->p0 + per, n);
  int mine = 0;
  for (int i = side->p0; i < side->p1; ++i) mine += starts_run(ids, i);
  side->runs_before = block_exclusive_scan(mine, 0, Sum{}, &side->count);
  if (side->count > kMaxSegmentRuns) return;
  int r = side->runs_before;
  for (int i = side->p0; i < side->p1; ++i) {
    if (starts_run(ids, i)) {
      side->id[r] = ids[i];
      side->start[r] = i;
      ++r;
    }
  }
  if (threadIdx.x == 0) side->start[side->count] = n;
}

// mine's lo/hi from the runs of `other` (both found), then the empty intervals of ids other lacks (the running max of
// the ends before them). Returns whether they are exact (block-uniform): every id of mine in at most one run of
// other, both bounds never decreasing.
__device__ bool match_runs(SideRuns* mine, const SideRuns& other) {
  bool ok = true;
  // Runs r of mine in this thread: [r0, r1), consecutive, so that the running max is a scan over threads.
  const int per = (mine->count + blockDim.x - 1) / blockDim.x;
  const int r0 = min(int(threadIdx.x) * per, mine->count), r1 = min(r0 + per, mine->count);
  int end = 0;  // the largest end of this thread's found runs
  for (int r = r0; r < r1; ++r) {
    const int32_t x = mine->id[r];
    int found = -1, matches = 0;
    for (int j = 0; j < other.count; ++j) {  // the same j across the warp: shared-memory broadcasts
      if (other.id[j] == x) {
        found = j;
        ++matches;
      }
    }
    ok &= matches <= 1;
    mine->lo[r] = found >= 0 ? other.start[found] : -1;  // -1: not found (filled below)
    mine->hi[r] = found >= 0 ? other.start[found + 1] : 0;
    end = max(end, mine->hi[r]);
  }
  int unused;
  int running = block_exclusive_scan(end, 0, Max{}, &unused);  // ends of the runs before r0
  for (int r = r0; r < r1; ++r) {
    if (mine->lo[r] < 0) {
      mine->lo[r] = mine->hi[r] = running;
    } else {
      running = max(running, mine->hi[r]);
    }
  }
  __syncthreads();
  for (int r = max(r0, 1); r < r1; ++r) {  // (run r - 1 may be another thread's: after the barrier)
    ok &= mine->lo[r] >= mine->lo[r - 1] && mine->hi[r] >= mine->hi[r - 1];
  }
  return __syncthreads_and(ok);
}

// Writes [lo, hi) of each position's run (or -1 everywhere when the batch element is not exact).
__device__ void write_runs(const int32_t* ids, const SideRuns& side, bool exact, int32_t* out) {
  int r = side.runs_before - 1;
  for (int i = side.p0; i < side.p1; ++i) {
    int2 v = make_int2(-1, -1);
    if (exact) {
      r += starts_run(ids, i);
      v = make_int2(side.lo[r], side.hi[r]);
    }
    reinterpret_cast<int2*>(out)[i] = v;
  }
}

__global__ void __launch_bounds__(kRunsThreads) segment_runs_kernel(SegmentOperandsParams p) {
  extern __shared__ int32_t smem[];
  constexpr int kSide = 4 * kMaxSegmentRuns + 1;
  SideRuns q_side{smem, smem + kMaxSegmentRuns, smem + 2 * kMaxSegmentRuns + 1, smem + 3 * kMaxSegmentRuns + 1};
  SideRuns kv_side{smem + kSide, smem + kSide + kMaxSegmentRuns, smem + kSide + 2 * kMaxSegmentRuns + 1,
                   smem + kSide + 3 * kMaxSegmentRuns + 1};
  for (int64_t b = blockIdx.x; b < p.batch; b += gridDim.x) {
    const int32_t* q = p.q_ids + b * p.seqlen_q;
    const int32_t* kv = p.kv_ids + b * p.seqlen_k;
    find_runs(q, p.seqlen_q, &q_side);
    find_runs(kv, p.seqlen_k, &kv_side);
    bool exact = q_side.count <= kMaxSegmentRuns && kv_side.count <= kMaxSegmentRuns;  // block-uniform
    __syncthreads();  // the runs are stored
    if (exact) {
      const bool q_ok = match_runs(&q_side, kv_side);
      const bool kv_ok = match_runs(&kv_side, q_side);
      exact = q_ok && kv_ok;
    }
    write_runs(q, q_side, exact, p.q_runs + b * p.seqlen_q * 2);
    write_runs(kv, kv_side, exact, p.kv_runs + b * p.seqlen_k * 2);
    __syncthreads();  // shared memory is reused by the next batch element
  }
}

// The id range of chunk c of ids [n] ({INT_MAX, INT_MIN} past the end).
__device__ int2 chunk_range(const int32_t* ids, int n, int c) {
  int2 r = make_int2(INT_MAX, INT_MIN);
  const int i1 = min((c + 1) * kSegmentChunk, n);
  for (int i = c * kSegmentChunk; i < i1; ++i) {
    r.x = min(r.x, ids[i]);
    r.y = max(r.y, ids[i]);
  }
  return r;
}

// blockIdx.z = 0: the query chunks' metadata against the keys; 1: the key chunks' against the rows.
__global__ void __launch_bounds__(kMetaThreads) segment_meta_kernel(SegmentOperandsParams p) {
  __shared__ int2 other_ranges[kMetaTile];
  const bool keys = blockIdx.z == 1;
  const int mine_len = keys ? p.seqlen_k : p.seqlen_q, other_len = keys ? p.seqlen_q : p.seqlen_k;
  const int mine_chunks = (mine_len + kSegmentChunk - 1) / kSegmentChunk;
  const int other_chunks = (other_len + kSegmentChunk - 1) / kSegmentChunk;
  const int c = blockIdx.x * kMetaThreads + threadIdx.x;
  if (blockIdx.x * kMetaThreads >= mine_chunks) return;  // (block-uniform)
  for (int64_t b = blockIdx.y; b < p.batch; b += gridDim.y) {
    const int32_t* mine = (keys ? p.kv_ids : p.q_ids) + b * mine_len;
    const int32_t* other = (keys ? p.q_ids : p.kv_ids) + b * other_len;
    const int2 range = c < mine_chunks ? chunk_range(mine, mine_len, c) : make_int2(INT_MAX, INT_MIN);
    int first = -1, last = -1;
    for (int base = 0; base < other_chunks; base += kMetaTile) {
      const int tile = min(kMetaTile, other_chunks - base);
      for (int t = threadIdx.x; t < tile; t += kMetaThreads) other_ranges[t] = chunk_range(other, other_len, base + t);
      __syncthreads();
      for (int t = 0; t < tile; ++t) {
        const int2 o = other_ranges[t];
        if (range.x <= o.y && o.x <= range.y) {
          if (first < 0) first = base + t;
          last = base + t;
        }
      }
      __syncthreads();
    }
    if (c < mine_chunks) {
      int4 row;
      row.x = range.x;
      row.y = range.y;
      row.z = last >= 0 ? first * kSegmentChunk : INT_MAX;
      row.w = last >= 0 ? min((last + 1) * kSegmentChunk, other_len) : 0;
      reinterpret_cast<int4*>((keys ? p.kv_meta : p.q_meta) + b * int64_t(mine_chunks) * 4)[c] = row;
    }
  }
}

}  // namespace

cudaError_t RunSegmentOperands(const SegmentOperandsParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  constexpr int kRunsSmem = 2 * (4 * kMaxSegmentRuns + 1) * int(sizeof(int32_t));
  if (cudaError_t e = ensure_smem_limit<segment_runs_kernel>(kRunsSmem); e != cudaSuccess) return e;
  const int batch_blocks = int(p.batch < 65535 ? p.batch : 65535);
  segment_runs_kernel<<<batch_blocks, kRunsThreads, kRunsSmem, stream>>>(p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const int chunks = ceil_div(p.seqlen_q > p.seqlen_k ? p.seqlen_q : p.seqlen_k, kSegmentChunk);
  if (chunks == 0) return cudaSuccess;
  segment_meta_kernel<<<dim3(ceil_div(chunks, kMetaThreads), batch_blocks, 2), kMetaThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda
