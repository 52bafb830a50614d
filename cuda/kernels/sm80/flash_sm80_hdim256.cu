// sm_80-class kernels for head dims padded to 256 (one translation unit per class keeps builds parallel).
#include "kernels/sm80/launch_sm80.cuh"

namespace jax_flash {
JAX_FLASH_INSTANTIATE_SM80(__nv_bfloat16, 256)
JAX_FLASH_INSTANTIATE_SM80(__half, 256)
JAX_FLASH_INSTANTIATE_SM80_SMEM(256)
}  // namespace jax_flash
