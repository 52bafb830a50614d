// Logit soft-capping as a small policy shared by the CPU and CUDA kernels (FlashParams::softcap_pre/_post).
//
// A kernel computes raw scores s = q.k and folds the scale into exp2 later. With a cap c it replaces s by
// post * tanh(pre * s) (pre = scale / c, post = c / scale), so the logit scale * s becomes c * tanh(scale * q.k / c)
// and everything after (row maxima, exp2, the log-sum-exp) is unchanged. Backward: d capped / d s = 1 - t^2 with
// t = tanh(pre * s) = pre * capped (pre * post = 1). The CUDA kernels use the hardware tanh (tanh.approx.f32,
// relative error below 2^-10.9, as FlashAttention's soft-cap does); the CPU kernel std::tanh.
#pragma once

#include <cmath>

#include "flash_params.h"

namespace jax_flash {

JF_HD float tanh_fast(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::tanh(x);
#endif
}

struct SoftCap {
  float pre;
  float post;
  JF_HD explicit SoftCap(const FlashParams& p) : pre(p.softcap_pre), post(p.softcap_post) {}
  JF_HD bool enabled() const { return pre != 0.f; }
  // The capped score of raw score s, and the tanh it is post times.
  JF_HD float apply(float s) const { return post * tanh_of(s); }
  JF_HD float tanh_of(float s) const { return tanh_fast(pre * s); }
  // The same of a score that holds pre * s already when pre_in_s (an operand was scaled by pre in shared memory:
  // kernels/sm90/scaled_operand_sm90.cuh).
  JF_HD float tanh_of(float s, bool pre_in_s) const { return pre_in_s ? tanh_fast(s) : tanh_of(s); }
  // d capped / d s from the capped score.
  JF_HD float dtanh(float capped) const {
    const float t = pre * capped;
    return 1.f - t * t;
  }

  // Exponentials against a fixed reference (the sm_90a forward's capped variant without a running maximum). A
  // capped logit lies in [-c, c], so in the log2 domain x = t * A with A = c log2(e) (= post * scale_log2) lies in
  // [-A, A]. Taken as 2^(x - R) for a fixed R, the exponentials need no row maximum and O no rescaling, provided
  // none overflows and a row's largest term stays a normal float with room below it. R = min(A, L - A), with
  // L = kFixedReferenceFloor = 100, gives x - R <= max(0, 2A - L) and a largest term >= 2^(-A - R) >= 2^-L (terms
  // up to 2^-26 below it stay normal floats, in float32 and in P's bfloat16 form alike; float16's range is far too
  // short, so float16 calls keep the running maximum: launch_fwd_sm90); with A <=
  // kFixedReferenceMaxBound the terms are <= 2^64, so a row's sum and its P V products stay finite wherever
  // |v| * keys < 2^64.
  static constexpr float kFixedReferenceFloor = 100.f;
  static constexpr float kFixedReferenceMaxBound = (kFixedReferenceFloor + 64.f) / 2;  // 82: c <= 56.8
  // A = c log2(e): the largest |capped logit| in the log2 domain, which is also the capped scores' exponent scale.
  JF_HD float log2_bound(float scale_log2) const { return post * scale_log2; }
  JF_HD bool fixed_reference_holds(float scale_log2) const {
    return enabled() && log2_bound(scale_log2) <= kFixedReferenceMaxBound;
  }
  JF_HD static float fixed_reference(float log2_bound) {
    return fminf(log2_bound, kFixedReferenceFloor - log2_bound);
  }
};

}  // namespace jax_flash
