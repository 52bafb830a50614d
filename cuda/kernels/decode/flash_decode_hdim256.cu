// Decode kernels for head dims padded to 256 (one translation unit per class keeps builds parallel).
#include "kernels/decode/launch_decode.cuh"

namespace jax_flash {
JAX_FLASH_INSTANTIATE_DECODE(__nv_bfloat16, 256)
JAX_FLASH_INSTANTIATE_DECODE(__half, 256)
}  // namespace jax_flash
