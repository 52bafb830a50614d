// Host entry points of the CUDA kernels. They pick a kernel by compute capability, dtype and head dim, launch it on
// `stream` and return the first CUDA error (never synchronising).
#pragma once

#include <cuda_runtime.h>

#include "../flash_params.h"

namespace jax_flash::cuda {

// Writes p.o and p.lse. Needs compute capability >= 8.0 and bf16/fp16 inputs.
cudaError_t RunFlashForward(const FlashParams& p, cudaStream_t stream);

// Writes p.dq, p.dk, p.dv, using p.dq_accum and p.dsum as workspace.
cudaError_t RunFlashBackward(const FlashParams& p, cudaStream_t stream);

// Empty string when `p` can run on the current device; otherwise why not.
const char* UnsupportedReason(const FlashParams& p);

// Why this backward call cannot run as asked ("" if it can): deterministic=True needs the sm_90a backward.
const char* BackwardUnsupportedReason(const FlashParams& p);

}  // namespace jax_flash::cuda
