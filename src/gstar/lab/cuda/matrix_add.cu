// out = a + b for matrices of any shape and strides: rows on the y axis of the grid, VEC-wide column chunks
// on the x axis, so a row's accesses stay coalesced whatever the row stride.
#include <algorithm>

#include "chunks.cuh"

namespace {

constexpr int64_t kMaxGridY = 65535;  // CUDA's limit on gridDim.y: taller matrices loop over rows

// a, b: (m, n) with element strides (stride_*0, stride_*1) (stride_*1 == 1 when VEC > 1); out: (m, n)
// contiguous. blockDim = (bx, by) with bx * by = kThreads: narrow rows get several rows per block.
template <typename T, int VEC>
__global__ void __launch_bounds__(gstar::kThreads)
matrix_add_kernel(const T* __restrict__ a, int64_t stride_a0, int64_t stride_a1, const T* __restrict__ b,
                  int64_t stride_b0, int64_t stride_b1, T* __restrict__ out, int64_t m, int64_t n) {
    const int64_t chunk = static_cast<int64_t>(blockIdx.x) * gstar::kUnroll * blockDim.x + threadIdx.x;
    const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
    for (int64_t r = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; r < m; r += row_step)
        gstar::add_row_chunks<T, VEC>(a + r * stride_a0, stride_a1, b + r * stride_b0, stride_b1, out + r * n,
                                      chunk * VEC, blockDim.x, n);
}

}  // namespace

cudaError_t gstar_matrix_add(const void* a, int64_t stride_a0, int64_t stride_a1, const void* b,
                             int64_t stride_b0, int64_t stride_b1, void* out, int64_t m, int64_t n,
                             GstarDtype dtype, cudaStream_t stream) {
    if (m <= 0 || n <= 0) return cudaSuccess;
    const int64_t bytes = dtype == GSTAR_FLOAT32 ? 4 : 2;
    // 16-byte accesses need every row start aligned, not just the base pointers.
    const bool vectorize = stride_a1 == 1 && stride_b1 == 1 && gstar::aligned16(a) && gstar::aligned16(b) &&
                           gstar::aligned16(out) && (stride_a0 * bytes) % 16 == 0 &&
                           (stride_b0 * bytes) % 16 == 0 && (n * bytes) % 16 == 0;
    return gstar::dispatch(dtype, vectorize, [&](auto zero, auto vec) {
        using T = decltype(zero);
        constexpr int VEC = decltype(vec)::value;
        const int64_t chunks = (n + VEC - 1) / VEC;
        int bx = 32;  // a power of two in [32, kThreads] that covers a row in one unrolled pass if it can
        while (bx < gstar::kThreads && static_cast<int64_t>(bx) * gstar::kUnroll < chunks) bx *= 2;
        const int by = gstar::kThreads / bx;
        const int64_t blocks_x = (chunks + static_cast<int64_t>(bx) * gstar::kUnroll - 1) /
                                 (static_cast<int64_t>(bx) * gstar::kUnroll);
        const int64_t blocks_y = std::min<int64_t>((m + by - 1) / by, kMaxGridY);
        if (blocks_x > INT32_MAX) return cudaErrorInvalidValue;
        matrix_add_kernel<T, VEC><<<dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(blocks_y)),
                                    dim3(bx, by), 0, stream>>>(
            static_cast<const T*>(a), stride_a0, stride_a1, static_cast<const T*>(b), stride_b0, stride_b1,
            static_cast<T*>(out), m, n);
        return cudaGetLastError();
    });
}
