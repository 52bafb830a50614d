// The end of a row's online softmax, shared by every forward kernel: the factor that normalises the row's output
// and its log-sum-exp, with jax.nn's semantics for non-finite logits (as the CPU kernel has them):
//   sum > 0                  1 / sum, row_max * scale + log(sum)
//   the row sees no key      the output is exactly 0 (scaled() selects it: 0 x a nan value would be nan), +inf
//   every visible logit -inf nan (0 / 0), -inf
//   a nan or +inf logit      nan, nan (the sum is nan: exp of nan, or of +inf - +inf)
// row_max is the running maximum of the raw logits (fmaxf skips nan), sum the row's sum of exp2 values, taken
// relative to exp2(row_max * scale * log2 e) (relative to 1 while row_max is -inf).
// With a sink (its logit; -inf: none) the denominator also holds exp(sink), which has no value: a row that sees
// keys then has output acc * exp2(m - M) / (sum * exp2(m - M) + exp2(s - M)) (m, s the row maximum and the sink in
// the log2 domain, M their maximum: no overflow whatever the sink) and lse log(keys' mass + exp(sink)); every
// visible logit -inf gives 0 and lse = sink. A row that sees no key keeps 0 and +inf; nan stays nan.
#pragma once

#include <cmath>

#include "flash_params.h"  // JF_HD

namespace jax_flash::cuda {

struct RowFinish {
  float inv_sum;
  float lse;
  bool sees_a_key;
  // The row's output value for accumulator value `acc`.
  JF_HD float scaled(float acc) const { return sees_a_key ? acc * inv_sum : 0.f; }
};

JF_HD RowFinish finish_row(float row_max, float sum, float scale, bool sees_a_key, float sink = -INFINITY) {
  if (sink != -INFINITY && sees_a_key && sum >= 0.f) {  // sum >= 0: not nan
    const float m = row_max == -INFINITY ? 0.f : row_max * (scale * kLog2e);
    const float s = sink * kLog2e;
    const float top = fmaxf(m, s);
    const float keys_weight = exp2f(m - top);
    const float total = sum * keys_weight + exp2f(s - top);  // >= 1 (nan for a nan sink)
    return {keys_weight / total, (top + log2f(total)) * (1.f / kLog2e), true};
  }
  if (sum > 0.f) return {1.f / sum, row_max * scale + logf(sum), sees_a_key};
  if (!sees_a_key) return {0.f, INFINITY, false};
  return {NAN, sum == 0.f ? -INFINITY : NAN, true};
}

}  // namespace jax_flash::cuda
