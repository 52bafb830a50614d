// The segment operands (segment_operands.h) on the CPU, one batch element after another.
#include <algorithm>
#include <climits>
#include <vector>

#include "mask.h"  // kSegmentChunk
#include "segment_operands.h"

namespace jax_flash::cpu {
namespace {

struct Run {
  int32_t id;
  int start;
  int end;
};

// Maximal stretches of equal ids, in position order.
std::vector<Run> RunsOf(const int32_t* ids, int n) {
  std::vector<Run> runs;
  for (int i = 0; i < n; ++i) {
    if (i == 0 || ids[i] != ids[i - 1]) runs.push_back({ids[i], i, i + 1});
    else runs.back().end = i + 1;
  }
  return runs;
}

// For each run of `mine`: the positions of `other` holding its id, as [lo, hi) per run. False when they are not
// one contiguous run for some id, or when the bounds decrease somewhere.
bool Intervals(const std::vector<Run>& mine, const std::vector<Run>& other, std::vector<int>* lo,
               std::vector<int>* hi) {
  std::vector<Run> by_id(other);
  std::stable_sort(by_id.begin(), by_id.end(), [](const Run& a, const Run& b) { return a.id < b.id; });
  lo->resize(mine.size());
  hi->resize(mine.size());
  int running = 0;  // the largest end so far
  for (size_t r = 0; r < mine.size(); ++r) {
    auto [first, last] = std::equal_range(by_id.begin(), by_id.end(), mine[r],
                                          [](const Run& a, const Run& b) { return a.id < b.id; });
    if (last - first > 1) return false;  // two runs hold the id: not contiguous
    if (first == last) {  // no position holds it: empty
      (*lo)[r] = (*hi)[r] = running;
    } else {
      (*lo)[r] = first->start;
      (*hi)[r] = first->end;
      running = std::max(running, first->end);
    }
    if (r > 0 && ((*lo)[r] < (*lo)[r - 1] || (*hi)[r] < (*hi)[r - 1])) return false;
  }
  return true;
}

void WriteRuns(const std::vector<Run>& runs, const std::vector<int>& lo, const std::vector<int>& hi, int32_t* out) {
  for (size_t r = 0; r < runs.size(); ++r) {
    for (int i = runs[r].start; i < runs[r].end; ++i) {
      out[2 * i] = lo[r];
      out[2 * i + 1] = hi[r];
    }
  }
}

void SegmentRuns(const int32_t* q, int t, const int32_t* kv, int s, int32_t* q_runs, int32_t* kv_runs) {
  const std::vector<Run> q_side = RunsOf(q, t), kv_side = RunsOf(kv, s);
  std::vector<int> q_lo, q_hi, kv_lo, kv_hi;
  const bool exact = int(q_side.size()) <= kMaxSegmentRuns && int(kv_side.size()) <= kMaxSegmentRuns &&
                     Intervals(q_side, kv_side, &q_lo, &q_hi) && Intervals(kv_side, q_side, &kv_lo, &kv_hi);
  if (!exact) {
    std::fill(q_runs, q_runs + 2 * int64_t(t), -1);
    std::fill(kv_runs, kv_runs + 2 * int64_t(s), -1);
    return;
  }
  WriteRuns(q_side, q_lo, q_hi, q_runs);
  WriteRuns(kv_side, kv_lo, kv_hi, kv_runs);
}

struct IdRange {
  int32_t min;
  int32_t max;
};

std::vector<IdRange> ChunkRanges(const int32_t* ids, int n) {
  std::vector<IdRange> ranges((n + kSegmentChunk - 1) / kSegmentChunk, IdRange{INT32_MAX, INT32_MIN});
  for (int i = 0; i < n; ++i) {
    IdRange& r = ranges[i / kSegmentChunk];
    r.min = std::min(r.min, ids[i]);
    r.max = std::max(r.max, ids[i]);
  }
  return ranges;
}

// meta rows {min, max, first, end} of `mine`'s chunks against `other`'s (other_len positions).
void Metadata(const std::vector<IdRange>& mine, const std::vector<IdRange>& other, int other_len, int32_t* meta) {
  for (size_t c = 0; c < mine.size(); ++c) {
    int first = -1, last = -1;
    for (size_t o = 0; o < other.size(); ++o) {
      if (mine[c].min <= other[o].max && other[o].min <= mine[c].max) {
        if (first < 0) first = int(o);
        last = int(o);
      }
    }
    int32_t* row = meta + 4 * c;
    row[0] = mine[c].min;
    row[1] = mine[c].max;
    row[2] = last >= 0 ? first * kSegmentChunk : INT32_MAX;
    row[3] = last >= 0 ? std::min((last + 1) * kSegmentChunk, other_len) : 0;
  }
}

}  // namespace

void SegmentOperands(const SegmentOperandsParams& p) {
  const int t = p.seqlen_q, s = p.seqlen_k;
  const int64_t q_chunks = (t + kSegmentChunk - 1) / kSegmentChunk, kv_chunks = (s + kSegmentChunk - 1) / kSegmentChunk;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int32_t* q = p.q_ids + b * t;
    const int32_t* kv = p.kv_ids + b * s;
    const std::vector<IdRange> q_ranges = ChunkRanges(q, t), kv_ranges = ChunkRanges(kv, s);
    Metadata(q_ranges, kv_ranges, s, p.q_meta + b * q_chunks * 4);
    Metadata(kv_ranges, q_ranges, t, p.kv_meta + b * kv_chunks * 4);
    SegmentRuns(q, t, kv, s, p.q_runs + b * t * 2, p.kv_runs + b * s * 2);
  }
}

}  // namespace jax_flash::cpu
