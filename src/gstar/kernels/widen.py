"""Widening a tensor into a wider float dtype in one streaming pass: FP8 forwards run ``P V`` in bfloat16
and widen V first (:func:`gstar.kernels.attention.attention_forward`). Also :func:`half_queries`, the float16
form of bfloat16 queries that both decode kernels use against an FP8 cache.

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


@triton.jit
def half_queries(q, qk_scale):
    """bfloat16 queries (BLOCK_R, D_PAD) for an FP8 cache's ``Q K^T``, as float16: ``(q * 2^e, qk_scale * 2^-e)``,
    ``e`` setting the tile's largest magnitude in [2^14, 2^15] (tiles below 2^-111 take e = 126). e4m3 keys widen
    to float16 in one pair conversion (to bfloat16 they take two conversions and byte permutes each), and float16
    holds every bfloat16 value of the scaled tile exactly except components below 2^-28 of its largest
    (subnormals). 1.14x the speed of the bfloat16 path at 1 x 131,072 (benchmarks/NOTES.md, 'FP8 decode: where the
    time goes')."""
    amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
    e = tl.where(amax > 0, 15.0 - tl.math.ceil(tl.math.log2(amax)), 0.0)
    e = tl.minimum(tl.maximum(e, -126.0), 126.0).to(tl.int32)  # 2^e, 2^-e normal (finite bfloat16: e >= -113)
    up = ((e + 127) << 23).to(tl.float32, bitcast=True)  # 2^e, exactly
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e
    return (q.to(tl.float32) * up).to(tl.float16), qk_scale * down


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
