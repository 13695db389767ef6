// Shared by the elementwise primers. A "chunk" is VEC consecutive elements of a row: one 16-byte access
// when VEC > 1 (the launcher picks VEC > 1 only for unit strides and 16-byte aligned rows), one strided
// element when VEC == 1. A thread moves kUnroll chunks, all loaded before the first store; the threads whose
// chunks cross the end of the row take an element-by-element path instead. Sums are computed in float and
// rounded once, as torch's own kernels do (opmath), which makes the results bitwise equal to torch's a + b.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <type_traits>

#include "primers.h"

namespace gstar {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;  // chunks per thread, all loaded before the first store: bytes in flight

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

template <typename T>
__device__ __forceinline__ T add(T a, T b) {
    return from_float<T>(to_float(a) + to_float(b));
}

// a + b on the elements packed in one 32-bit word (one float, or two 16-bit floats). Working on the bit
// patterns keeps whole chunks in registers: copies through T arrays would split the 16-byte accesses.
template <typename T>
__device__ __forceinline__ uint32_t add_word(uint32_t a, uint32_t b) {
    if constexpr (sizeof(T) == 4) {
        return __float_as_uint(add(__uint_as_float(a), __uint_as_float(b)));
    } else {
        const auto half = [](uint32_t w, int shift) {
            const unsigned short bits = static_cast<unsigned short>(w >> shift);
            if constexpr (std::is_same_v<T, __half>) return __ushort_as_half(bits);
            else return __ushort_as_bfloat16(bits);
        };
        const auto bits = [](T x) -> uint32_t {
            if constexpr (std::is_same_v<T, __half>) return __half_as_ushort(x);
            else return __bfloat16_as_ushort(x);
        };
        return bits(add(half(a, 0), half(b, 0))) | bits(add(half(a, 16), half(b, 16))) << 16;
    }
}

// VEC consecutive elements: one 16-byte access (uint4) when VEC > 1, one element otherwise.
template <typename T, int VEC>
using Chunk = std::conditional_t<(VEC > 1), uint4, T>;

// The chunk at element i of p, which lies wholly inside the row.
template <typename T, int VEC>
__device__ __forceinline__ Chunk<T, VEC> load_chunk(const T* __restrict__ p, int64_t stride, int64_t i) {
    static_assert(VEC == 1 || sizeof(T) * VEC == 16, "a vector chunk is one 16-byte access");
    if constexpr (VEC > 1) {
        return *reinterpret_cast<const uint4*>(p + i);
    } else {
        return p[i * stride];
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_chunk(T* __restrict__ p, int64_t i, const Chunk<T, VEC>& c) {
    if constexpr (VEC > 1) {  // PTX: a uint4 assignment is sometimes split into four 4-byte stores
        asm("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p + i), "r"(c.x), "r"(c.y), "r"(c.z), "r"(c.w)
            : "memory");
    } else {
        p[i] = c;
    }
}

template <typename T, int VEC>
__device__ __forceinline__ Chunk<T, VEC> add_chunks(const Chunk<T, VEC>& a, const Chunk<T, VEC>& b) {
    if constexpr (VEC > 1) {
        return make_uint4(add_word<T>(a.x, b.x), add_word<T>(a.y, b.y), add_word<T>(a.z, b.z),
                          add_word<T>(a.w, b.w));
    } else {
        return add(a, b);
    }
}

// out[i + e] = a[(i + e) * stride_a] + b[(i + e) * stride_b] for e < VEC with i + e < n (out contiguous).
template <typename T, int VEC>
__device__ __forceinline__ void add_ragged(const T* __restrict__ a, int64_t stride_a, const T* __restrict__ b,
                                           int64_t stride_b, T* __restrict__ out, int64_t i, int64_t n) {
#pragma unroll
    for (int e = 0; e < VEC; ++e)
        if (i + e < n) out[i + e] = add(a[(i + e) * stride_a], b[(i + e) * stride_b]);
}

// One thread's share of out = a + b over a row of n elements: the chunks at elements i + u * step * VEC,
// u < kUnroll (step = threads along the row, so that a warp's accesses are adjacent). Shared by both primers.
template <typename T, int VEC>
__device__ __forceinline__ void add_row_chunks(const T* __restrict__ a, int64_t stride_a,
                                               const T* __restrict__ b, int64_t stride_b, T* __restrict__ out,
                                               int64_t i, int64_t step, int64_t n) {
    if constexpr (VEC > 1) {  // constant unit strides simplify the addressing of the ragged path
        stride_a = 1;
        stride_b = 1;
    }
    if (i + ((kUnroll - 1) * step + 1) * VEC <= n) {
        Chunk<T, VEC> x[kUnroll], y[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            x[u] = load_chunk<T, VEC>(a, stride_a, i + u * step * VEC);
            y[u] = load_chunk<T, VEC>(b, stride_b, i + u * step * VEC);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            store_chunk<T, VEC>(out, i + u * step * VEC, add_chunks<T, VEC>(x[u], y[u]));
    } else {
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            add_ragged<T, VEC>(a, stride_a, b, stride_b, out, i + u * step * VEC, n);
    }
}

__host__ __forceinline__ bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Calls f(T{}, std::integral_constant<int, VEC>{}) with T the element type of `dtype` and VEC the
// elements of one 16-byte access when `vectorize`, else 1.
template <typename F>
__host__ cudaError_t dispatch(GstarDtype dtype, bool vectorize, F&& f) {
    switch (dtype) {
        case GSTAR_FLOAT32:
            return vectorize ? f(float{}, std::integral_constant<int, 4>{})
                             : f(float{}, std::integral_constant<int, 1>{});
        case GSTAR_FLOAT16:
            return vectorize ? f(__half{}, std::integral_constant<int, 8>{})
                             : f(__half{}, std::integral_constant<int, 1>{});
        case GSTAR_BFLOAT16:
            return vectorize ? f(__nv_bfloat16{}, std::integral_constant<int, 8>{})
                             : f(__nv_bfloat16{}, std::integral_constant<int, 1>{});
    }
    return cudaErrorInvalidValue;
}

}  // namespace gstar
