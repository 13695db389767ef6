// torch adapter of the CUDA primers: tensors in, raw pointers and the current stream out. The Python
// wrappers in __init__.py validate arguments and allocate `out`; this file only translates.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "primers.h"

namespace {

GstarDtype dtype_code(const at::Tensor& t) {
    switch (t.scalar_type()) {
        case at::kFloat: return GSTAR_FLOAT32;
        case at::kHalf: return GSTAR_FLOAT16;
        case at::kBFloat16: return GSTAR_BFLOAT16;
        default: TORCH_CHECK(false, "gstar primers: unsupported dtype ", t.scalar_type());
    }
}

void check_launch(cudaError_t err) {
    TORCH_CHECK(err == cudaSuccess, "gstar primers: kernel launch failed: ", cudaGetErrorString(err));
}

// a, b: (n,) any stride; out: (n,) contiguous.
void vector_add(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
    TORCH_CHECK(out.is_contiguous() && out.sizes() == a.sizes(), "gstar primers: bad out buffer");
    const c10::cuda::CUDAGuard guard(a.device());
    check_launch(gstar_vector_add(a.const_data_ptr(), a.stride(0), b.const_data_ptr(), b.stride(0),
                                  out.mutable_data_ptr(), a.size(0), dtype_code(a),
                                  c10::cuda::getCurrentCUDAStream()));
}

// a, b: (m, n) any strides; out: (m, n) contiguous.
void matrix_add(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
    TORCH_CHECK(out.is_contiguous() && out.sizes() == a.sizes(), "gstar primers: bad out buffer");
    const c10::cuda::CUDAGuard guard(a.device());
    check_launch(gstar_matrix_add(a.const_data_ptr(), a.stride(0), a.stride(1), b.const_data_ptr(), b.stride(0),
                                  b.stride(1), out.mutable_data_ptr(), a.size(0), a.size(1), dtype_code(a),
                                  c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("vector_add", &vector_add, "out = a + b for 1-D CUDA tensors");
    m.def("matrix_add", &matrix_add, "out = a + b for 2-D CUDA tensors");
}
