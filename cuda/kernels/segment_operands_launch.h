// Host entry point of the segment operands' CUDA kernels (segment_operands.cu; the contract in
// cuda/segment_operands.h). Never synchronises.
#pragma once

#include <cuda_runtime.h>

#include "segment_operands.h"

namespace jax_flash::cuda {

// Writes p's metadata and runs from its segment ids on `stream`: two small kernels.
cudaError_t RunSegmentOperands(const SegmentOperandsParams& p, cudaStream_t stream);

}  // namespace jax_flash::cuda
