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


def head_parts(d: int) -> tuple[int, int]:
    """A head dim as ``(head, tail)`` lanes of Q and K tiles whose widths are powers of two: 192 = 128 + 64, 576 =
    512 + 64, two products into one score tile and no lane of zeros; a power of two, or a dim whose rest is no
    power of two of at least 16 (``tl.dot``'s least), is one part of :func:`pad_head_dim` lanes (tail 0)."""
    head = 1 << (d.bit_length() - 1)
    tail = d - head
    if tail < 16 or tail & (tail - 1):
        return pad_head_dim(d), 0
    return head, tail


@triton.constexpr_function
def head_lanes(d: int, tail: int) -> int:
    """The head part's lanes of a head dim ``d`` with ``tail`` lanes past it (:func:`head_parts`; 0: one part)."""
    return d - tail if tail else pad_head_dim(d)
