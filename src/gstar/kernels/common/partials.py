"""The backward's fixed-order partial sums, shared by both backward families: when a KV tile's dK, dV are split
over several programs (head splits, Q chunks, or a GQA group's parts), each stores float32 partials and
:func:`sum_partials` adds them per tile in a fixed order, so the gradients stay bitwise reproducible."""

from __future__ import annotations

import triton
import triton.language as tl

from .sizes import pad_head_dim


@triton.constexpr_function
def block_rows(width: int, limit: int = 1 << 30) -> int:
    """Rows per step of a float32 block ``width`` columns wide that a reduction adds up: about 2048 elements, at
    least 16 rows (and at most ``limit``)."""
    return min(limit, max(16, 2048 // width))


@triton.jit
def store_rows(ptr, idx, n, stride, x, HEAD_DIM: tl.constexpr):
    """Stores the (R, D_PAD) tile ``x`` into rows ``idx`` (R,) of an (n, HEAD_DIM) matrix, cast to its dtype."""
    offs_d = tl.arange(0, pad_head_dim(HEAD_DIM))                                       # (D_PAD,)
    ptrs = ptr + idx.to(tl.int64)[:, None] * stride + offs_d[None, :]
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=(idx[:, None] < n) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _sum_tile(P, D, first, last, head_base, n_items, tile, nk, stride_d, BLOCK_N: tl.constexpr,
              WIDTH: tl.constexpr, head_splits):
    """Rows ``tile * BLOCK_N ..`` of D (Nk, WIDTH) of one kv head = the sum of the partials ``(head_base + s,
    i)`` of P, (.., n_items, BLOCK_N, W_PAD) float32, for each head split s and item ``first <= i < last``,
    in that order."""
    W_PAD: tl.constexpr = pad_head_dim(WIDTH)
    ROWS: tl.constexpr = block_rows(W_PAD, BLOCK_N)
    for r in range(0, BLOCK_N, ROWS):
        offs_r = r + tl.arange(0, ROWS)                                                 # (ROWS,)
        tile_offs = offs_r[:, None] * W_PAD + tl.arange(0, W_PAD)[None, :]              # (ROWS, W_PAD)
        acc = tl.zeros((ROWS, W_PAD), dtype=tl.float32)
        for s in range(0, head_splits):
            for i in range(first, last):
                acc += tl.load(P + ((head_base + s) * n_items + i) * (BLOCK_N * W_PAD) + tile_offs)
        store_rows(D, tile * BLOCK_N + offs_r, nk, stride_d, acc, WIDTH)


@triton.jit
def sum_partials(PK, PV, DK, DV, FIRST, stride_dk, stride_dv, Hkv, nk, head_splits, n_items,
                 BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr):
    """Grid ``(cdiv(Nk, BLOCK_N), Hkv, B)``: dK, dV of one KV tile = the sum of its partials, head split by
    head split and work item by work item (a fixed order: bitwise reproducible).

    PK, PV: (B, Hkv, head_splits, n_items, BLOCK_N, D_PAD or DV_PAD) float32 contiguous; DK: (B, Hkv, Nk,
    HEAD_DIM), DV: (B, Hkv, Nk, VALUE_DIM) with (batch, head, row) strides ``stride_dk``, ``stride_dv``;
    FIRST: (n tiles + 1,) int32, the tile's items are ``FIRST[t] .. FIRST[t + 1] - 1``."""
    tile = tl.program_id(0)
    hkv = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    first = tl.load(FIRST + tile)
    last = tl.load(FIRST + tile + 1)
    head_base = (b * Hkv + hkv) * head_splits
    _sum_tile(PK, DK + b * stride_dk[0] + hkv * stride_dk[1], first, last, head_base, n_items, tile, nk,
              stride_dk[2], BLOCK_N, HEAD_DIM, head_splits)
    _sum_tile(PV, DV + b * stride_dv[0] + hkv * stride_dv[1], first, last, head_base, n_items, tile, nk,
              stride_dv[2], BLOCK_N, VALUE_DIM, head_splits)
