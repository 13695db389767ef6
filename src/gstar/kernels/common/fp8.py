"""FP8 inputs inside the kernels: the descales (q's and k's folded into the score factor, v's into the finished
output), V widened to bfloat16 before a forward's launch (``P V`` runs in bfloat16: P in FP8 misses the accuracy
bar), and bfloat16 queries as float16 against an FP8 cache (its keys widen to float16 in one conversion)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ... import buffers

_BLOCK = 8192  # elements per program of the widening: 8 KiB read and 16 KiB written at FP8 -> bfloat16


def descale_args(descale) -> dict:
    """A call's descales by the names the kernels take them: ``QDescale``, ``KDescale``, ``VDescale`` (each None for
    a descale of 1; all three None without FP8 inputs) and ``stride_ds``, their (batch, head) strides, six ints
    (0 for None)."""
    if descale is None:
        return _NO_DESCALES
    return {"QDescale": descale[0], "KDescale": descale[1], "VDescale": descale[2],
            "stride_ds": tuple(s for d in descale for s in (d.stride() if d is not None else (0, 0)))}


_NO_DESCALES = {"QDescale": None, "KDescale": None, "VDescale": None, "stride_ds": (0,) * 6}


@triton.jit
def load_descales(QDescale, KDescale, VDescale, b, h_kv, stride_ds, qk_scale):
    """FP8 inputs' descales of kv head ``h_kv`` of sequence ``b``: ``(qk_scale, v_descale)``, q's and k's folded
    into the score factor. Each of QDescale, KDescale, VDescale is None (a descale of 1) or float32 (B, Hkv),
    its (batch, head) strides ``stride_ds[2i:2i + 2]`` (:func:`descale_args`; a broadcast view's may be 0).
    Three pointers rather than a tuple: Triton 3.6 cannot take a tuple argument with a None in it."""
    v_descale = 1.0
    if QDescale is not None:
        qk_scale = qk_scale * tl.load(QDescale + b * stride_ds[0] + h_kv * stride_ds[1])
    if KDescale is not None:
        qk_scale = qk_scale * tl.load(KDescale + b * stride_ds[2] + h_kv * stride_ds[3])
    if VDescale is not None:
        v_descale = tl.load(VDescale + b * stride_ds[4] + h_kv * stride_ds[5])
    return qk_scale, v_descale


@triton.jit
def half_queries(q, qk_scale):
    """bfloat16 queries (BLOCK_R, D_PAD) for an FP8 cache's ``Q K^T``, as float16: ``(q * 2^e, qk_scale * 2^-e)``,
    ``e`` setting the tile's largest magnitude in [2^14, 2^15] (tiles below 2^-111 take e = 126). e4m3 keys widen
    to float16 in one pair conversion (to bfloat16 they take two conversions and byte permutes each), and float16
    holds every bfloat16 value of the scaled tile exactly except components below 2^-28 of its largest
    (subnormals)."""
    amax = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
    e = tl.where(amax > 0, 15.0 - tl.math.ceil(tl.math.log2(amax)), 0.0)
    e = tl.minimum(tl.maximum(e, -126.0), 126.0).to(tl.int32)  # 2^e, 2^-e normal (finite bfloat16: e >= -113)
    up = ((e + 127) << 23).to(tl.float32, bitcast=True)  # 2^e, exactly
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2^-e
    return (q.to(tl.float32) * up).to(tl.float16), qk_scale * down


@triton.jit
def _widen_kernel(src, dst, n, BLOCK: tl.constexpr):
    """dst[i] = src[i] in dst's dtype for i < n; both flat and contiguous."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = offsets < n
    tl.store(dst + offsets, tl.load(src + offsets, mask=mask).to(dst.dtype.element_ty), mask=mask)


def widen(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)`` with x's strides where x is dense (a permutation of a contiguous tensor, such as a
    heads-first view of (B, N, H, D)), in one streaming pass at the card's copy rate (PyTorch's own conversion
    of float8_e4m3fn streams slower); other layouts take PyTorch's copy."""
    out = buffers.empty_like(x, dtype=dtype)  # x's strides when x is dense
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # outermost first
    src, dst = x.permute(order), out.permute(order)
    if not (src.is_contiguous() and dst.is_contiguous()) or x.numel() == 0:
        return out.copy_(x)
    n = x.numel()
    _widen_kernel[(triton.cdiv(n, _BLOCK),)](src.view(-1), dst.view(-1), n, BLOCK=_BLOCK, num_warps=8)
    return out
