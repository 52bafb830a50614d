// sm_80-class kernels for head dims padded to 128 (one translation unit per class keeps builds parallel).
#include "kernels/sm80/launch_sm80.cuh"

namespace jax_flash {
JAX_FLASH_INSTANTIATE_SM80(__nv_bfloat16, 128)
JAX_FLASH_INSTANTIATE_SM80(__half, 128)
JAX_FLASH_INSTANTIATE_SM80_SMEM(128)
}  // namespace jax_flash
