// out = a + b for vectors of any length: the simplest memory-bound kernel (3 bytes moved per byte of a).
#include "chunks.cuh"

namespace {

// a, b: (n,) with element strides stride_a, stride_b (1 when VEC > 1); out: (n,) contiguous.
// Block k covers chunks [k * kUnroll * blockDim.x, (k + 1) * kUnroll * blockDim.x); at each unrolled step
// a warp touches adjacent chunks, so every access is coalesced.
template <typename T, int VEC>
__global__ void __launch_bounds__(gstar::kThreads)
vector_add_kernel(const T* __restrict__ a, int64_t stride_a, const T* __restrict__ b, int64_t stride_b,
                  T* __restrict__ out, int64_t n) {
    const int64_t chunk = static_cast<int64_t>(blockIdx.x) * gstar::kUnroll * blockDim.x + threadIdx.x;
    gstar::add_row_chunks<T, VEC>(a, stride_a, b, stride_b, out, chunk * VEC, blockDim.x, n);
}

}  // namespace

cudaError_t gstar_vector_add(const void* a, int64_t stride_a, const void* b, int64_t stride_b, void* out,
                             int64_t n, GstarDtype dtype, cudaStream_t stream) {
    if (n <= 0) return cudaSuccess;
    const bool vectorize = stride_a == 1 && stride_b == 1 && gstar::aligned16(a) && gstar::aligned16(b) &&
                           gstar::aligned16(out);
    return gstar::dispatch(dtype, vectorize, [&](auto zero, auto vec) {
        using T = decltype(zero);
        constexpr int VEC = decltype(vec)::value;
        const int64_t chunks = (n + VEC - 1) / VEC;
        const int64_t per_block = static_cast<int64_t>(gstar::kThreads) * gstar::kUnroll;
        const int64_t blocks = (chunks + per_block - 1) / per_block;
        if (blocks > INT32_MAX) return cudaErrorInvalidValue;
        vector_add_kernel<T, VEC><<<static_cast<unsigned>(blocks), gstar::kThreads, 0, stream>>>(
            static_cast<const T*>(a), stride_a, static_cast<const T*>(b), stride_b, static_cast<T*>(out), n);
        return cudaGetLastError();
    });
}
