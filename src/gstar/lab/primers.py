"""Stage 2 of ``gstar check``: the first Triton kernel, a weighted row sum.

``weighted_row_sum(x, w)[i] = sum_j x[i, j] * w[j]``. It is also the read-bound probe of ``gstar roofline``:
it streams ``x`` once and writes almost nothing, so its bandwidth is the card's read ceiling.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from .. import buffers

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_TILE_ELEMENTS = 8192  # elements of x per program and loop step: 16 KiB of bf16, enough loads in flight
_MAX_BLOCK_N = 1024


@triton.jit
def _weighted_row_sum_kernel(
    x_ptr,  # (M, N), unit column stride
    w_ptr,  # (N,), stride stride_w
    y_ptr,  # (M,), contiguous
    M, N, stride_xm, stride_w,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                     # (BLOCK_M,)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm                       # (BLOCK_M, 1), 64-bit
    # Per-lane partial sums, reduced across the tile once at the end: no cross-warp reduction per step.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)                                      # (BLOCK_N,)
        col_ok = cols < N
        x = tl.load(x_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols.to(tl.int64) * stride_w, mask=col_ok, other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)[None, :]                       # (BLOCK_M, BLOCK_N)
    y = tl.sum(acc, axis=1)                                                       # (BLOCK_M,)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def _check(x, w):
    for name, t, ndim in (("x", x, 2), ("w", w, 1)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if w.shape[0] != x.shape[1]:
        raise ValueError(f"w must have shape ({x.shape[1]},) to match x of shape {tuple(x.shape)}, "
                         f"got {tuple(w.shape)}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if w.dtype != x.dtype:
        raise TypeError(f"w must have x's dtype {x.dtype}, got {w.dtype}")
    if w.device != x.device:
        raise ValueError(f"w must be on x's device {x.device}, got {w.device}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError(f"x must have unit stride on its last dim, got strides {x.stride()}")
    if x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("weighted_row_sum on CPU tensors needs the Triton interpreter: set "
                           "TRITON_INTERPRET=1 before triton is imported")
    if x.device.type not in ("cpu", "cuda"):
        raise ValueError(f"x must be a CUDA tensor (or CPU under the interpreter), got {x.device}")


def weighted_row_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``y[i] = sum_j x[i, j] * w[j]``, accumulated in float32 and rounded once to x's dtype.

    Args:
        x: ``(M, N)``, float16, bfloat16 or float32, any row stride, unit stride on the last dim.
        w: ``(N,)``, x's dtype and device, any stride.

    Returns:
        ``y``: ``(M,)`` contiguous, in x's dtype (like ``x @ w``). Rows of length 0 give 0.

    Raises ``TypeError`` / ``ValueError`` naming the offending argument. CUDA tensors run on the GPU; CPU
    tensors run under the Triton interpreter (``TRITON_INTERPRET=1``) or raise ``RuntimeError``.
    """
    _check(x, w)
    M, N = x.shape
    y = buffers.empty((M,), dtype=x.dtype, device=x.device)                      # (M,)
    if M == 0:
        return y
    # A tile of ~_TILE_ELEMENTS: long rows get few rows and a wide column step, short rows many rows.
    block_n = min(triton.next_power_of_2(max(N, 1)), _MAX_BLOCK_N)
    block_m = min(triton.next_power_of_2(M), max(1, _TILE_ELEMENTS // block_n))
    num_warps = 8 if block_m * block_n >= _TILE_ELEMENTS else 4
    grid = (triton.cdiv(M, block_m),)
    # Triton launches on the current CUDA device, which need not hold x (as PyTorch's operators do, switch)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _weighted_row_sum_kernel[grid](x, w, y, M, N, x.stride(0), w.stride(0),
                                       BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return y
