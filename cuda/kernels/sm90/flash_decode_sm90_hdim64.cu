// sm_90a wgmma decode kernel for head dims padded to 64 (one translation unit per class keeps builds parallel).
#include "kernels/sm90/launch_decode_sm90.cuh"

namespace jax_flash {
JAX_FLASH_INSTANTIATE_DECODE_SM90(__nv_bfloat16, 64)
JAX_FLASH_INSTANTIATE_DECODE_SM90(__half, 64)
}  // namespace jax_flash
