// CPU FlashAttention (FlashAttention-2 tiling, fp32 accumulation), parallelised with std::thread.
//
// Forward: one work item per (batch, query head, 128-row query block). The item keeps a float copy of its Q tile and
// a float output accumulator, and walks the 64-key blocks the mask lets the block see (AttentionMask::key_range),
// converting each K tile to a transposed float tile and each V tile to a float tile. Online softmax in the log2
// domain (p.scale_log2 folded into the logits, a vectorisable exp2 polynomial) rescales the accumulator whenever the
// running row maximum grows. The Sq x Sk matrix is never materialised: S/P live in one per-thread tile. Tiles that
// AttentionMask::tile_fully_visible calls interior skip the per-element mask.
//
// Backward, from O, lse and dO (dsum = rowsum(dO * O), P = exp(S - lse), dS = P * (dP - dsum)), 64-row query tiles:
//   * fused (enough (batch, kv head) pairs to keep the threads busy): one item per (batch, kv head). It owns dQ of
//     its group's query heads (accumulated in p.dq_accum) and walks key blocks; for each, the group's query heads and
//     the query rows that can see the key block (AttentionMask::row_range), accumulating dK/dV of the key block in
//     float tiles (summed over the group: no head-expanded dK/dV) and adding dS K into dq_accum.
//   * split (few pairs, e.g. MQA with batch 1): dK/dV key-stationary with one item per (batch, kv head, key block),
//     then dQ query-stationary with one item per (batch, query head, query block). It recomputes P and dS once
//     more, but every pass has plenty of independent items.
// No two items write the same memory, so there are no data races and results do not depend on scheduling.
//
// Non-finite inputs propagate as through jax.nn's xla path: a row with a nan or +inf visible logit outputs nan, a
// -inf logit weighs 0 (a row whose visible logits are all -inf is 0 / 0 = nan), a non-finite value of a visible key
// makes that column of the row non-finite, and gradients follow. Masked logits and dS entries are selected away,
// never multiplied by 0. A row that sees no key still outputs exactly 0 and gets a zero dQ, and keys that no row
// sees get zero dK/dV, whatever the inputs hold; neither those rows' Q and dO nor those keys' K and V reach any
// other result. A non-finite K or V of a key that some rows see may still reach other rows of its tile through a
// zero weight (0 * nan); jax.nn's sums run over every key, so there it always does.
//
// Matrix products go through one register-blocked kernel on GCC vector extensions. All operands are first copied
// into zero-padded float tiles, so the kernel only sees row counts that are multiples of its tile height and column
// counts that are multiples of 8; sums over k run in order (no reassociation).
//
// The build has no -march flags. The ISA-dependent part of this file (between the JF_KERNELS markers below) is
// therefore compiled twice, by including this file into itself: once for baseline x86-64 (SSE2, 4 x 8 kernel tile)
// and once under `#pragma GCC target("avx2,fma")` (8 x 8 tile, FMA); the AVX2 copy runs when the CPU has AVX2 and
// FMA. (A target attribute on the callers alone is not enough: GCC lowers 32-byte vector code in default-target
// helpers to SSE before inlining it.)
#ifndef JF_KERNELS

#include "cpu/attention_cpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "mask.h"
#include "score_mod.h"

// The AVX2 copy has 32-byte vector signatures; all of them are inlined, but GCC still notes the ABI difference.
#pragma GCC diagnostic ignored "-Wpsabi"

#ifndef JAX_FLASH_CPU_BWD_FORCE
#define JAX_FLASH_CPU_BWD_FORCE 0  // testing only: 1 always fused backward, 2 always split
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(JAX_FLASH_CPU_NO_AVX2)
#define JF_AVX2 1
#else
#define JF_AVX2 0
#endif

namespace jax_flash::cpu {
namespace {

constexpr int kFwdBlockQ = 128;  // forward: query rows per item
constexpr int kFwdBlockK = 64;   // forward: keys per tile
constexpr int kBwdBlockQ = 64;   // backward: query rows per tile
constexpr int kNR = 8;           // kernel tile columns (head_dim is a multiple of 8; key tiles are padded to 8)
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kLog2eF = 1.4426950408889634f;

inline int RoundUp(int x, int m) { return (x + m - 1) / m * m; }
inline int CeilDiv(int x, int m) { return (x + m - 1) / m; }

// Backward: keys per tile. Larger tiles amortise the per-tile Q/dO conversion; smaller keep big heads in L2.
inline int BwdBlockK(int head_dim) { return head_dim <= 128 ? 128 : 64; }
// Row strides of the float tiles, padded past a power of two so that walking down a column does not keep hitting
// the same few L1 sets: key-wide tiles (S, P, dS, transposed K/V) use LdK, head_dim-wide tiles LdD.
inline int LdK(int block_k) { return block_k + 4; }
inline int LdD(int head_dim) { return head_dim + 4; }

// ----------------------------------------------------------------------------------------------------------------
// Element types and conversions.

struct BF16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

inline uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float ToFloat(float x) { return x; }
inline float ToFloat(BF16 x) { return BitsFloat(uint32_t(x.bits) << 16); }
inline float ToFloat(F16 x) {
  // Exact (every float16 is a float32). Subnormals: place the mantissa under exponent 2^-14 + 1 and subtract.
  const uint32_t h = x.bits;
  uint32_t u = (h & 0x7fffu) << 13;
  const uint32_t exp = u & (0x7c00u << 13);
  u += (127 - 15) << 23;
  float f;
  if (exp == (0x7c00u << 13)) {
    u += (128 - 16) << 23;  // inf / nan (payload kept)
    f = BitsFloat(u);
  } else if (exp == 0) {
    u += 1 << 23;  // zero / subnormal
    f = BitsFloat(u) - BitsFloat(113u << 23);
  } else {
    f = BitsFloat(u);
  }
  return BitsFloat(FloatBits(f) | ((h & 0x8000u) << 16));
}

template <typename T>
T FromFloat(float f);

template <>
inline float FromFloat<float>(float f) {
  return f;
}

template <>
inline BF16 FromFloat<BF16>(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return BF16{uint16_t((u >> 16) | 0x40u)};  // nan: keep it a (quiet) nan
  return BF16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};                  // round to nearest even
}

template <>
inline F16 FromFloat<F16>(float f) {
  // Round to nearest even, with subnormals, overflow to inf, and nan kept a (quiet) nan.
  uint32_t u = FloatBits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint16_t o;
  if (u >= (127u + 16u) << 23) {  // |f| >= 65536 (or inf / nan)
    o = u > 0x7f800000u ? uint16_t(0x7e00u | ((u >> 13) & 0x3ffu)) : uint16_t(0x7c00u);
  } else if (u < (113u << 23)) {  // |f| < 2^-14: the result is subnormal or zero
    // Adding 0.5 puts the 10 result mantissa bits at the bottom of the float; the addition rounds to nearest even.
    const float denorm_magic = BitsFloat(((127u - 15u) + (23u - 10u) + 1u) << 23);
    o = uint16_t(FloatBits(BitsFloat(u) + denorm_magic) - FloatBits(denorm_magic));
  } else {  // normal (rounding may carry into the exponent, up to inf)
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += (uint32_t(15 - 127) << 23) + 0xfffu + mant_odd;
    o = uint16_t(u >> 13);
  }
  return F16{uint16_t(o | (sign >> 16))};
}

// ----------------------------------------------------------------------------------------------------------------
// Tile loads and stores (4-wide, ISA independent). Float tiles are zero padded out to the kernel's multiples, so
// padding never holds nan.

typedef float F4 __attribute__((vector_size(16)));
typedef int32_t S4 __attribute__((vector_size(16)));

inline F4 LoadF4(const float* p) {
  F4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void StoreF4(float* p, const F4& v) { std::memcpy(p, &v, sizeof(v)); }

// Four consecutive elements as floats.
inline F4 Load4(const float* s) { return LoadF4(s); }
inline F4 Load4(const BF16* s) {
  uint16_t b[4];
  std::memcpy(b, s, sizeof(b));
  return (F4)(S4{b[0], b[1], b[2], b[3]} << 16);
}
inline F4 Load4(const F16* s) { return F4{ToFloat(s[0]), ToFloat(s[1]), ToFloat(s[2]), ToFloat(s[3])}; }

// dst[r * ldd + c] = src[r * lds + c] for r < rows, c < cols (a multiple of 4); rows [rows, rows_pad) are zeroed.
template <typename T>
inline void LoadRows(const T* __restrict src, int64_t lds, int rows, int rows_pad, int cols, float* __restrict dst,
                     int ldd) {
  for (int r = 0; r < rows; ++r) {
    const T* s = src + r * lds;
    float* d = dst + int64_t(r) * ldd;
    for (int c = 0; c < cols; c += 4) StoreF4(d + c, Load4(s + c));
  }
  for (int r = rows; r < rows_pad; ++r) std::memset(dst + int64_t(r) * ldd, 0, sizeof(float) * cols);
}

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols (a multiple of 4); columns [rows, rows_pad) of dst are
// zeroed. Transposes 4 x 4 blocks in registers so that every store writes 4 contiguous floats.
template <typename T>
inline void LoadRowsTransposed(const T* __restrict src, int64_t lds, int rows, int rows_pad, int cols,
                               float* __restrict dst, int ldd) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    const T* s0 = src + r * lds;
    const T* s1 = s0 + lds;
    const T* s2 = s1 + lds;
    const T* s3 = s2 + lds;
    for (int c = 0; c < cols; c += 4) {
      const F4 a = Load4(s0 + c), b = Load4(s1 + c), x = Load4(s2 + c), y = Load4(s3 + c);
      const F4 ab_lo = __builtin_shuffle(a, b, S4{0, 4, 1, 5}), ab_hi = __builtin_shuffle(a, b, S4{2, 6, 3, 7});
      const F4 xy_lo = __builtin_shuffle(x, y, S4{0, 4, 1, 5}), xy_hi = __builtin_shuffle(x, y, S4{2, 6, 3, 7});
      float* d = dst + int64_t(c) * ldd + r;
      StoreF4(d, __builtin_shuffle(ab_lo, xy_lo, S4{0, 1, 4, 5}));
      StoreF4(d + ldd, __builtin_shuffle(ab_lo, xy_lo, S4{2, 3, 6, 7}));
      StoreF4(d + 2 * ldd, __builtin_shuffle(ab_hi, xy_hi, S4{0, 1, 4, 5}));
      StoreF4(d + 3 * ldd, __builtin_shuffle(ab_hi, xy_hi, S4{2, 3, 6, 7}));
    }
  }
  for (; r < rows; ++r) {
    const T* s = src + r * lds;
    for (int c = 0; c < cols; ++c) dst[int64_t(c) * ldd + r] = ToFloat(s[c]);
  }
  if (rows_pad > rows) {
    for (int c = 0; c < cols; ++c) std::memset(dst + int64_t(c) * ldd + rows, 0, sizeof(float) * (rows_pad - rows));
  }
}

// dst[r * ldd + c] = mul * src[r * lds + c] for r < rows, c < cols.
template <typename T>
inline void StoreRows(const float* __restrict src, int64_t lds, int rows, int cols, float mul, T* __restrict dst,
                      int64_t ldd) {
  for (int r = 0; r < rows; ++r) {
    const float* s = src + r * lds;
    T* d = dst + r * ldd;
    for (int c = 0; c < cols; ++c) d[c] = FromFloat<T>(mul * s[c]);
  }
}

template <typename T>
inline void StoreZeros(int rows, int cols, T* __restrict dst, int64_t ldd) {
  for (int r = 0; r < rows; ++r) {
    T* d = dst + r * ldd;
    for (int c = 0; c < cols; ++c) d[c] = FromFloat<T>(0.0f);
  }
}

// ----------------------------------------------------------------------------------------------------------------
// Masks, scratch tiles, threading.

// Visible keys of tile row i (query row q0 + i) as tile columns [*jlo, *jhi) within [0, nk). Rows i >= nq (padding)
// see nothing; with `full` (the tile is entirely visible) every row sees all nk keys.
inline void RowSpan(const AttentionMask& mask, bool full, int q0, int i, int nq, int k0, int nk, int* jlo,
                    int* jhi) {
  if (i >= nq) {
    *jlo = *jhi = 0;
  } else if (full) {
    *jlo = 0;
    *jhi = nk;
  } else {
    const int row = q0 + i;
    const int64_t lo = int64_t(mask.lo(row)) - k0;  // hi() may be INT_MAX-ish: subtract in 64 bits
    const int64_t hi = int64_t(mask.hi(row)) - k0;
    *jlo = int(std::min<int64_t>(std::max<int64_t>(lo, 0), nk));
    *jhi = int(std::min<int64_t>(std::max<int64_t>(hi, *jlo), nk));
  }
}

// True when query row `row` sees at least one of the seqlen_k keys under the interval masks (segment ids aside).
inline bool RowSeesKey(const AttentionMask& mask, int row, int seqlen_k) {
  return std::min(mask.hi(row), seqlen_k) > mask.lo(row);
}

// Backward: true when query row `row` (below seqlen_q) sees no key, given its forward log-sum-exp: with segment
// ids the forward marks such rows with lse = +inf.
inline bool RowSeesNoKey(const FlashParams& p, const AttentionMask& mask, int row, float lse) {
  return !RowSeesKey(mask, row, p.seqlen_k) || (mask.segments.enabled() && lse == kInf);
}

// Zeroes row i of x (row stride ld, head_dim floats) for each query row q0 + i, i < n, that sees no key (lse: the
// rows' log-sum-exp from row q0): dQ rows that a product with a K tile holding nan could otherwise have made nan.
inline void ZeroRowsThatSeeNoKey(const FlashParams& p, const AttentionMask& mask, int q0, int n, const float* lse,
                                 float* x, int64_t ld) {
  for (int i = 0; i < n; ++i) {
    if (RowSeesNoKey(p, mask, q0 + i, lse[i])) std::fill_n(x + i * ld, p.head_dim, 0.0f);
  }
}

// Soft-capped scores in place (rows x cols of a tile with row stride ld).
inline void CapScores(const SoftCap& cap, float* s, int ld, int rows, int cols) {
  for (int i = 0; i < rows; ++i) {
    for (int j = 0; j < cols; ++j) s[int64_t(i) * ld + j] = cap.apply(s[int64_t(i) * ld + j]);
  }
}

// Segment ids of keys [k0, k0 + nk) into kvid[0, nkp) (padding 0: those keys are masked by the interval anyway).
inline void LoadKeyIds(const AttentionMask& mask, int k0, int nk, int nkp, int32_t* kvid) {
  for (int j = 0; j < nkp; ++j) kvid[j] = j < nk ? mask.segments.kv_ids[k0 + j] : 0;
}

struct FwdScratch {
  std::vector<float> q, kt, v, s, o, pv, m, l;  // pv: one tile's P V (GemmAdd)
  std::vector<char> seen;      // query rows that saw some key
  std::vector<int32_t> kvid;  // segment ids of the key tile
  explicit FwdScratch(const FlashParams& p)
      : q(size_t(kFwdBlockQ) * LdD(p.head_dim)),
        kt(size_t(p.head_dim) * LdK(kFwdBlockK)),
        v(size_t(kFwdBlockK) * LdD(p.head_dim)),
        s(size_t(kFwdBlockQ) * LdK(kFwdBlockK)),
        o(size_t(kFwdBlockQ) * LdD(p.head_dim)),
        pv(size_t(kFwdBlockQ) * LdD(p.head_dim)),
        m(kFwdBlockQ),
        l(kFwdBlockQ),
        seen(kFwdBlockQ),
        kvid(kFwdBlockK) {}
};

struct BwdScratch {
  int bk, ldk, ldd;
  std::vector<float> q, dout, kt, vt, k, p, ds, dk, dv, dq, tmp, lse2, dsum;  // tmp: one tile's product (GemmAdd)
  std::vector<int32_t> kvid;  // segment ids of the key tile
  explicit BwdScratch(const FlashParams& prm)
      : bk(BwdBlockK(prm.head_dim)),
        ldk(LdK(bk)),
        ldd(LdD(prm.head_dim)),
        q(size_t(kBwdBlockQ) * ldd),
        dout(size_t(kBwdBlockQ) * ldd),
        kt(size_t(prm.head_dim) * ldk),
        vt(size_t(prm.head_dim) * ldk),
        k(size_t(bk) * ldd),
        p(size_t(kBwdBlockQ) * ldk),
        ds(size_t(kBwdBlockQ) * ldk),
        dk(size_t(bk) * ldd),
        dv(size_t(bk) * ldd),
        dq(size_t(kBwdBlockQ) * ldd),
        tmp(size_t(std::max(bk, kBwdBlockQ)) * ldd),
        lse2(kBwdBlockQ),
        dsum(kBwdBlockQ),
        kvid(bk) {}
};

// Loads the query-side tiles of rows [q0, q0 + nq) of (batch b, query head h): Q and dO (float, zero padding rows
// and rows that see no key, so that their contents never reach dK or dV), lse in the log2 domain and dsum
// (padding rows: +inf and 0).
template <typename T>
inline void LoadQuerySide(const FlashParams& p, const AttentionMask& mask, int b, int h, int q0, int nq, int nqp,
                          BwdScratch& w) {
  const int64_t q_rs = p.q_row_stride();
  const int64_t off = b * p.q_batch_stride() + int64_t(q0) * q_rs + int64_t(h) * p.head_dim;
  LoadRows(static_cast<const T*>(p.q) + off, q_rs, nq, nqp, p.head_dim, w.q.data(), w.ldd);
  LoadRows(static_cast<const T*>(p.dout) + off, q_rs, nq, nqp, p.head_dim, w.dout.data(), w.ldd);
  const float* lse = p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q + q0;
  const float* lse2 = p.lse_log2_of(b, h) + q0;
  const float* dsum = p.dsum_of(b, h) + q0;
  for (int i = 0; i < nq; ++i) {
    w.lse2[i] = lse2[i];
    w.dsum[i] = dsum[i];
    if (RowSeesNoKey(p, mask, q0 + i, lse[i])) {
      std::fill_n(w.q.data() + int64_t(i) * w.ldd, p.head_dim, 0.0f);
      std::fill_n(w.dout.data() + int64_t(i) * w.ldd, p.head_dim, 0.0f);
    }
  }
  for (int i = nq; i < nqp; ++i) {
    w.lse2[i] = kInf;
    w.dsum[i] = 0.0f;
  }
}

// Loads the key-side tiles of keys [k0, k0 + nk) of (batch b, kv head kvh): K and V transposed, and (need_k) K.
template <typename T>
inline void LoadKeySide(const FlashParams& p, int b, int kvh, int k0, int nk, int nkp, bool need_k, BwdScratch& w) {
  const int64_t kv_rs = p.kv_row_stride();
  const int64_t off = b * p.kv_batch_stride() + int64_t(k0) * kv_rs + int64_t(kvh) * p.head_dim;
  const T* k = static_cast<const T*>(p.k) + off;
  LoadRowsTransposed(k, kv_rs, nk, nkp, p.head_dim, w.kt.data(), w.ldk);
  LoadRowsTransposed(static_cast<const T*>(p.v) + off, kv_rs, nk, nkp, p.head_dim, w.vt.data(), w.ldk);
  if (need_k) LoadRows(k, kv_rs, nk, nkp, p.head_dim, w.k.data(), w.ldd);
}

// The row statistics of (batch b, query head h): lse[b, h, i] * log2(e) and dsum[b, h, i] = sum_d dout[b, i, h, d] *
// o[b, i, h, d] for every row, 0 in the padding rows.
template <typename T>
void ComputeRowStats(const FlashParams& p, int b, int h) {
  const int D = p.head_dim;
  const int64_t q_rs = p.q_row_stride();
  const int64_t off = b * p.q_batch_stride() + int64_t(h) * D;
  const T* o = static_cast<const T*>(p.o) + off;
  const T* dout = static_cast<const T*>(p.dout) + off;
  const float* lse = p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q;
  float* lse2 = p.lse_log2_of(b, h);
  float* dsum = p.dsum_of(b, h);
  for (int i = 0; i < p.seqlen_q; ++i) {
    const T* oi = o + i * q_rs;
    const T* di = dout + i * q_rs;
    F4 part = F4{};
    for (int d = 0; d < D; d += 4) part += Load4(oi + d) * Load4(di + d);
    dsum[i] = (part[0] + part[1]) + (part[2] + part[3]);
    lse2[i] = lse[i] * kLog2eF;
  }
  std::fill(lse2 + p.seqlen_q, lse2 + p.seqlen_q_rounded, 0.0f);
  std::fill(dsum + p.seqlen_q, dsum + p.seqlen_q_rounded, 0.0f);
}

bool UseAvx2() {
#if JF_AVX2
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
#else
  return false;
#endif
}

// Threads for a call: one for tiny problems (a thread costs more than the work), else up to one per item.
int NumThreads(const FlashParams& p, int64_t items) {
  const int64_t work = int64_t(p.batch) * p.heads_q * p.seqlen_q * int64_t(p.seqlen_k) * p.head_dim;
  if (items <= 1 || work < (int64_t(1) << 22)) return 1;
  const int hw = std::max(1, int(std::thread::hardware_concurrency()));
  return int(std::min<int64_t>(hw, items));
}

// Runs body(item, scratch) for every item in [0, n), each thread with its own Scratch(p), dynamically scheduled.
template <typename Scratch, typename Body>
void RunItems(const FlashParams& p, int64_t n, int nthreads, const Body& body) {
  if (n <= 0) return;
  nthreads = int(std::max<int64_t>(1, std::min<int64_t>(nthreads, n)));
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    Scratch scratch(p);
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) body(i, scratch);
  };
  if (nthreads == 1) {
    worker();
    return;
  }
  std::vector<std::thread> threads;
  threads.reserve(nthreads - 1);
  for (int t = 1; t < nthreads; ++t) {
    try {
      threads.emplace_back(worker);
    } catch (...) {  // cannot start a thread: the ones running (at least this one) take all the items
      break;
    }
  }
  worker();
  for (auto& t : threads) t.join();
}

// ----------------------------------------------------------------------------------------------------------------
// The ISA-dependent kernels, compiled once per instruction set (see the top of the file).

namespace sse2 {
typedef float V __attribute__((vector_size(16)));
typedef int32_t I __attribute__((vector_size(16)));
constexpr int kW = 4;   // floats per vector
constexpr int kMR = 4;  // kernel tile rows: 4 x (2 vectors) = 8 accumulators of the 16 xmm registers
inline I Iota() { return I{0, 1, 2, 3}; }
#define JF_KERNELS 1
#include "attention_cpu.cc"
#undef JF_KERNELS
}  // namespace sse2

#if JF_AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
typedef float V __attribute__((vector_size(32)));
typedef int32_t I __attribute__((vector_size(32)));
constexpr int kW = 8;
constexpr int kMR = 8;  // 8 x (1 vector) = 8 accumulators of the 16 ymm registers
inline I Iota() { return I{0, 1, 2, 3, 4, 5, 6, 7}; }
#define JF_KERNELS 1
#include "attention_cpu.cc"
#undef JF_KERNELS
}  // namespace avx2
#pragma GCC pop_options
#endif

// ----------------------------------------------------------------------------------------------------------------
// Dispatch.

template <typename T>
void Forward(const FlashParams& p) {
  const int64_t items = int64_t(p.batch) * p.heads_q * CeilDiv(p.seqlen_q, kFwdBlockQ);
  const int nthreads = NumThreads(p, items);
#if JF_AVX2
  if (UseAvx2()) {
    RunItems<FwdScratch>(p, items, nthreads, [&](int64_t i, FwdScratch& w) { avx2::ForwardItem<T>(p, i, w); });
    return;
  }
#endif
  RunItems<FwdScratch>(p, items, nthreads, [&](int64_t i, FwdScratch& w) { sse2::ForwardItem<T>(p, i, w); });
}

template <typename T>
void Backward(const FlashParams& p) {
  if (p.heads_q <= 0) {  // no query heads: nothing reaches K and V
    for (int b = 0; b < p.batch; ++b) {
      const int64_t off = b * p.kv_batch_stride();
      StoreZeros(p.seqlen_k, int(p.kv_row_stride()), static_cast<T*>(p.dk) + off, p.kv_row_stride());
      StoreZeros(p.seqlen_k, int(p.kv_row_stride()), static_cast<T*>(p.dv) + off, p.kv_row_stride());
    }
    return;
  }
  [[maybe_unused]] const bool avx2 = UseAvx2();
  const int64_t pairs = int64_t(p.batch) * p.heads_kv;
  const int64_t heads = int64_t(p.batch) * p.heads_q;
  const int64_t q_items = heads * CeilDiv(p.seqlen_q, kBwdBlockQ);
  const int nthreads = NumThreads(p, q_items + pairs);
  // The fused schedule does 5 tile products per (query tile, key tile) pair, the split one 7, but the fused one has
  // only `pairs` items: use it unless its busiest thread would do more than a thread of the split schedule.
  bool fused = 5 * ((pairs + nthreads - 1) / nthreads) * nthreads <= 7 * pairs;
  if (JAX_FLASH_CPU_BWD_FORCE == 1) fused = true;
  if (JAX_FLASH_CPU_BWD_FORCE == 2) fused = false;
  if (fused) {
    RunItems<BwdScratch>(p, pairs, nthreads, [&](int64_t i, BwdScratch& w) {
#if JF_AVX2
      if (avx2) return avx2::BackwardFusedItem<T>(p, i, w);
#endif
      sse2::BackwardFusedItem<T>(p, i, w);
    });
    return;
  }
  struct NoScratch {
    explicit NoScratch(const FlashParams&) {}
  };
  RunItems<NoScratch>(p, heads, nthreads, [&](int64_t i, NoScratch&) {
    ComputeRowStats<T>(p, int(i / p.heads_q), int(i % p.heads_q));
  });
  const int64_t kv_items = pairs * CeilDiv(p.seqlen_k, BwdBlockK(p.head_dim));
  RunItems<BwdScratch>(p, kv_items, nthreads, [&](int64_t i, BwdScratch& w) {
#if JF_AVX2
    if (avx2) return avx2::BackwardDkvItem<T>(p, i, w);
#endif
    sse2::BackwardDkvItem<T>(p, i, w);
  });
  RunItems<BwdScratch>(p, q_items, nthreads, [&](int64_t i, BwdScratch& w) {
#if JF_AVX2
    if (avx2) return avx2::BackwardDqItem<T>(p, i, w);
#endif
    sse2::BackwardDqItem<T>(p, i, w);
  });
}

}  // namespace

void FlashForward(const FlashParams& p) {
  if (p.batch <= 0 || p.heads_q <= 0 || p.seqlen_q <= 0) return;
  switch (p.dtype) {
    case DType::kF32: Forward<float>(p); break;
    case DType::kBF16: Forward<BF16>(p); break;
    case DType::kF16: Forward<F16>(p); break;
  }
}

void FlashBackward(const FlashParams& p) {
  // Empty sequences need no special case beyond this one: key blocks no row sees get zero dK/dV, query rows that
  // see no key get zero dQ. Without query rows there is no dQ and dK = dV = 0 (and the segment operands of the rows,
  // whose first entry marks runs, are empty: not to be read).
  if (p.batch <= 0) return;
  if (p.seqlen_q <= 0) {
    const size_t bytes = size_t(p.batch) * size_t(p.kv_batch_stride()) * (p.dtype == DType::kF32 ? 4 : 2);
    std::memset(p.dk, 0, bytes);
    std::memset(p.dv, 0, bytes);
    return;
  }
  switch (p.dtype) {
    case DType::kF32: Backward<float>(p); break;
    case DType::kBF16: Backward<BF16>(p); break;
    case DType::kF16: Backward<F16>(p); break;
  }
}

}  // namespace jax_flash::cpu

#else  // JF_KERNELS ==================================================================================================
// Kernels for one instruction set: included above inside namespace sse2 / avx2, which define V (float vector), I
// (int32 vector of the same width), kW (its width), kMR (kernel tile rows) and Iota() ({0, 1, ..., kW - 1}).

inline V VLoad(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void VStore(float* p, const V& v) { std::memcpy(p, &v, sizeof(v)); }
inline V VSplat(float x) { return -V{} + x; }  // (-0) + x == x exactly: folds to a plain broadcast
inline V VMax(const V& a, const V& b) { return a < b ? b : a; }
inline float HMax(const V& v) {
  float m = v[0];
  for (int t = 1; t < kW; ++t) m = std::max(m, float(v[t]));
  return m;
}
inline float HSum(const V& v) {
  float s = v[0];
  for (int t = 1; t < kW; ++t) s += v[t];
  return s;
}

// 2^x elementwise, relative error ~2e-7; 0 for x < -126 (and -inf); nan stays nan. Branch-free.
inline V Exp2(const V& x) {
  const V lo = VSplat(-126.0f), hi = VSplat(126.0f);
  V xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const V magic = VSplat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits
  const V t = xc + magic;
  const V f = xc - (t - magic);  // [-0.5, 0.5]
  // Cephes exp2f minimax polynomial on [-0.5, 0.5].
  V poly = VSplat(1.535336188319500e-4f);
  poly = poly * f + 1.339887440266574e-3f;
  poly = poly * f + 9.618437357674640e-3f;
  poly = poly * f + 5.550332471162809e-2f;
  poly = poly * f + 2.402264791363012e-1f;
  poly = poly * f + 6.931472028550421e-1f;
  poly = poly * f + 1.0f;
  const I n = (I)t - (I)magic;  // round(xc) as an integer
  const V r = (V)((I)poly + (n << 23));  // garbage for nan x: the exponent bits come from its payload
  return x < lo ? V{} : (x == x ? r : x);
}
inline float Exp2Scalar(float x) { return Exp2(VSplat(x))[0]; }
inline I ILoad(const int32_t* p) {
  I v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// C = A B with A(r, k) = A[r * a_rs + k * a_ks], B(k, c) = B[k * ldb + c], C(r, c) = C[r * ldc + c].
// M must be a multiple of kMR and N of kNR. Each C element is a sum over k in order.
inline void Gemm(int M, int N, int K, const float* __restrict A, ptrdiff_t a_rs, ptrdiff_t a_ks,
                 const float* __restrict B, ptrdiff_t ldb, float* __restrict C, ptrdiff_t ldc) {
  constexpr int NV = kNR / kW;  // vectors per kernel tile row
  for (int r = 0; r < M; r += kMR) {
    for (int c = 0; c < N; c += kNR) {
      float* cp = C + r * ldc + c;
      V x[kMR][NV];
      for (int i = 0; i < kMR; ++i) {
        for (int v = 0; v < NV; ++v) x[i][v] = V{};
      }
      const float* a = A + r * a_rs;
      const float* b = B + c;
      for (int k = 0; k < K; ++k) {
        V bv[NV];
        for (int v = 0; v < NV; ++v) bv[v] = VLoad(b + v * kW);
        for (int i = 0; i < kMR; ++i) {
          const V ai = VSplat(a[i * a_rs]);
          for (int v = 0; v < NV; ++v) x[i][v] += ai * bv[v];
        }
        a += a_ks;
        b += ldb;
      }
      for (int i = 0; i < kMR; ++i) {
        for (int v = 0; v < NV; ++v) VStore(cp + i * ldc + v * kW, x[i][v]);
      }
    }
  }
}

// C += A B (shapes as Gemm's) through `tmp`, as large as C: the tile's product summed on its own, then added. A loop
// over many tiles then adds a few tile sums into each element instead of one sequential float32 sum over every key
// (or query), whose error grew with the sequence: 4-8x jax.nn's from about 1000 keys (NOTES, session 78).
inline void GemmAdd(int M, int N, int K, const float* __restrict A, ptrdiff_t a_rs, ptrdiff_t a_ks,
                    const float* __restrict B, ptrdiff_t ldb, float* __restrict C, ptrdiff_t ldc,
                    float* __restrict tmp) {
  Gemm(M, N, K, A, a_rs, a_ks, B, ldb, tmp, ldc);
  for (int r = 0; r < M; ++r) {
    float* __restrict c = C + r * ldc;
    const float* __restrict t = tmp + r * ldc;
    for (int j = 0; j < N; j += kW) VStore(c + j, VLoad(c + j) + VLoad(t + j));
  }
}

// ---- Forward: one (batch, query head, query block) item.
template <typename T>
void ForwardItem(const FlashParams& p, int64_t item, FwdScratch& w) {
  const int nqb = CeilDiv(p.seqlen_q, kFwdBlockQ);
  const int qb = int(item % nqb);
  const int h = int(item / nqb % p.heads_q);
  const int b = int(item / nqb / p.heads_q);
  const int kvh = h / p.group_size();
  const int D = p.head_dim;
  const int ldd = LdD(D), ldk = LdK(kFwdBlockK);
  const int q0 = qb * kFwdBlockQ;
  const int nq = std::min(kFwdBlockQ, p.seqlen_q - q0);
  const int nqp = RoundUp(nq, kMR);
  const AttentionMask mask = mask_for_batch<SegmentMode::kAuto>(p, b);

  const int64_t q_rs = p.q_row_stride(), kv_rs = p.kv_row_stride();
  const T* q = static_cast<const T*>(p.q) + b * p.q_batch_stride() + int64_t(q0) * q_rs + int64_t(h) * D;
  const T* k = static_cast<const T*>(p.k) + b * p.kv_batch_stride() + int64_t(kvh) * D;
  const T* v = static_cast<const T*>(p.v) + b * p.kv_batch_stride() + int64_t(kvh) * D;
  T* o = static_cast<T*>(p.o) + b * p.q_batch_stride() + int64_t(q0) * q_rs + int64_t(h) * D;
  float* lse = p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q + q0;

  int kb0, kb1;
  mask.key_range(q0, q0 + nq, &kb0, &kb1);
  kb0 = std::max(kb0, 0);
  kb1 = std::min(kb1, p.seqlen_k);
  if (kb1 <= kb0) {  // no row of the block sees any key
    StoreZeros(nq, D, o, q_rs);
    for (int i = 0; i < nq; ++i) lse[i] = kInf;
    return;
  }

  float* __restrict qf = w.q.data();
  float* __restrict kt = w.kt.data();
  float* __restrict vf = w.v.data();
  float* __restrict s = w.s.data();
  float* __restrict acc = w.o.data();
  float* __restrict m = w.m.data();
  float* __restrict l = w.l.data();
  LoadRows(q, q_rs, nq, nqp, D, qf, ldd);
  std::fill(acc, acc + size_t(nqp) * ldd, 0.0f);
  std::fill(m, m + nqp, -kInf);
  std::fill(l, l + nqp, 0.0f);
  std::fill(w.seen.begin(), w.seen.end(), 0);
  const V vsl2 = VSplat(p.scale_log2), vneg = VSplat(-kInf);
  const SoftCap cap(p);

  for (int k0 = kb0; k0 < kb1; k0 += kFwdBlockK) {
    const int nk = std::min(kFwdBlockK, kb1 - k0);
    const int nkp = RoundUp(nk, kNR);
    LoadRowsTransposed(k + int64_t(k0) * kv_rs, kv_rs, nk, nkp, D, kt, ldk);
    LoadRows(v + int64_t(k0) * kv_rs, kv_rs, nk, nkp, D, vf, ldd);
    Gemm(nqp, nkp, D, qf, ldd, 1, kt, ldk, s, ldk);  // S = Q K^T
    if (cap.enabled()) CapScores(cap, s, ldk, nq, nk);
    const bool full = mask.tile_fully_visible(q0, q0 + nq, k0, k0 + nk, p.seqlen_q);
    const bool seg = !full && mask.segments.enabled();
    if (seg) LoadKeyIds(mask, k0, nk, nkp, w.kvid.data());
    for (int i = 0; i < nqp; ++i) {
      float* __restrict si = s + i * ldk;
      int jlo, jhi;
      RowSpan(mask, full, q0, i, nq, k0, nk, &jlo, &jhi);
      if (seg && jhi > jlo) {  // keys of other segments: -inf (the interval test below keeps them so)
        const int32_t id = mask.segments.q_ids[q0 + i];
        int same = 0;
        for (int j = jlo; j < jhi; ++j) {
          if (w.kvid[j] != id) {
            si[j] = -kInf;
          } else {
            ++same;
          }
        }
        if (same == 0) jhi = jlo;
      }
      if (jhi <= jlo) {  // nothing visible in this tile: P = 0, running max/sum unchanged
        std::fill(si, si + nkp, 0.0f);
        continue;
      }
      w.seen[i] = 1;
      // Logits in the log2 domain, -inf where masked, and their maximum.
      V vmax = vneg;
      for (int j = 0; j < nkp; j += kW) {
        const I idx = Iota() + j;
        const V x = (idx >= jlo) & (idx < jhi) ? VLoad(si + j) * vsl2 : vneg;
        VStore(si + j, x);
        vmax = VMax(vmax, x);
      }
      // vmax skips nan logits; they make their exponential (hence l and the row) nan below.
      const float m_new = std::max(m[i], HMax(vmax));
      const float alpha = m[i] == m_new ? 1.0f : Exp2Scalar(m[i] - m_new);  // 0 while m[i] is still -inf
      // Exponents relative to m_new, or to 0 while every visible logit so far is -inf: those then weigh 0 instead
      // of exp2(-inf + inf) = nan. A +inf logit makes m_new +inf and its own exponential nan, as in jax.nn.
      const V vm = VSplat(m_new == -kInf ? 0.0f : m_new);
      V vsum = V{};
      for (int j = 0; j < nkp; j += kW) {
        const V e = Exp2(VLoad(si + j) - vm);  // masked: exp2(-inf) = 0
        VStore(si + j, e);
        vsum += e;
      }
      l[i] = l[i] * alpha + HSum(vsum);
      m[i] = m_new;
      if (alpha != 1.0f) {
        float* __restrict ai = acc + int64_t(i) * ldd;
        const V va = VSplat(alpha);
        for (int d = 0; d < D; d += kW) VStore(ai + d, VLoad(ai + d) * va);
      }
    }
    GemmAdd(nqp, D, nkp, s, ldk, 1, vf, ldd, acc, ldd, w.pv.data());  // O += P V
  }

  const float sink = p.sinks != nullptr ? p.sinks[int64_t(b) * p.heads_q + h] : -kInf;
  for (int i = 0; i < nq; ++i) {
    // l >= 1 when the row's largest visible logit is finite; a nan l (nan or +inf logits) or l = 0 (every visible
    // logit -inf) gives a nan row, and a nan or -inf lse, as jax.nn does.
    if (RowSeesKey(mask, q0 + i, p.seqlen_k) && w.seen[i]) {
      if (sink != -kInf && l[i] >= 0.0f) {
        // The sink joins the denominator (row_finish.cuh has the same arithmetic): in the log2 domain, relative
        // to the larger of the row maximum and the sink.
        const float mm = m[i] == -kInf ? 0.0f : m[i];
        const float s2 = sink * kLog2eF;
        const float top = std::max(mm, s2);
        const float keys_weight = std::exp2(mm - top);
        const float total = l[i] * keys_weight + std::exp2(s2 - top);
        StoreRows(acc + int64_t(i) * ldd, ldd, 1, D, keys_weight / total, o + i * q_rs, q_rs);
        lse[i] = (top + std::log2(total)) * kLn2;
        continue;
      }
      StoreRows(acc + int64_t(i) * ldd, ldd, 1, D, 1.0f / l[i], o + i * q_rs, q_rs);
      lse[i] = (m[i] + std::log2(l[i])) * kLn2;
    } else {
      StoreZeros(1, D, o + i * q_rs, q_rs);
      lse[i] = kInf;
    }
  }
}

// ---- Backward.

// From the loaded tiles: P (w.p) and scale * dS (w.ds) of query rows [q0, q0 + nq) x keys [k0, k0 + nk). Padding
// rows and columns come out zero.
inline void BackwardTile(const FlashParams& p, const AttentionMask& mask, int q0, int nq, int nqp, int k0, int nk,
                         int nkp, BwdScratch& w) {
  const int D = p.head_dim, ldd = w.ldd, ldk = w.ldk;
  float* __restrict pt = w.p.data();
  float* __restrict ds = w.ds.data();
  Gemm(nqp, nkp, D, w.q.data(), ldd, 1, w.kt.data(), ldk, pt, ldk);     // S = Q K^T
  Gemm(nqp, nkp, D, w.dout.data(), ldd, 1, w.vt.data(), ldk, ds, ldk);  // dP = dO V^T
  const SoftCap cap(p);
  if (cap.enabled()) CapScores(cap, pt, ldk, nq, nk);
  const bool full = mask.tile_fully_visible(q0, q0 + nq, k0, k0 + nk, p.seqlen_q);
  const bool seg = !full && mask.segments.enabled();
  if (seg) LoadKeyIds(mask, k0, nk, nkp, w.kvid.data());
  const V vsl2 = VSplat(p.scale_log2), vscale = VSplat(p.scale), vpre = VSplat(cap.pre), vone = VSplat(1.0f);
  for (int i = 0; i < nqp; ++i) {
    float* __restrict pi = pt + i * ldk;
    float* __restrict dsi = ds + i * ldk;
    int jlo, jhi;
    RowSpan(mask, full, q0, i, nq, k0, nk, &jlo, &jhi);
    if (jhi <= jlo) {
      std::fill(pi, pi + nkp, 0.0f);
      std::fill(dsi, dsi + nkp, 0.0f);
      continue;
    }
    const V l2 = VSplat(w.lse2[i]), di = VSplat(w.dsum[i]);
    const I id = I{} + (seg ? mask.segments.q_ids[q0 + i] : 0);
    for (int j = 0; j < nkp; j += kW) {
      const I idx = Iota() + j;
      I visible = (idx >= jlo) & (idx < jhi);
      if (seg) visible &= ILoad(w.kvid.data() + j) == id;
      const V x = VLoad(pi + j);
      const V e = visible ? Exp2(x * vsl2 - l2) : V{};
      VStore(pi + j, e);
      V d = e * (VLoad(dsi + j) - di) * vscale;
      if (cap.enabled()) d *= vone - (vpre * x) * (vpre * x);  // d capped / d raw = 1 - tanh^2
      // Selected, not multiplied by e = 0: dP of a masked key is nan when its V is.
      VStore(dsi + j, visible ? d : V{});
    }
  }
}

// dK and dV of keys [k0, k0 + bk) of kv head kvh of batch b: sums over the group's query heads and the query rows
// that see the key block. With kFusedDq, also adds dS K into p.dq_accum (the caller owns those heads' rows).
template <typename T, bool kFusedDq>
void BackwardKeyBlock(const FlashParams& p, int b, int kvh, int k0, BwdScratch& w) {
  const int D = p.head_dim, ldd = w.ldd, ldk = w.ldk;
  const int G = p.group_size();
  const int64_t kv_rs = p.kv_row_stride();
  const int nk_block = std::min(w.bk, p.seqlen_k - k0);
  const int64_t kv_off = b * p.kv_batch_stride() + int64_t(k0) * kv_rs + int64_t(kvh) * D;
  T* dk = static_cast<T*>(p.dk) + kv_off;
  T* dv = static_cast<T*>(p.dv) + kv_off;
  const AttentionMask mask = mask_for_batch<SegmentMode::kAuto>(p, b);

  // Keys at or past seen_end, the end of the last row's visible keys (hi() never decreases), are seen by no row:
  // they are not loaded, so that their K and V never reach dQ, and get zero dK/dV.
  int seen_begin, seen_end;
  mask.key_range(0, p.seqlen_q, &seen_begin, &seen_end);
  int nk = std::clamp(seen_end - k0, 0, nk_block);
  int r0, r1;
  mask.row_range(k0, k0 + nk, &r0, &r1);
  r0 = std::max(r0, 0);
  r1 = std::min(r1, p.seqlen_q);
  if (r1 <= r0) nk = 0;  // no query row sees these keys
  StoreZeros(nk_block - nk, D, dk + nk * kv_rs, kv_rs);
  StoreZeros(nk_block - nk, D, dv + nk * kv_rs, kv_rs);
  if (nk == 0) return;
  const int nkp = RoundUp(nk, kNR);
  LoadKeySide<T>(p, b, kvh, k0, nk, nkp, kFusedDq, w);
  float* __restrict dka = w.dk.data();
  float* __restrict dva = w.dv.data();
  std::fill(dka, dka + size_t(nkp) * ldd, 0.0f);
  std::fill(dva, dva + size_t(nkp) * ldd, 0.0f);

  for (int g = 0; g < G; ++g) {
    const int h = kvh * G + g;
    for (int q0 = r0; q0 < r1; q0 += kBwdBlockQ) {
      const int nq = std::min(kBwdBlockQ, r1 - q0);
      const int nqp = RoundUp(nq, kMR);
      LoadQuerySide<T>(p, mask, b, h, q0, nq, nqp, w);
      BackwardTile(p, mask, q0, nq, nqp, k0, nk, nkp, w);
      GemmAdd(nkp, D, nqp, w.p.data(), 1, ldk, w.dout.data(), ldd, dva, ldd, w.tmp.data());  // dV += P^T dO
      GemmAdd(nkp, D, nqp, w.ds.data(), 1, ldk, w.q.data(), ldd, dka, ldd, w.tmp.data());    // dK += dS^T Q
      if constexpr (kFusedDq) {
        float* __restrict dqt = w.dq.data();
        Gemm(nqp, D, nkp, w.ds.data(), ldk, 1, w.k.data(), ldd, dqt, ldd);  // dS K
        float* dqa = p.dq_accum_of(b, h) + int64_t(q0) * p.head_dim_rounded;
        for (int i = 0; i < nq; ++i) {
          float* __restrict dst = dqa + int64_t(i) * p.head_dim_rounded;
          const float* __restrict src = dqt + int64_t(i) * ldd;
          for (int d = 0; d < D; d += kW) VStore(dst + d, VLoad(dst + d) + VLoad(src + d));
        }
      }
    }
  }
  StoreRows(dka, ldd, nk, D, 1.0f, dk, kv_rs);
  StoreRows(dva, ldd, nk, D, 1.0f, dv, kv_rs);
}

// Fused backward item: everything for (batch b, kv head kvh); owns dQ (and dsum) of the group's query heads.
template <typename T>
void BackwardFusedItem(const FlashParams& p, int64_t item, BwdScratch& w) {
  const int kvh = int(item % p.heads_kv);
  const int b = int(item / p.heads_kv);
  const int D = p.head_dim;
  const int G = p.group_size();
  const int64_t q_rs = p.q_row_stride();
  for (int g = 0; g < G; ++g) {
    const int h = kvh * G + g;
    ComputeRowStats<T>(p, b, h);
    float* dqa = p.dq_accum_of(b, h);
    std::fill(dqa, dqa + int64_t(p.seqlen_q) * p.head_dim_rounded, 0.0f);
  }
  for (int k0 = 0; k0 < p.seqlen_k; k0 += w.bk) BackwardKeyBlock<T, true>(p, b, kvh, k0, w);
  const AttentionMask mask = mask_for_batch<SegmentMode::kAuto>(p, b);
  for (int g = 0; g < G; ++g) {
    const int h = kvh * G + g;
    const int64_t off = b * p.q_batch_stride() + int64_t(h) * D;
    ZeroRowsThatSeeNoKey(p, mask, 0, p.seqlen_q, p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q,
                         p.dq_accum_of(b, h), p.head_dim_rounded);
    StoreRows(p.dq_accum_of(b, h), p.head_dim_rounded, p.seqlen_q, D, 1.0f, static_cast<T*>(p.dq) + off, q_rs);
  }
}

// Split backward, dK/dV pass: one (batch, kv head, key block) item.
template <typename T>
void BackwardDkvItem(const FlashParams& p, int64_t item, BwdScratch& w) {
  const int nkb = CeilDiv(p.seqlen_k, w.bk);
  const int kb = int(item % nkb);
  const int kvh = int(item / nkb % p.heads_kv);
  const int b = int(item / nkb / p.heads_kv);
  BackwardKeyBlock<T, false>(p, b, kvh, kb * w.bk, w);
}

// Split backward, dQ pass: one (batch b, query head h, query block) item over the key blocks from key_range.
template <typename T>
void BackwardDqItem(const FlashParams& p, int64_t item, BwdScratch& w) {
  const int nqb = CeilDiv(p.seqlen_q, kBwdBlockQ);
  const int qb = int(item % nqb);
  const int h = int(item / nqb % p.heads_q);
  const int b = int(item / nqb / p.heads_q);
  const int kvh = h / p.group_size();
  const int D = p.head_dim, ldd = w.ldd;
  const int64_t q_rs = p.q_row_stride();
  const int q0 = qb * kBwdBlockQ;
  const int nq = std::min(kBwdBlockQ, p.seqlen_q - q0);
  const int nqp = RoundUp(nq, kMR);
  const AttentionMask mask = mask_for_batch<SegmentMode::kAuto>(p, b);
  const int64_t q_off = b * p.q_batch_stride() + int64_t(q0) * q_rs + int64_t(h) * D;
  float* __restrict dqa = w.dq.data();
  std::fill(dqa, dqa + size_t(nqp) * ldd, 0.0f);

  int kb0, kb1;
  mask.key_range(q0, q0 + nq, &kb0, &kb1);
  kb0 = std::max(kb0, 0);
  kb1 = std::min(kb1, p.seqlen_k);
  if (kb1 > kb0) {
    LoadQuerySide<T>(p, mask, b, h, q0, nq, nqp, w);
    for (int k0 = kb0; k0 < kb1; k0 += w.bk) {
      const int nk = std::min(w.bk, kb1 - k0);
      const int nkp = RoundUp(nk, kNR);
      LoadKeySide<T>(p, b, kvh, k0, nk, nkp, true, w);
      BackwardTile(p, mask, q0, nq, nqp, k0, nk, nkp, w);
      GemmAdd(nqp, D, nkp, w.ds.data(), w.ldk, 1, w.k.data(), ldd, dqa, ldd, w.tmp.data());  // dQ += dS K
    }
  }
  ZeroRowsThatSeeNoKey(p, mask, q0, nq, p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q + q0, dqa, ldd);
  StoreRows(dqa, ldd, nq, D, 1.0f, static_cast<T*>(p.dq) + q_off, q_rs);
}

#endif  // JF_KERNELS
