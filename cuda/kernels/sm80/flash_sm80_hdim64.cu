// sm_80-class kernels for head dims padded to 64 (one translation unit per class keeps builds parallel).
#include "kernels/sm80/launch_sm80.cuh"

namespace jax_flash {
JAX_FLASH_INSTANTIATE_SM80(__nv_bfloat16, 64)
JAX_FLASH_INSTANTIATE_SM80(__half, 64)
JAX_FLASH_INSTANTIATE_SM80_SMEM(64)
}  // namespace jax_flash
