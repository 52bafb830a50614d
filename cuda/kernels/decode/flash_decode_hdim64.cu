// Decode kernels for head dims padded to 64 (one translation unit per class keeps builds parallel).
#include "kernels/decode/launch_decode.cuh"

namespace jax_flash {
JAX_FLASH_INSTANTIATE_DECODE(__nv_bfloat16, 64)
JAX_FLASH_INSTANTIATE_DECODE(__half, 64)
}  // namespace jax_flash
