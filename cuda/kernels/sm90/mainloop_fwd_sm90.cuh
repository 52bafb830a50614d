// The sm_90a forward's main loop in its two roles (FlashAttention-3's "collective mainloop"):
//   load(): the producer thread's TMA loads, tile after tile: Q once per tile, K and V through kStages-deep rings
//           (one PipelineState for both rings; a persistent CTA's rings run on across its tiles);
//   mma():  a consumer warpgroup's key-tile loop over one tile: S = Q K^T (both operands in shared memory) and
//           O += P V (P from registers) with wgmma, the online softmax with exp2 and the log2(e)-folded scale.
// Per key tile i a consumer warpgroup issues S_i and PV_{i-1} back to back and runs the softmax of S_i while PV_{i-1}
// is still on the tensor cores (intra-warpgroup overlap); with ping-pong the consumer warpgroups also take turns
// issuing, so one warpgroup's softmax overlaps the others' GEMMs.
// Consumer thread layout: warpgroup cw owns query rows [64 cw, 64 cw + 64) of the block; warp w of it, lane = 4 g + t,
// holds rows 16 w + g and 16 w + g + 8, columns 8 j + 2 t (+1) of every 8-wide column tile j of S and O.
#pragma once

#include <cmath>
#include <type_traits>

#include "flash_params.h"
#include "kernels/common/block_ranges.cuh"
#include "kernels/common/exp2_fma.cuh"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/warp_reduce.cuh"
#include "kernels/sm90/attention_gemms_sm90.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"
#include "kernels/sm90/named_barriers.h"
#include "kernels/sm90/pipeline.cuh"
#include "kernels/sm90/scaled_operand_sm90.cuh"
#include "kernels/sm90/smem_layout.h"
#include "kernels/sm90/tile_scheduler_fwd.cuh"
#include "kernels/sm90/tma_loads_sm90.cuh"
#include "kernels/sm90/utils_sm90.cuh"
#include "kernels/sm90/wgmma_sm90.cuh"
#include "mask.h"
#include "score_mod.h"

namespace jax_flash::cuda::sm90 {

// Ping-pong between kGroups consumer warpgroups: warpgroup cw waits on barrier kPingPongBarrier + cw before issuing
// its wgmma products, then releases the next one (cyclically). Every warpgroup takes the same number of turns for
// every tile (S_0, then (S_i, PV_{i-1}), then PV_{n-1}; a turn without products for a key tile none of its rows
// sees), so the turns go round across tiles; open() lets warpgroup 0 go
// first (the last warpgroup's arrival) and close() has warpgroup 0 take that arrival back after its last tile, so
// every barrier ends balanced. Without kEnabled every call is a no-op.
template <int kGroups, bool kEnabled>
struct PingPong {
  static constexpr int kPairThreads = 2 * kWarpgroupThreads;  // the waiting warpgroup and the one that releases it
  int cw;
  int my_turn;
  int their_turn;

  __device__ __forceinline__ explicit PingPong(int cw_)
      : cw(cw_),
        my_turn(kPingPongBarrier + cw_),
        their_turn(kPingPongBarrier + (kGroups == 2 ? cw_ ^ 1 : (cw_ + 1) % kGroups)) {}
  __device__ __forceinline__ void open() const {
    if constexpr (kEnabled) {
      if (cw == kGroups - 1) named_barrier_arrive(their_turn, kPairThreads);
    }
  }
  __device__ __forceinline__ void begin_issue() const {
    if constexpr (kEnabled) named_barrier_sync(my_turn, kPairThreads);
  }
  __device__ __forceinline__ void end_issue() const {
    if constexpr (kEnabled) named_barrier_arrive(their_turn, kPairThreads);
  }
  __device__ __forceinline__ void close() const {
    if constexpr (kEnabled) {
      if (cw == 0) named_barrier_sync(my_turn, kPairThreads);
    }
  }
};

// kSoftCap: the call has a logit soft cap (its tanh per score compiled in only then). kFixedReference (with a cap
// whose SoftCap::fixed_reference_holds): the exponentials are taken against a fixed reference instead of the
// running maximum, so the softmax has no row maxima and O no rescaling: each score's tanh and exp2 follow each other
// with nothing between the tile's 64 tanh and its 64 exp2 (a running maximum has to wait for every tanh first).
// kRowBounds: the masks' lo() and hi() load each row's bounds (RunPolicy, the forward's runs grid): each consumer
// thread loads its two rows' once per tile and keeps them (Accumulators::row_lo).
template <typename T, typename Traits, bool kSoftCap, bool kFixedReference = false, bool kRowBounds = false>
struct FwdMainloop {
  static_assert(kSoftCap || !kFixedReference, "a fixed reference needs the soft cap's bound");
  static constexpr int kD = Traits::kHeadDim;
  static constexpr int kBM = Traits::kBlockM;
  static constexpr int kBN = Traits::kBlockN;
  static constexpr int kStages = Traits::kStages;
  static constexpr int kSTiles = kBN / 8;  // 8-wide column tiles of S
  static constexpr int kOTiles = kD / 8;   // 8-wide column tiles of O
  static constexpr int kConsumerWarps = Traits::kConsumerWarpgroups * 4;
  static constexpr int kGroups = Traits::kConsumerWarpgroups;
  using ET = ElemTraits<T>;
  using Storage = typename Traits::SharedStorage;
  using KVState = PipelineState<kStages>;
  using QState = PipelineState<1>;
  using PingPongT = PingPong<kGroups, Traits::kPingPong && kGroups >= 2>;
  // With a bfloat16 soft cap on tiles that take it (Traits::kCapScaledQ) each consumer warpgroup multiplies its rows
  // of Q by the cap's pre once a tile (scaled_operand_sm90.cuh), so S holds the tanh's argument; float16 and the
  // other tiles keep the FMUL per score.
  static constexpr bool kScaledQ = kSoftCap && Traits::kCapScaledQ && std::is_same_v<T, __nv_bfloat16>;

  // Traits::kLazyRescale: how far (log2 units) a row's maximum may pass the exponentials' reference before it moves.
  static constexpr float kLazyLog2 = 8.f;
  // A consumer thread's results for one tile: O (64 rows x kD per warpgroup, accumulator layout) and the online
  // softmax's running max (raw logits when mma() returns; tanh values during a capped call's loop; with a fixed
  // reference, the reference as a raw logit, set when mma() returns) and per-lane partial sums of rows g and g + 8.
  struct Accumulators {
    float o[kOTiles * 4];
    float row_max[2];
    bool seen[2];  // with segment ids: the row saw some key (finish_row needs it; the interval masks tell otherwise)
    float row_sum[2];
    // With kRowBounds: rows g and g + 8's visible keys [lo, hi), loaded when mma() begins and read by its masked
    // steps and the epilogue (unused otherwise).
    static constexpr bool kHasRowBounds = kRowBounds;
    int row_lo[2];
    int row_hi[2];
  };

  const FlashParams& p;
  Storage& smem;  // its q_ring (Q of the current tile), k_ring and v_ring guard the loads

  // One thread, before the CTA's first barrier: every ring's slots are released by one arrival per consumer warp;
  // a K or V slot is filled by `kv_producer_arrivals` (the TMA producer's one, or a gather's one per thread).
  __device__ __forceinline__ void init_barriers(int kv_producer_arrivals = 1) const {
    smem.q_ring.init(kConsumerWarps);
    smem.k_ring.init(kConsumerWarps, kv_producer_arrivals);
    smem.v_ring.init(kConsumerWarps, kv_producer_arrivals);
  }

  // The key tiles [*n_begin, *n_begin + count) that some row of the query block starting at m0 sees (the threads
  // of a warp that ask together ask for the same m0: the producer thread alone, or a consumer warp).
  __device__ __forceinline__ int key_tiles(const AttentionMask& mask, int m0, int* n_begin) const {
    int n_end;
    key_tiles_for_rows<kBN, true>(mask, p, m0, imin(kBM, p.seqlen_q - m0), n_begin, &n_end);
    return imax(n_end - *n_begin, 0);
  }

  // ---- producer role: one thread issues every load, tile after tile --------------------------------------------
  // kSegments as for the kernel: the tiles' masks are the consumers'.
  template <SegmentMode kSegments, typename ForEachTile>
  __device__ __forceinline__ void load(const CUtensorMap* tm_q, const CUtensorMap* tm_k, const CUtensorMap* tm_v,
                                       ForEachTile&& for_each_tile) const {
    prefetch_tensor_map(tm_q);
    prefetch_tensor_map(tm_k);
    prefetch_tensor_map(tm_v);
    KVState kv;
    QState q;
    for_each_tile([&](const FwdTile& tile) {
      const int m0 = tile.m_block * kBM;
      int n_begin;
      const int n_tiles = key_tiles(kernel_mask_for_batch<kSegments>(p, tile.b), m0, &n_begin);
      if (n_tiles == 0) return;
      const int hk = tile.h / p.group_size();
      smem.q_ring.producer_acquire(q, Traits::kQBytes);  // the consumers are done with the previous tile's Q
#pragma unroll
      for (int cb = 0; cb < Traits::kColBlocks; ++cb) {
        tma_load_4d(smem.q + cb * kBM * kColBlock, tm_q, smem.q_ring.full_barrier(q), cb * kColBlock, m0, tile.h, tile.b);
      }
      q.advance();
      for (int i = 0; i < n_tiles; ++i, kv.advance()) load_kv_tile(tm_k, tm_v, kv, (n_begin + i) * kBN, hk, tile.b);
    });
  }

  // The producer's loads of the key tile from key n0 of kv head hk, batch element b, into ring position kv: K, then
  // V, each once its slot is free (the TMA decode kernel's producer takes it too).
  __device__ __forceinline__ void load_kv_tile(const CUtensorMap* tm_k, const CUtensorMap* tm_v, KVState kv, int n0,
                                               int hk, int b) const {
    const int s = kv.slot();
    smem.k_ring.producer_acquire(kv, Traits::kKVBytes);
    load_key_block_rows<kBN, Traits::kColBlocks, Traits::kKvReadOnce>(smem.k[s], tm_k, smem.k_ring.full_barrier(kv), n0,
                                                                      hk, b);
    smem.v_ring.producer_acquire(kv, Traits::kKVBytes);
    load_key_block_rows<kBN, Traits::kColBlocks, Traits::kKvReadOnce>(smem.v[s], tm_v, smem.v_ring.full_barrier(kv), n0,
                                                                      hk, b);
  }

  // ---- consumer role: the key-tile loop of one tile ----------------------------------------------------------
  // Consumer warpgroup cw, warp `warp` of it, lane `lane`; rows [m0, m0 + kBM) see key tiles [n_begin, n_begin +
  // n_tiles) (n_tiles > 0), and this warpgroup's own 64 rows the first n_mine of them (0 <= n_mine <= n_tiles;
  // n_tiles unless Traits::kWarpgroupKeyRange): it computes those and takes an empty ping-pong turn for each of the
  // rest (the turns go round as if it had computed them), releasing their ring slots once they have landed. kv and
  // q are this CTA's ring positions; both move on past the tile.
  // Mask: AttentionMask (the forward) or PackedRowsMask (the TMA decode kernel), asked with p.seqlen_q as the row
  // limit (the rows the call stores; rows at or past it never force masking). Two hooks, called by every consumer
  // thread (the forward's do nothing): landed() after each wait for K or V tiles and before the products that read
  // them are issued (the TMA decode kernel's paged caches, gathered with cp.async in the generic proxy, fence there
  // to wgmma's async proxy); before_pv(i, slot) once key tile i's V has landed in ring slot `slot` and before this
  // warpgroup issues its P V product (both warpgroups reach it at the same tile before either issues that product;
  // the hooks' one user, the TMA decode kernel, passes n_mine = n_tiles).
  template <typename Mask, typename Landed, typename BeforePv>
  __device__ __forceinline__ void mma(const Mask& mask, int m0, int n_begin, int n_tiles, int n_mine, int cw, int warp,
                                      int lane, const PingPongT& pingpong, KVState& kv, QState& q, Accumulators& acc,
                                      Landed&& landed, BeforePv&& before_pv) const {
    if constexpr (!Traits::kWarpgroupKeyRange) n_mine = n_tiles;
    const bool any_mine = !Traits::kWarpgroupKeyRange || n_mine > 0;  // (n_tiles > 0)
    const bool lane0 = lane == 0;
    const int g = lane / 4;
    const int t = lane % 4;
    const int warp_row0 = cw * kWgmmaM + warp * kWarpRows;  // first of this warp's 16 rows inside the block

    float acc_s[kSTiles * 4];        // S of the current key tile, then its exp2 values
    uint32_t a_p[kBN / kWgmmaK][4];  // P of the previous tile as wgmma A fragments (16 keys per step)

    // Q slice of this warpgroup: column block cb starts at q + cb * kBM * 64, its rows at 128-byte pitch.
    const uint32_t q_base = smem_addr(smem.q) + cw * kWgmmaM * kSwizzleBytes;
    constexpr uint32_t kQColBlockBytes = kBM * kSwizzleBytes;
    constexpr uint32_t kKVColBlockBytes = kBN * kSwizzleBytes;
    auto issue_s = [&](int slot) {  // S = Q K^T (64 x kBN), both operands in shared memory
      sm90::issue_qk<kBN, kD, T>(acc_s, q_base, kQColBlockBytes, smem_addr(smem.k[slot]), kKVColBlockBytes);
    };
    auto issue_pv = [&](int slot) {  // O += P V; V read N-major, 64-dim column blocks kKVColBlockBytes apart
      sm90::issue_pv<kBN, kD, T>(acc.o, a_p, smem_addr(smem.v[slot]), kKVColBlockBytes);
    };

    // What the warp's 16 rows (from row0) need of key tile n0's masks, in a masked step (`masked`, a compile-time
    // bool; unmasked steps need nothing). Asked right after the tile's S product is issued. With kRowBounds,
    // tile_masking_warp's interval test (runs have no ids) from the lanes that hold the warp's first row and its
    // last row below seqlen_q, which tile_masking_warp would load again.
    auto masking = [&](auto masked, int row0, int n0) {
      if constexpr (decltype(masked)::value) {
        if constexpr (kRowBounds) {
          const int last = imin(kWarpRows, p.seqlen_q - row0) - 1;  // warp-uniform
          const int lo_last = __shfl_sync(0xffffffffu, last >= 8 ? acc.row_lo[1] : acc.row_lo[0], 4 * (last & 7));
          const int hi_first = __shfl_sync(0xffffffffu, acc.row_hi[0], 0);
          const bool cover = last >= 0 && row0 + last < mask.length.q_len && lo_last <= n0 && hi_first >= n0 + kBN;
          return cover ? TileMasking::kNone : TileMasking::kInterval;
        }
        return mask.tile_masking_warp(row0, row0 + kWarpRows, n0, n0 + kBN, p.seqlen_q);
      } else {
        return TileMasking::kNone;
      }
    };

    // Soft-caps S (with a cap: S becomes tanh(pre * S), pre already in S with kScaledQ; the logits' scale folds post
    // in), masks it as `how` says (masking()'s answer for row0, n0), then the online-softmax update: S becomes exp2
    // values, the running max and sum move on; returns the factors that rescale O for rows g and g + 8. The running
    // max is kept in the units of S (tanh values with a cap; the end of mma() turns it back into raw logits). With a
    // fixed reference S becomes 2^(score_log2 * S - reference) and only the sums move on (no factors: O is never
    // rescaled).
    const SoftCap cap(p);
    const float score_log2 = kSoftCap ? cap.log2_bound(p.scale_log2) : p.scale_log2;
    [[maybe_unused]] const float reference = SoftCap::fixed_reference(score_log2);
    const SegmentPolicy& seg = mask.segments;
    [[maybe_unused]] const float wait_floor = -INFINITY * p.scale_log2;  // -inf (scale_log2 > 0), unknown to ptxas
    auto softmax = [&](auto masked, TileMasking how, int row0, int n0, float (&correction)[2]) {
      if constexpr (kSoftCap) {
#pragma unroll
        for (int i = 0; i < kSTiles * 4; ++i) acc_s[i] = cap.tanh_of(acc_s[i], kScaledQ);
      }
      if (masked && how != TileMasking::kNone) {
        int lo[2], hi[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          lo[r] = kRowBounds ? acc.row_lo[r] : mask.lo(row0 + g + 8 * r);
          hi[r] = kRowBounds ? acc.row_hi[r] : mask.hi(row0 + g + 8 * r);
        }
        if (seg.enabled() && how == TileMasking::kIds) {  // ids tested where the interval lets the pair through
          int32_t id[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) id[r] = seg.q_ids[imin(row0 + g + 8 * r, p.seqlen_q - 1)];
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int col = n0 + j * 8 + 2 * t + e;
              const int32_t key_id = seg.kv_ids[imin(col, p.seqlen_k - 1)];  // one load for both rows
#pragma unroll
              for (int r = 0; r < 2; ++r) {
                const bool shown = col >= lo[r] && col < hi[r] && key_id == id[r];
                acc.seen[r] |= shown;
                if (!shown) acc_s[4 * j + 2 * r + e] = -INFINITY;
              }
            }
          }
        } else {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if (seg.enabled()) acc.seen[r] |= imax(lo[r], n0) < imin(hi[r], n0 + kBN);  // one id: the interval's
#pragma unroll
            for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int col = n0 + j * 8 + 2 * t + e;
                if (col < lo[r] || col >= hi[r]) acc_s[4 * j + 2 * r + e] = -INFINITY;
              }
            }
          }
        }
      } else if (masked) {
        acc.seen[0] = acc.seen[1] = true;  // a fully visible tile (only masked steps run with segment ids)
      }
      if constexpr (kFixedReference) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float x = acc_s[4 * j + 2 * r + e] * score_log2 - reference;  // masked: -inf -> 0
              const float pe = exp_tile_on_fma<Traits::kCapExpOnFmaEvery>(j) ? exp2_fma(x) : exp2f(x);
              acc_s[4 * j + 2 * r + e] = pe;
              sum += pe;
            }
          }
          acc.row_sum[r] += sum;
        }
      } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float mx = acc.row_max[r];
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) mx = fmaxf(mx, fmaxf(acc_s[4 * j + 2 * r], acc_s[4 * j + 2 * r + 1]));
          mx = quad_max(mx);
          // With kLazyRescale the exponentials' reference (row_max) moves only when the row's maximum passes it by
          // more than 2^kLazyLog2 (a kept reference leaves this tile's terms at most 2^kLazyLog2, and O and the
          // sum, both relative to it, exact), so most steps have correction 1. A first tile (reference -inf: the
          // difference is +inf or nan) always moves it.
          const bool kept = Traits::kLazyRescale && (mx - acc.row_max[r]) * score_log2 <= kLazyLog2;
          if (kept) mx = acc.row_max[r];
          const float max_scaled = mx == -INFINITY ? 0.f : mx * score_log2;
          correction[r] = kept ? 1.f : exp2f(acc.row_max[r] * score_log2 - max_scaled);
          acc.row_max[r] = mx;
          float sum = 0.f;
#pragma unroll
          for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const float pe = exp2f(acc_s[4 * j + 2 * r + e] * score_log2 - max_scaled);
              acc_s[4 * j + 2 * r + e] = pe;
              sum += pe;
            }
          }
          acc.row_sum[r] = acc.row_sum[r] * correction[r] + sum;
        }
      }
    };
    auto rescale_o = [&](const float (&correction)[2]) {
#pragma unroll
      for (int j = 0; j < kOTiles; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc.o[4 * j + e] *= correction[e / 2];
      }
    };
    auto convert_p = [&] {  // 16 keys per step = S column tiles 2 kk and 2 kk + 1
#pragma unroll
      for (int kk = 0; kk < kBN / kWgmmaK; ++kk) {
#pragma unroll
        for (int q4 = 0; q4 < 4; ++q4) a_p[kk][q4] = ET::pack(acc_s[8 * kk + 2 * q4], acc_s[8 * kk + 2 * q4 + 1]);
      }
    };

#pragma unroll
    for (int i = 0; i < kOTiles * 4; ++i) acc.o[i] = 0.f;
    acc.row_max[0] = acc.row_max[1] = -INFINITY;
    acc.row_sum[0] = acc.row_sum[1] = 0.f;
    acc.seen[0] = acc.seen[1] = false;
    const int row0 = m0 + warp_row0;
    if constexpr (kRowBounds) {  // (their loads under the waits below)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        acc.row_lo[r] = mask.lo(row0 + g + 8 * r);
        acc.row_hi[r] = mask.hi(row0 + g + 8 * r);
      }
    }
    smem.q_ring.consumer_wait(q);
    if constexpr (kScaledQ) {
      scale_warpgroup_rows<Traits::kColBlocks, kBM>(smem.q, cw * kWgmmaM, cap.pre, warp * kWarpSize + lane,
                                                    kQScaledBarrier + cw);
    }

    float correction[2];
    if (any_mine) {
      // Key tile 0: S_0 alone. Key tile i sits at ring position kv + i.
      smem.k_ring.consumer_wait(kv);
      landed();
      pingpong.begin_issue();
      wgmma_fence();
      issue_s(kv.slot());
      pingpong.end_issue();
      const TileMasking how0 = masking(std::true_type{}, row0, n_begin * kBN);
      wgmma_wait<0>();
      fence_regs(acc_s);
      if (lane0) smem.k_ring.consumer_release(kv);
      softmax(std::true_type{}, how0, row0, n_begin * kBN, correction);
      convert_p();
    } else {  // S_0's turn, empty
      pingpong.begin_issue();
      pingpong.end_issue();
    }

    // Key tiles [full_begin, full_end) (from n_begin; the first one, already done, excluded) are visible to every
    // row of the block: their steps carry no mask code. This warpgroup's steps end at n_mine.
    int full_begin, full_end;
    mask.unmasked_blocks(m0, m0 + kBM, p.seqlen_q, kBN, n_begin, n_begin + n_tiles, &full_begin, &full_end);
    full_begin = imax(full_begin - n_begin, 1);
    full_end = imax(full_end - n_begin, full_begin);
    if constexpr (Traits::kWarpgroupKeyRange) {
      full_begin = imin(full_begin, n_mine);
      full_end = imin(full_end, n_mine);
    }
    auto step = [&](int i, auto masked) {
      const KVState ki = kv.ahead(i);        // S_i's K
      const KVState kp = kv.ahead(i - 1);    // PV_{i-1}'s V
      smem.k_ring.consumer_wait(ki);
      smem.v_ring.consumer_wait(kp);
      landed();
      before_pv(i - 1, kp.slot());
      pingpong.begin_issue();
      wgmma_fence();
      issue_s(ki.slot());
      issue_pv(kp.slot());
      pingpong.end_issue();
      const int n0 = (n_begin + i) * kBN;
      const TileMasking how = masking(masked, row0, n0);
      wgmma_wait<1>();  // S_i done; PV_{i-1} may still run
      fence_regs(acc_s);
      if (lane0) smem.k_ring.consumer_release(ki);
      softmax(masked, how, row0, n0, correction);
      // PV_{i-1} done: O and P's registers are free. ptxas hoists a plain wait to just after the row maximum's first
      // shuffle, so the exponentials run after PV_{i-1} has ended (NOTES, session 40); with kSoftmaxUnderPv the wait
      // follows the softmax (its row sums depend on every exponential) and they run under PV_{i-1}.
      if constexpr (Traits::kSoftmaxUnderPv) {
        wgmma_wait_after<0>(acc.row_sum[0] + acc.row_sum[1], wait_floor);
      } else {
        wgmma_wait<0>();
      }
      fence_regs(acc.o);
      fence_regs(a_p);
      if (lane0) smem.v_ring.consumer_release(kp);
      if constexpr (!kFixedReference) {  // (with kLazyRescale the warp skips it when none of its references moved)
        if (!Traits::kLazyRescale || __any_sync(0xffffffffu, correction[0] != 1.f || correction[1] != 1.f)) {
          rescale_o(correction);
        }
      }
      convert_p();
    };
    for (int i = 1; i < full_begin; ++i) step(i, std::true_type{});
    for (int i = full_begin; i < full_end; ++i) step(i, std::false_type{});
    for (int i = full_end; i < n_mine; ++i) step(i, std::true_type{});
    if (lane0) smem.q_ring.consumer_release(q);  // every S of the tile is done: the producer may load the next Q
    q.advance();

    // Last PV (of this warpgroup's last key tile).
    if (any_mine) {
      const KVState last = kv.ahead(n_mine - 1);
      smem.v_ring.consumer_wait(last);
      landed();
      before_pv(n_mine - 1, last.slot());
      pingpong.begin_issue();
      wgmma_fence();
      issue_pv(last.slot());
      pingpong.end_issue();
      wgmma_wait<0>();
      fence_regs(acc.o);
      fence_regs(a_p);
      if (lane0) smem.v_ring.consumer_release(last);
    }
    // The key tiles none of this warpgroup's rows sees: an empty turn each, then their K and V slots released once
    // loaded (an arrival before the load's would count toward the slot's previous use, which the other warpgroups
    // may still be reading).
    if constexpr (Traits::kWarpgroupKeyRange) {
      for (int i = n_mine; i < n_tiles; ++i) {
        pingpong.begin_issue();
        pingpong.end_issue();
        const KVState ki = kv.ahead(i);
        smem.k_ring.consumer_wait(ki);
        if (lane0) smem.k_ring.consumer_release(ki);
        smem.v_ring.consumer_wait(ki);
        if (lane0) smem.v_ring.consumer_release(ki);
      }
    }
    kv.advance(n_tiles);
    if constexpr (kFixedReference) {  // the sums are relative to 2^reference: reference / scale_log2 in raw logits
      acc.row_max[0] = acc.row_max[1] = reference / p.scale_log2;
    } else if constexpr (kSoftCap) {  // the running max back in raw logits (-inf and nan stay)
      acc.row_max[0] *= cap.post;
      acc.row_max[1] *= cap.post;
    }
  }
};

}  // namespace jax_flash::cuda::sm90
