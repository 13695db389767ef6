"""Widening a tensor into a wider float dtype in one streaming pass: FP8 forwards run ``P V`` in bfloat16
and widen V first (:func:`gstar.kernels.attention.attention_forward`).

PyTorch's own conversion of float8_e4m3fn moves about 1 TB/s on an H200, a tenth of the forward's time at
D 128; this kernel streams at the card's copy rate (benchmarks/NOTES.md, 'FP8 forward on the Hopper kernel').
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import buffers

_BLOCK = 8192  # elements per program: 8 KiB read and 16 KiB written at FP8 -> bfloat16


@triton.jit
def _widen_kernel(src, dst, n, BLOCK: tl.constexpr):
    """dst[i] = src[i] in dst's dtype for i < n; both flat and contiguous."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offsets < n
    tl.store(dst + offsets, tl.load(src + offsets, mask=mask).to(dst.dtype.element_ty), mask=mask)


def widen(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` with x's strides where x is dense (a permutation of a contiguous tensor, such as a
    heads-first view of (B, N, H, D)), in one pass of this kernel; other layouts take PyTorch's copy."""
    out = buffers.empty_like(x, dtype=dtype)  # x's strides when x is dense
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost first
    src, dst = x.permute(order), out.permute(order)
    if not (src.is_contiguous() and dst.is_contiguous()) or x.numel() == 0:
        return out.copy_(x)
    n = x.numel()
    _widen_kernel[(triton.cdiv(n, _BLOCK),)](src.view(-1), dst.view(-1), n, BLOCK=_BLOCK, num_warps=8)
    return out
