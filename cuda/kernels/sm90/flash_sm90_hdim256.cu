// sm_90a kernels for head dims padded to 256 (one translation unit per class keeps builds parallel).
#include "kernels/sm90/launch_sm90.cuh"

namespace jax_flash {
JAX_FLASH_INSTANTIATE_SM90(__nv_bfloat16, 256)
JAX_FLASH_INSTANTIATE_SM90(__half, 256)
JAX_FLASH_INSTANTIATE_SM90_BWD(__nv_bfloat16, 256)
JAX_FLASH_INSTANTIATE_SM90_BWD(__half, 256)
}  // namespace jax_flash
