// Host entry points of the CUDA kernels. They pick a kernel by compute capability, dtype, head dim and the
// requested kernel family, launch it on `stream` and return the first CUDA error (never synchronising).
#pragma once

#include <cuda_runtime.h>

#include "flash_params.h"

namespace jax_flash::cuda {

// Writes p.o and p.lse. Needs compute capability >= 8.0 and bf16/fp16 inputs.
cudaError_t RunFlashForward(const FlashParams& p, KernelChoice choice, cudaStream_t stream);

// Writes p.dq, p.dk, p.dv, using p.dq_accum and p.row_stats as workspace.
cudaError_t RunFlashBackward(const FlashParams& p, KernelChoice choice, cudaStream_t stream);

// Decode (few query rows against a dense or paged cache, split-KV): writes p.o and p.lse, using p.o_partial and
// p.lse_partial as workspace. At most kMaxDecodeRows packed query rows (heads per kv head x Tq). On compute
// capability 9.0 (unless `choice` asks for the sm_80 class) calls of more than 32 packed rows at head dims up to 128
// run an sm_90a kernel (the TMA one for 65-128 rows over dense or paged caches, else the cp.async wgmma one), all
// others the mma.sync one.
inline constexpr int kMaxDecodeRows = 128;
cudaError_t RunFlashDecode(const FlashParams& p, KernelChoice choice, cudaStream_t stream);
// Empty string when the decode kernels can run `p` on the current device; otherwise why not.
const char* DecodeUnsupportedReason(const FlashParams& p, KernelChoice choice);
// The split kernel's dynamic shared memory (bytes) and threads per block that a decode call of `packed_rows` rows at
// `head_dim` runs with on the current device ({0, 0} past kMaxDecodeRows): the split count is sized from them.
struct DecodeLaunchShape {
  int smem_bytes;
  int threads;
};
DecodeLaunchShape GetDecodeLaunchShape(int head_dim, int packed_rows, KernelChoice choice);
// Whether that split kernel fits the current device's shared memory per block (kSm80SmallSmem: as on a device of
// 99 KB). Above head dim 64 the sm_80-class kernel's rings take more than sm_86 / sm_89 GPUs have, and the Python
// side runs the attention kernel instead. True where no device answers (nothing runs there).
bool DecodeFitsDevice(int head_dim, int packed_rows, KernelChoice choice);

// Empty string when `p` can run on the current device; otherwise why not.
const char* UnsupportedReason(const FlashParams& p);

// Whether the attention kernel a forward (or backward) call at `head_dim` runs fits the current device's shared
// memory per block (kSm80SmallSmem: as on a device of 99 KB). The sm_90a kernels fit the devices they run on; the
// sm_80-class ones at head dim 256 do not fit everywhere: the forward takes 128 KB (sm_86 / sm_89 have 99), the
// backward's main kernel 201 KB (sm_80 has 163). The Python side runs its XLA path there. True where no device
// answers (nothing runs there).
bool AttentionFitsDevice(int head_dim, bool backward, KernelChoice choice);
// The sm_80-class forward's (or backward main kernel's) dynamic shared memory per block at head_dim on a device whose
// opt-in limit is smem_optin_bytes (which picks the backward's kernel).
int Sm80SmemBytes(int head_dim, bool backward, int smem_optin_bytes);

// Why this forward call cannot run as asked ("" if it can): the kernel's shared memory (AttentionFitsDevice).
const char* ForwardUnsupportedReason(const FlashParams& p, KernelChoice choice);

// Why this backward call cannot run as asked ("" if it can): deterministic=True needs the sm_90a backward; the
// kernel's shared memory (AttentionFitsDevice).
const char* BackwardUnsupportedReason(const FlashParams& p, KernelChoice choice);

// The launchers flash_api.cu dispatches to, one explicit instantiation per (dtype, head-dim class 64 / 128 / 256)
// in sm80/flash_sm80_hdim*.cu and sm90/flash_sm90_hdim*.cu.
template <typename T, int kD>
cudaError_t launch_fwd_sm80(const FlashParams& p, cudaStream_t stream);
// smem_optin_bytes: the device's opt-in shared memory per block, which picks between the two sm_80-class backwards.
template <typename T, int kD>
cudaError_t launch_bwd_sm80(const FlashParams& p, cudaStream_t stream, int smem_optin_bytes);
// Dynamic shared memory per block of the sm_80-class forward, or of the backward main kernel launch_bwd_sm80 picks
// for `smem_optin_bytes` (bfloat16 and float16 alike), at head-dim class kD; instantiated beside the launchers.
template <int kD>
int sm80_smem_bytes(bool backward, int smem_optin_bytes);

template <typename T, int kD>
cudaError_t launch_decode(const FlashParams& p, cudaStream_t stream);

namespace sm90 {
template <typename T, int kD>
cudaError_t launch_fwd_sm90(const FlashParams& p, cudaStream_t stream);
template <typename T, int kD>
cudaError_t launch_decode_wgmma(const FlashParams& p, cudaStream_t stream);
template <typename T, int kD>
cudaError_t launch_decode_tma(const FlashParams& p, cudaStream_t stream);
template <typename T, int kD>
cudaError_t launch_bwd_sm90(const FlashParams& p, cudaStream_t stream);
}  // namespace sm90

}  // namespace jax_flash::cuda
