// The segment operands (segment_operands.h) on the GPU: two small kernels, blocks of (batch element, side, part of
// that side's positions) for the runs and the chunks' id ranges, then a lane per 16-position chunk for the
// metadata's hulls. Same results as cpu::SegmentOperands.
#include "kernels/segment_operands_launch.h"

#include <algorithm>
#include <climits>

#include "kernels/common/launch_utils.h"
#include "mask.h"  // kSegmentChunk

namespace jax_flash::cuda {
namespace {

constexpr int kRunsThreads = 1024;
constexpr int kRunsPerThread = 8;  // consecutive positions per thread and tile
constexpr int kRunsTile = kRunsThreads * kRunsPerThread;  // positions staged in shared memory at a time
constexpr int kLanesPerChunk = kSegmentChunk / kRunsPerThread;  // a chunk's id range is reduced over these lanes
static_assert(kSegmentChunk % kRunsPerThread == 0 && (kLanesPerChunk & (kLanesPerChunk - 1)) == 0,
              "a chunk is a power-of-two number of lanes' positions");
// Every block of the runs kernel finds both sides' runs (it needs them all to match them) and writes one part of
// one side's results: up to kMaxRunsParts parts per side of at least kRunsPartMin positions, as many as give the
// GPU about one block per resident slot. A block per batch element alone (4 blocks at batch 4) ran its chain of
// tile loads, scans and 16384 result writes in ~19 us at 4 x 8192 on an H200 (NOTES, session 39).
constexpr int kMaxRunsParts = 8;
constexpr int kRunsPartMin = 1024;
constexpr int kMetaThreads = 256;  // 8 warps: 32 own chunks (a lane each), the other side's chunks split over warps
constexpr int kMetaWarps = kMetaThreads / 32;
constexpr int kMetaTile = 2048;  // the other side's chunk ranges a meta block stages at a time

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
// interval of each run's id. increasing: the runs' ids strictly increase (lookups by binary search).
struct SideRuns {
  int32_t* id;  // [kMaxSegmentRuns]
  int32_t* start;  // [kMaxSegmentRuns + 1]
  int32_t* lo;  // [kMaxSegmentRuns]
  int32_t* hi;  // [kMaxSegmentRuns]
  int count;
  bool increasing;
};

// Splits ids [n] into runs (side->count > kMaxSegmentRuns: too many, none stored), staging kRunsTile ids at a time
// in `tile` (coalesced loads, all of a thread's in flight at once); on the way writes the id range of each 16-position
// chunk that starts in [meta_begin, meta_end) into meta[4 c], meta[4 c + 1] (none when meta is null).
__device__ void find_runs(const int32_t* ids, int n, int32_t* tile, int32_t* meta, int meta_begin, int meta_end,
                          SideRuns* side) {
  int count = 0;  // runs before this tile (block-uniform)
  for (int base = 0; base < n; base += kRunsTile) {
    const int len = min(kRunsTile, n - base);
    int32_t staged[kRunsPerThread];
#pragma unroll
    for (int k = 0; k < kRunsPerThread; ++k) {
      const int i = int(threadIdx.x) + k * kRunsThreads;
      staged[k] = i < len ? ids[base + i] : 0;
    }
#pragma unroll
    for (int k = 0; k < kRunsPerThread; ++k) {
      const int i = int(threadIdx.x) + k * kRunsThreads;
      if (i < len) tile[i] = staged[k];
    }
    __syncthreads();
    const int i0 = threadIdx.x * kRunsPerThread;
    int32_t prev = i0 > 0 && i0 <= len ? tile[i0 - 1] : base > 0 ? ids[base - 1] : 0;
    int lo = INT_MAX, hi = INT_MIN, mine = 0;
    bool starts[kRunsPerThread];
#pragma unroll
    for (int k = 0; k < kRunsPerThread; ++k) {
      const int i = i0 + k;
      starts[k] = false;
      if (i < len) {
        const int32_t x = tile[i];
        starts[k] = base + i == 0 || x != prev;
        mine += starts[k];
        lo = min(lo, x);
        hi = max(hi, x);
        prev = x;
      }
    }
#pragma unroll
    for (int d = 1; d < kLanesPerChunk; d *= 2) {
      lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, d));
      hi = max(hi, __shfl_xor_sync(0xffffffffu, hi, d));
    }
    const int pos = base + i0;  // a chunk's first lane holds its first position
    if (meta != nullptr && threadIdx.x % kLanesPerChunk == 0 && i0 < len && pos >= meta_begin && pos < meta_end) {
      reinterpret_cast<int2*>(meta)[2 * (pos / kSegmentChunk)] = make_int2(lo, hi);
    }
    int total;
    int r = count + block_exclusive_scan(mine, 0, Sum{}, &total);
    if (count + total <= kMaxSegmentRuns) {
#pragma unroll
      for (int k = 0; k < kRunsPerThread; ++k) {
        if (starts[k]) {
          side->id[r] = tile[i0 + k];
          side->start[r] = base + i0 + k;
          ++r;
        }
      }
    }
    count += total;
    __syncthreads();  // the tile is reloaded
  }
  side->count = count;
  if (count > kMaxSegmentRuns) return;
  if (threadIdx.x == 0) side->start[count] = n;
  bool up = true;
  for (int r = threadIdx.x + 1; r < count; r += blockDim.x) up &= side->id[r] > side->id[r - 1];
  side->increasing = __syncthreads_and(up);  // (also: the runs are stored)
}

// The run of `other` holding id x: its index, or -1 when none does, or -2 when several do.
__device__ int lookup(const SideRuns& other, int32_t x) {
  if (other.increasing) {  // binary search: each id in one run
    int a = 0, b = other.count;
    while (a < b) {
      const int m = (a + b) / 2;
      if (other.id[m] < x) a = m + 1;
      else b = m;
    }
    return a < other.count && other.id[a] == x ? a : -1;
  }
  int found = -1;
  for (int j = 0; j < other.count; ++j) {  // the same j across the warp: shared-memory broadcasts
    if (other.id[j] == x) found = found == -1 ? j : -2;
  }
  return found;
}

// mine's lo/hi from the runs of `other`, then the empty intervals of ids other lacks (the running max of the ends
// before them). Returns whether they are exact (block-uniform): every id of mine in at most one run of other, both
// bounds never decreasing.
__device__ bool match_runs(SideRuns* mine, const SideRuns& other) {
  bool ok = true;
  // Runs r of mine in this thread: [r0, r1), consecutive, so that the running max is a scan over threads.
  const int per = (mine->count + blockDim.x - 1) / blockDim.x;
  const int r0 = min(int(threadIdx.x) * per, mine->count), r1 = min(r0 + per, mine->count);
  int end = 0;  // the largest end of this thread's found runs
  for (int r = r0; r < r1; ++r) {
    const int j = lookup(other, mine->id[r]);
    ok &= j != -2;
    mine->lo[r] = j >= 0 ? other.start[j] : -1;  // -1: not found (filled below)
    mine->hi[r] = j >= 0 ? other.start[j + 1] : 0;
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

// Writes [lo, hi) of the run of each position in [begin, end) (or -1 there when the batch element is not exact),
// coalesced: the run of position i by binary search over the runs' starts.
__device__ void write_runs(int begin, int end, const SideRuns& side, bool exact, int32_t* out) {
  for (int i = begin + int(threadIdx.x); i < end; i += blockDim.x) {
    int2 v = make_int2(-1, -1);
    if (exact) {
      int a = 0, b = side.count;  // the last run starting at or before i: start[a] <= i < start[a + 1]
      while (b - a > 1) {
        const int m = (a + b) / 2;
        if (side.start[m] <= i) a = m;
        else b = m;
      }
      v = make_int2(side.lo[a], side.hi[a]);
    }
    reinterpret_cast<int2*>(out)[i] = v;
  }
}

// Block (x, y): batch elements x, x + gridDim.x, ...; side y % 2 (0: the queries, 1: the keys), part y / 2 of its
// positions (whole chunks; `parts` parts per side). Each finds both sides' runs and matches them, then writes its
// part's runs and its chunks' id ranges (the metadata's first half).
__global__ void __launch_bounds__(kRunsThreads) segment_runs_kernel(SegmentOperandsParams p, int parts) {
  extern __shared__ int32_t smem[];
  constexpr int kSide = 4 * kMaxSegmentRuns + 1;
  const bool keys = blockIdx.y % 2 == 1;
  // This block's side (`mine`: its part's runs and chunk ranges are written) and the other, each in its half of the
  // runs' shared memory.
  auto side_at = [&](int32_t* base) {
    return SideRuns{base, base + kMaxSegmentRuns, base + 2 * kMaxSegmentRuns + 1, base + 3 * kMaxSegmentRuns + 1};
  };
  SideRuns mine = side_at(smem + (keys ? kSide : 0));
  SideRuns other = side_at(smem + (keys ? 0 : kSide));
  int32_t* tile = smem + 2 * kSide;
  const int n = keys ? p.seqlen_k : p.seqlen_q;
  const int other_n = keys ? p.seqlen_q : p.seqlen_k;
  const int chunks_per_part = ((n + parts - 1) / parts + kSegmentChunk - 1) / kSegmentChunk;
  const int span = chunks_per_part * kSegmentChunk;
  const int begin = min(int(blockIdx.y / 2) * span, n), end = min(begin + span, n);
  if (begin == end) return;  // (block-uniform)
  const int64_t chunks = (n + kSegmentChunk - 1) / kSegmentChunk;
  // Both sides one array (the key ids default to the query ids, and XLA passes one buffer for both operands): the
  // other side's runs are this side's, found once, and each run matches itself.
  const bool one_array = p.q_ids == p.kv_ids && p.seqlen_q == p.seqlen_k;
  for (int64_t b = blockIdx.x; b < p.batch; b += gridDim.x) {
    find_runs((keys ? p.kv_ids : p.q_ids) + b * n, n, tile, (keys ? p.kv_meta : p.q_meta) + b * chunks * 4, begin,
              end, &mine);
    if (!one_array) find_runs((keys ? p.q_ids : p.kv_ids) + b * other_n, other_n, tile, nullptr, 0, 0, &other);
    const SideRuns& theirs = one_array ? mine : other;
    bool exact = mine.count <= kMaxSegmentRuns && theirs.count <= kMaxSegmentRuns;  // block-uniform
    if (exact) {  // both sides' intervals exact (every block of the batch element decides alike)
      const bool mine_ok = match_runs(&mine, theirs);
      const bool other_ok = one_array || match_runs(&other, mine);
      exact = mine_ok && other_ok;
    }
    write_runs(begin, end, mine, exact, (keys ? p.kv_runs : p.q_runs) + b * n * 2);
    __syncthreads();  // shared memory is reused by the next batch element
  }
}

// The metadata's second half, from the chunk ranges segment_runs_kernel wrote: blockIdx.z = 0, the query chunks'
// key hulls; 1, the key chunks' row hulls. A block takes 32 own chunks (a lane each); its warps split the other
// side's chunks, staged kMetaTile at a time, and pool their first / last meeting chunk at the end.
__global__ void __launch_bounds__(kMetaThreads) segment_meta_kernel(SegmentOperandsParams p) {
  __shared__ int2 other_ranges[kMetaTile];
  __shared__ int2 pooled[kMetaWarps][32];
  const bool keys = blockIdx.z == 1;
  const int mine_len = keys ? p.seqlen_k : p.seqlen_q, other_len = keys ? p.seqlen_q : p.seqlen_k;
  const int mine_chunks = (mine_len + kSegmentChunk - 1) / kSegmentChunk;
  const int other_chunks = (other_len + kSegmentChunk - 1) / kSegmentChunk;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int c = blockIdx.x * 32 + lane;
  if (blockIdx.x * 32 >= mine_chunks) return;  // (block-uniform)
  for (int64_t b = blockIdx.y; b < p.batch; b += gridDim.y) {
    int32_t* mine = (keys ? p.kv_meta : p.q_meta) + b * int64_t(mine_chunks) * 4;
    const int32_t* other = (keys ? p.q_meta : p.kv_meta) + b * int64_t(other_chunks) * 4;
    const int2 range = c < mine_chunks ? reinterpret_cast<const int2*>(mine)[2 * c] : make_int2(INT_MAX, INT_MIN);
    int first = INT_MAX, last = -1;
    for (int base = 0; base < other_chunks; base += kMetaTile) {
      const int tile = min(kMetaTile, other_chunks - base);
      for (int t = threadIdx.x; t < tile; t += kMetaThreads) {
        other_ranges[t] = reinterpret_cast<const int2*>(other)[2 * (base + t)];
      }
      __syncthreads();
      const int per = (tile + kMetaWarps - 1) / kMetaWarps;
      const int t1 = min(tile, (warp + 1) * per);
      for (int t = warp * per; t < t1; ++t) {
        const int2 o = other_ranges[t];  // (the same t across the warp: a broadcast)
        if (range.x <= o.y && o.x <= range.y) {
          first = min(first, base + t);
          last = base + t;
        }
      }
      __syncthreads();
    }
    pooled[warp][lane] = make_int2(first, last);
    __syncthreads();
    if (warp == 0 && c < mine_chunks) {
      for (int w = 1; w < kMetaWarps; ++w) {
        first = min(first, pooled[w][lane].x);
        last = max(last, pooled[w][lane].y);
      }
      reinterpret_cast<int2*>(mine)[2 * c + 1] =
          last >= 0 ? make_int2(first * kSegmentChunk, min((last + 1) * kSegmentChunk, other_len))
                    : make_int2(INT_MAX, 0);
    }
    __syncthreads();  // pooled is reused
  }
}

}  // namespace

cudaError_t RunSegmentOperands(const SegmentOperandsParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  constexpr int kRunsSmem = (2 * (4 * kMaxSegmentRuns + 1) + kRunsTile) * int(sizeof(int32_t));
  static_assert(kRunsSmem <= 101376, "the runs kernel's shared memory fits every sm_80-class GPU's opt-in (sm_86/89)");
  if (cudaError_t e = ensure_smem_limit<segment_runs_kernel>(kRunsSmem); e != cudaSuccess) return e;
  const int batch_blocks = int(std::min<int64_t>(p.batch, 65535));
  int slots = 0;
  if (cudaError_t e = resident_ctas<segment_runs_kernel>(kRunsThreads, kRunsSmem, &slots); e != cudaSuccess) return e;
  const int longest = std::max(p.seqlen_q, p.seqlen_k);
  const int parts = std::max(1, std::min({ceil_div(slots, 2 * int64_t(batch_blocks)), kMaxRunsParts,
                                          ceil_div(longest, kRunsPartMin)}));
  segment_runs_kernel<<<dim3(batch_blocks, 2 * parts), kRunsThreads, kRunsSmem, stream>>>(p, parts);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  const int chunks = ceil_div(longest, kSegmentChunk);
  if (chunks == 0) return cudaSuccess;
  segment_meta_kernel<<<dim3(ceil_div(chunks, 32), batch_blocks, 2), kMetaThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jax_flash::cuda
