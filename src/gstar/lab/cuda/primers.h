// Host launchers of the CUDA primers. Plain C++ over raw pointers (no torch headers), so that the kernel
// sources compile standalone with nvcc; binding.cpp adapts them to torch tensors.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

enum GstarDtype { GSTAR_FLOAT32 = 0, GSTAR_FLOAT16 = 1, GSTAR_BFLOAT16 = 2 };

// out[i] = a[i * stride_a] + b[i * stride_b] for i < n; out is contiguous. Strides are in elements.
cudaError_t gstar_vector_add(const void* a, int64_t stride_a, const void* b, int64_t stride_b, void* out,
                             int64_t n, GstarDtype dtype, cudaStream_t stream);

// out[r, c] = a[r, c] + b[r, c] for an (m, n) matrix; out is contiguous (row stride n). Strides in elements.
cudaError_t gstar_matrix_add(const void* a, int64_t stride_a0, int64_t stride_a1, const void* b,
                             int64_t stride_b0, int64_t stride_b1, void* out, int64_t m, int64_t n,
                             GstarDtype dtype, cudaStream_t stream);
