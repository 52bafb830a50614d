// Issue 19's next decode lead needs arrival counters that stay zero between calls and belong to one custom-call
// instance (XLA's command buffers may run independent calls concurrently): per-instance XLA FFI state, created at
// the instantiate stage. This probe asks jaxlib whether that works on a GPU: the instantiate handler allocates and
// zeroes one int per instance (on the instance's device); the execute handler's one-thread kernel adds 1 to it and
// writes the new value. probe.py calls two instances per program several times: 1, 2, 3 in each means the state
// lives as long as the compiled program and is the instance's own. H200, jax 0.11.2 (session 57): so it is, with
// XLA's command buffers and without, a scan's one instance counting on across iterations and calls; the
// instantiate stage's DeviceOrdinal reads -1 there (the current device, 0, took the allocation), so a multi-GPU
// program has to find its device another way (not checked).
//   nvcc -O2 -std=c++17 -shared -Xcompiler -fPIC -I"$(python3 -c 'import jax; print(jax.ffi.include_dir())')" \
//     tools/ffi_state_probe/probe.cu -o /tmp/libffi_state_probe.so && python3 tools/ffi_state_probe/probe.py
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

struct ProbeState {
  static ffi::TypeId id;
  int32_t* counter = nullptr;
  ~ProbeState() {
    if (counter != nullptr) cudaFree(counter);
  }
};
ffi::TypeId ProbeState::id = {};
static const XLA_FFI_TypeInfo kProbeTypeInfo = ffi::MakeTypeInfo<ProbeState>();

static ffi::ErrorOr<std::unique_ptr<ProbeState>> Instantiate(int32_t device) {
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return ffi::Error::Internal("cudaGetDevice failed");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) return ffi::Error::Internal("cudaGetDeviceCount failed");
  std::fprintf(stderr, "probe instantiate: device ordinal %d (current device %d of %d)\n", device, previous, count);
  auto state = std::make_unique<ProbeState>();
  // (a device ordinal out of range: the current device)
  cudaError_t err = device >= 0 && device < count ? cudaSetDevice(device) : cudaSuccess;
  if (err == cudaSuccess) err = cudaMalloc(&state->counter, sizeof(int32_t));
  if (err == cudaSuccess) err = cudaMemset(state->counter, 0, sizeof(int32_t));
  cudaSetDevice(previous);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("instantiate: ") + cudaGetErrorString(err) + " (device ordinal " +
                                std::to_string(device) + ")");
  }
  return std::move(state);  // into ErrorOr: no implicit move before C++20
}

__global__ void bump(int32_t* counter, int32_t* out) { *out = atomicAdd(counter, 1) + 1; }

static ffi::Error Execute(cudaStream_t stream, ProbeState* state, ffi::AnyBuffer x,
                          ffi::Result<ffi::Buffer<ffi::S32>> out) {
  (void)x;
  bump<<<1, 1, 0, stream>>>(state->counter, out->typed_data());
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? ffi::Error::Success() : ffi::Error::Internal(cudaGetErrorString(err));
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate().Ctx<ffi::DeviceOrdinal>());  // the instance's device
XLA_FFI_DEFINE_HANDLER_SYMBOL(ProbeExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // the program's stream
                                  .Ctx<ffi::State<ProbeState>>()            // this instance's state
                                  .Arg<ffi::AnyBuffer>()                    // any input (orders the calls)
                                  .Ret<ffi::Buffer<ffi::S32>>(),            // the counter after this call
                              {ffi::Traits::kCmdBufferCompatible});

extern "C" void* probe_type_id() { return &ProbeState::id; }
extern "C" const void* probe_type_info() { return &kProbeTypeInfo; }
