// 2^x computed on the FMA pipe instead of the MUFU unit (ex2.approx), for soft-capped kernels whose scores each take
// two MUFU operations (tanh, then ex2): the sm_90a backward at head dims 64 and 128 computes every k-th tile's
// exponentials here (probs_from_scores, BwdTraitsSm90::kCapExpOnFmaEvery), and the d64 three-warpgroup forward every
// 4th tile's (FwdWideTraitsSm90<64>::kCapExpOnFmaEvery), where MUFU work is twice the tensor time. Elsewhere the
// capped forward got slower with it (NOTES, sessions 8-38 and 66): each FMA-pipe instruction a score on its softmax
// path costs time there.
//
// x = j + f with j = round(x) (the 1.5 * 2^23 addition rounds to nearest), |f| <= 1/2; 2^f by a degree-3
// polynomial with 2^0 = 1 exactly (largest relative error 1.0e-4 over [-1/2, 1/2], below bfloat16's 2^-9 rounding of
// P and float16's of dS); 2^j built in a float's exponent field and multiplied in, so NaN stays NaN. x <= -127
// (and -inf, a masked score) gives +0 exactly: j = -127, f = 0 make the scale's bits 0. Arguments above 127 do not
// occur: softmax arguments are scores minus their row's maximum or log-sum-exp (<= 0 up to rounding).
#pragma once

#include <cuda_runtime.h>

namespace jax_flash::cuda {

__device__ __forceinline__ float exp2_fma(float x) {
  float xc;  // max(x, -127), NaN kept (fmaxf would drop it)
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(xc) : "f"(x), "f"(-127.f));
  constexpr float kRound = 12582912.f;  // 1.5 * 2^23: xc + kRound holds round(xc) in its low mantissa bits
  const float r = xc + kRound;
  const float f = xc - (r - kRound);
  const float p = fmaf(fmaf(fmaf(0.05500863f, f, 0.24221043f), f, 0.69328302f), f, 1.f);
  const float scale = __uint_as_float((__float_as_uint(r) << 23) + 0x3f800000u);  // 2^round(xc)
  return p * scale;
}

// Whether a softmax takes the exponentials of its 8-column tile j on the FMA pipe when every k-th tile does (the
// last of each k; k = 0: none). A constant expression for the unrolled loops that ask it.
template <int k>
__host__ __device__ constexpr bool exp_tile_on_fma(int j) {
  return k > 0 && j % (k > 0 ? k : 1) == k - 1;
}

}  // namespace jax_flash::cuda
