// CUDA_CHECK(call): the standalone GPU tools' check of a CUDA runtime call: on an error, prints where, the call and
// the error, and exits 1.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CUDA_CHECK(...)                                                                             \
  do {                                                                                              \
    const cudaError_t err_ = (__VA_ARGS__);                                                         \
    if (err_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__, #__VA_ARGS__,              \
                   cudaGetErrorString(err_));                                                       \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)
