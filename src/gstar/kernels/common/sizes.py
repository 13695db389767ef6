"""Head dims and tile sides as the kernels compute with them: powers of two (``tl.arange`` and the tensor cores
take no others), at least 16 (``tl.dot``'s minimum)."""

import triton


@triton.constexpr_function
def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (n >= 1); the kernels call it on constexprs, the host in its cached
    plans (a constexpr function costs ~1.5 us per host call: none on the per-call path)."""
    return 1 << (n - 1).bit_length()


@triton.constexpr_function
def pad_head_dim(d: int) -> int:
    """The head dim the kernels compute with: the next power of two, at least 16. The kernels derive it from
    HEAD_DIM; the host sizes buffers and descriptor blocks with it."""
    return max(16, 1 << (d - 1).bit_length())
