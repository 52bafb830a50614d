// Pieces of the sm_90a backward kernels: the soft cap's score and derivative loops (both kernels, cap_scores and
// scale_by_cap_derivative); P^T and dS^T from the S^T and dP^T accumulators of a 64-key wgmma (m64nNk16 layout:
// column tile j holds keys g and g + 8 of the warp's 16 rows, queries 8 j + 2 t and 8 j + 2 t + 1), for the d64/d128
// kernel (the d256 kernel computes S and dP with the queries as rows and masks them itself). The producer's key-block
// loads are tma_loads_sm90.cuh's.
#pragma once

#include <type_traits>

#include "flash_params.h"
#include "kernels/common/element_traits.cuh"
#include "kernels/common/exp2_fma.cuh"
#include "kernels/sm90/kernel_traits_sm90.h"  // kColBlock
#include "kernels/sm90/tma_loads_sm90.cuh"     // load_key_block_rows
#include "kernels/sm90/utils_sm90.cuh"        // kWarpRows, TMA
#include "mask.h"
#include "score_mod.h"

namespace jax_flash::cuda::sm90 {

// Soft cap of a score accumulator in place: s -> post * t (kKeepPost: the capped score) or t itself (the caller
// folds post into the exponent's scale, SoftCap::log2_bound), t = tanh(pre * s) with SoftCap's pre = scale / c and
// post = c / scale; each pair's d capped / d s = 1 - t^2 goes to dcap as a pair of T (formed in float32, so T's
// rounding of it is relative while it is a normal number of T) for the dS product.
template <typename T, bool kKeepPost, int kPairs>
__device__ __forceinline__ void cap_scores(float (&acc)[kPairs * 2], uint32_t (&dcap)[kPairs], const SoftCap& cap) {
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const float t0 = cap.tanh_of(acc[2 * i]);
    const float t1 = cap.tanh_of(acc[2 * i + 1]);
    acc[2 * i] = kKeepPost ? cap.post * t0 : t0;
    acc[2 * i + 1] = kKeepPost ? cap.post * t1 : t1;
    dcap[i] = ElemTraits<T>::pack(1.f - t0 * t0, 1.f - t1 * t1);
  }
}

// dS times cap_scores' dcap (pairs of T), in place.
template <typename T, int kPairs>
__device__ __forceinline__ void scale_by_cap_derivative(float (&acc)[kPairs * 2], const uint32_t (&dcap)[kPairs]) {
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const float2 d = ElemTraits<T>::unpack(dcap[i]);
    acc[2 * i] *= d.x;
    acc[2 * i + 1] *= d.y;
  }
}

// Zero in place where the mask hides the pair: entry e of column tile j of a 64-key accumulator is key
// key0 + g + 8 (e / 2) (key0: the first of the warp's 16 keys), query query0 + 8 j + 2 t + e % 2. A select, so a
// hidden pair is exactly 0 whatever the accumulator held (nan included). With `ids` (TileMasking::kIds) segment
// ids are compared where the interval admits the pair (the clamped loads stay in range elsewhere).
template <int kSTiles>
__device__ __forceinline__ void zero_hidden_pairs(float (&acc)[kSTiles * 4], const AttentionMask& mask, int query0,
                                                  int key0, int g, int t, bool ids) {
  const SegmentPolicy& seg = mask.segments;
  ids = ids && seg.enabled();  // (compile-time false in kernels without segment ids)
  int key_row_lo[2], key_row_hi[2];  // queries that see this thread's two keys
  int32_t key_id[2] = {0, 0};
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mask.rows_seeing_key(key0 + g + 8 * r, &key_row_lo[r], &key_row_hi[r]);
    if (ids) key_id[r] = seg.kv_ids[imax(imin(key0 + g + 8 * r, mask.length.kv_len - 1), 0)];
  }
#pragma unroll
  for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int m = query0 + 8 * j + 2 * t + (e & 1);
      bool seen = m >= key_row_lo[e >> 1] && m < key_row_hi[e >> 1];
      if (ids) seen = seen && seg.q_ids[imax(imin(m, mask.length.q_len - 1), 0)] == key_id[e >> 1];
      acc[4 * j + e] = seen ? acc[4 * j + e] : 0.f;
    }
  }
}

// P^T = exp2(S^T * scale_log2 - lse * log2(e)) in place (with a cap, S^T becomes t = tanh(pre * S^T) first and
// post goes into the exponent's scale), zero where the mask hides the pair (query0, key0 as for zero_hidden_pairs).
// With a cap, dcap receives each pair's d capped / d s = 1 - t^2 as a pair of T (cap_scores), for dscores_from_probs
// and pack_dscores: no second transcendental to recover it from P^T. Returns what the tile needed of the masks, as
// masking() answers it (the whole warp asks: AttentionMask::tile_masking_warp for this tile's rows and keys, of
// `mask` or of a mask that hides the same pairs with cheaper hooks); dscores_from_probs then zeroes the hidden pairs'
// dS^T too.
// kCap: the call has a soft cap (compiled out otherwise: dcap would be live registers across the dP^T wait in
// every call). kExpOnFmaEvery: every k-th 8-column tile's exponentials on the FMA pipe (exp2_fma; 0: none), for a
// capped call of the head-dim-64/128 kernel, whose tanh and exp2 queue two MUFU operations per score on the path to
// dS^T (BwdTraitsSm90::kCapExpOnFmaEvery; the head-dim-256 kernel was 1 % slower with half, the plain kernels 1-7 %:
// NOTES, session 27).
template <typename T, int kSTiles, bool kCap, int kExpOnFmaEvery = 0, typename Masking>
__device__ __forceinline__ TileMasking probs_from_scores(float (&acc_s)[kSTiles * 4], uint32_t (&dcap)[kSTiles * 2],
                                                         const float2 (&lse_log2)[kSTiles], float scale_log2,
                                                         const SoftCap& cap, const AttentionMask& mask,
                                                         Masking&& masking, int query0, int key0, int g, int t) {
  if constexpr (kCap) {
    cap_scores<T, false, kSTiles * 2>(acc_s, dcap, cap);
    scale_log2 = cap.log2_bound(scale_log2);
  }
#pragma unroll
  for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = acc_s[4 * j + e] * scale_log2 - ((e & 1) ? lse_log2[j].y : lse_log2[j].x);
      acc_s[4 * j + e] = exp_tile_on_fma<kExpOnFmaEvery>(j) ? exp2_fma(x) : exp2f(x);
    }
  }
  const TileMasking how = masking();
  if (how != TileMasking::kNone) zero_hidden_pairs<kSTiles>(acc_s, mask, query0, key0, g, t, how == TileMasking::kIds);
  return how;
}

// Whether a capped kernel of element type T multiplies dS^T by 1 - t^2 after packing it (pack_dscores: one packed
// multiply a pair, bfloat16's range being float32's) rather than in float32 before (float16, so that a dS^T past its
// range whose capped product fits stays finite).
template <typename T>
inline constexpr bool kPackedCapProduct = std::is_same_v<T, __nv_bfloat16>;

// dS^T = P^T * (dP^T - dsum) in place of dP^T, times probs_from_scores' dcap with a cap (in float32 in a masked tile
// or without kPackedCapProduct; else pack_dscores applies it, and a masked tile hands it ones), then in a masked
// tile (`how` as for probs_from_scores; the same query0, key0) exactly 0 where the mask hides the pair, as jax.nn's
// gradient of its masking select is, even where dP^T, dsum or the score is not finite (a row whose output is nan).
template <typename T, int kSTiles, bool kCap>
__device__ __forceinline__ void dscores_from_probs(float (&acc_dp)[kSTiles * 4], const float (&acc_s)[kSTiles * 4],
                                                   const float2 (&dsum)[kSTiles], uint32_t (&dcap)[kSTiles * 2],
                                                   TileMasking how, const AttentionMask& mask, int query0, int key0,
                                                   int g, int t) {
#pragma unroll
  for (int j = 0; j < kSTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc_dp[4 * j + e] = acc_s[4 * j + e] * (acc_dp[4 * j + e] - ((e & 1) ? dsum[j].y : dsum[j].x));
    }
  }
  if constexpr (kCap) {
    if (!kPackedCapProduct<T> || how != TileMasking::kNone) scale_by_cap_derivative<T, kSTiles * 2>(acc_dp, dcap);
    if (kPackedCapProduct<T> && how != TileMasking::kNone) {
#pragma unroll
      for (int i = 0; i < kSTiles * 2; ++i) dcap[i] = ElemTraits<T>::pack(1.f, 1.f);  // pack_dscores: as they are
    }
  }
  if (how != TileMasking::kNone) zero_hidden_pairs<kSTiles>(acc_dp, mask, query0, key0, g, t, how == TileMasking::kIds);
}

// A packed pair of dS^T (elements lo, hi of the accumulator) for the wgmma A fragments, times its dcap pair where
// dscores_from_probs left that product to it (kPackedCapProduct).
template <typename T, bool kCap>
__device__ __forceinline__ uint32_t pack_dscores(float lo, float hi, uint32_t dcap) {
  const uint32_t ds = ElemTraits<T>::pack(lo, hi);
  if constexpr (kCap && kPackedCapProduct<T>) return ElemTraits<T>::mul(ds, dcap);
  return ds;
}

}  // namespace jax_flash::cuda::sm90
