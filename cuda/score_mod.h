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
  // d capped / d s from the capped score.
  JF_HD float dtanh(float capped) const {
    const float t = pre * capped;
    return 1.f - t * t;
  }
};

}  // namespace jax_flash
