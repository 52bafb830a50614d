// sm_90a wgmma decode kernel for head dims padded to 128 (one translation unit per class keeps builds parallel).
#include "kernels/sm90/launch_decode_sm90.cuh"

namespace jax_flash {
JAX_FLASH_INSTANTIATE_DECODE_SM90(__nv_bfloat16, 128)
JAX_FLASH_INSTANTIATE_DECODE_SM90(__half, 128)
}  // namespace jax_flash
