// CPU FlashAttention: the same tiled online-softmax algorithm as the CUDA kernels, fp32 accumulation.
#pragma once

#include "../flash_params.h"

namespace jax_flash::cpu {

// Reads p.q, p.k, p.v; writes p.o and p.lse ([batch, heads_q, seqlen_q]; +inf for rows that see no key, nan or
// -inf for rows whose visible logits are nan, +inf or all -inf: see attention_cpu.cc).
void FlashForward(const FlashParams& p);

// Reads p.q, p.k, p.v, p.o, p.lse, p.dout; writes p.dq, p.dk, p.dv. p.dq_accum and p.dsum are float32 workspace.
void FlashBackward(const FlashParams& p);

}  // namespace jax_flash::cpu
