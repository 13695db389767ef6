"""Head-dim-wide tiles as parts: a query / key operand ``D`` wide is held as the power-of-two tiles of
:func:`gstar.kernels.configs.head_parts` (D 192: lanes 0..127 and 128..191, not one tile of 256), so no
product runs over more zero lanes than the last part's padding.

A tile here is a tuple of parts, ``(lo,)`` or ``(lo, hi)``: loads and stores take one pointer tile per part,
a product over the head dim is one dot per part accumulated into one result (:func:`dot`), and a product
into the head dim one dot per part (:func:`dot_into`). ``SPLIT=False`` gives one padded part, the layout of
value-dim operands, which never split, for the helpers they share with the query / key operands.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .configs import head_parts, pad_head_dim


@triton.constexpr_function
def _widths(width: int, split: bool) -> tuple:
    """The parts' widths of a ``width``-wide operand: its head_parts, or one padded part."""
    lo, hi = head_parts(width) if split else (pad_head_dim(width), 0)
    return (lo, hi) if hi else (lo,)


@triton.constexpr_function
def span(width: int, split: bool = True) -> int:
    """The lanes the parts of a ``width``-wide operand span (:func:`gstar.kernels.configs.head_lanes` when
    split, the padded width when not)."""
    return sum(_widths(width, split))


@triton.constexpr_function
def _part_width(width: int, split: bool, i: int) -> int:
    """The width of part ``i`` of a ``width``-wide operand."""
    return _widths(width, split)[i]


@triton.constexpr_function
def _ends_past(width: int, split: bool, i: int) -> bool:
    """Whether part ``i`` of a ``width``-wide operand holds lanes past ``width`` (which loads must mask)."""
    return sum(_widths(width, split)[:i + 1]) > width


@triton.jit
def lanes(WIDTH: tl.constexpr, SPLIT: tl.constexpr = True):
    """The head-dim lanes of each part: ``(arange(0, lo),)`` or ``(arange(0, lo), lo + arange(0, hi))``."""
    WIDTHS: tl.constexpr = _widths(WIDTH, SPLIT)
    x = (tl.arange(0, WIDTHS[0]),)
    if len(WIDTHS) > 1:
        x = x + (WIDTHS[0] + tl.arange(0, WIDTHS[1]),)
    return x


@triton.jit
def pointers(rows, WIDTH: tl.constexpr, SPLIT: tl.constexpr = True, TRANSPOSED: tl.constexpr = False):
    """Pointer tiles of R rows whose lane 0 is at ``rows`` (R,): (R, w) per part, or (w, R) if TRANSPOSED."""
    LANES = lanes(WIDTH, SPLIT)
    x = ()
    for i in tl.static_range(len(LANES)):
        if TRANSPOSED:
            x = x + (rows[None, :] + LANES[i][:, None],)
        else:
            x = x + (rows[:, None] + LANES[i][None, :],)
    return x


@triton.jit
def _mask(lanes_i, rows_ok, WIDTH: tl.constexpr, ENDS_PAST: tl.constexpr, TRANSPOSED: tl.constexpr):
    """The mask of one part, (R, w) or, TRANSPOSED, (w, R): lanes ``lanes_i`` (w,) below WIDTH, in the rows
    where ``rows_ok`` (R,) is true; None where it would be all true (no row check, no lane past WIDTH)."""
    ok = None
    if ENDS_PAST:
        ok = lanes_i[:, None] < WIDTH if TRANSPOSED else lanes_i[None, :] < WIDTH
    if rows_ok is not None:
        rows_2d = rows_ok[None, :] if TRANSPOSED else rows_ok[:, None]
        ok = rows_2d if ok is None else ok & rows_2d
    return ok


@triton.jit
def load(ptrs, rows_ok, WIDTH: tl.constexpr, SPLIT: tl.constexpr = True, TRANSPOSED: tl.constexpr = False):
    """The parts at pointer tiles ``ptrs`` (from :func:`pointers`), zeros in lanes past WIDTH and, unless
    ``rows_ok`` (R,) is None, in rows where it is false; unchecked rows of a part that ends inside WIDTH load
    without a mask."""
    LANES = lanes(WIDTH, SPLIT)
    x = ()
    for i in tl.static_range(len(LANES)):
        mask = _mask(LANES[i], rows_ok, WIDTH, _ends_past(WIDTH, SPLIT, i), TRANSPOSED)
        if mask is None:
            x = x + (tl.load(ptrs[i]),)
        else:
            x = x + (tl.load(ptrs[i], mask=mask, other=0.0),)
    return x


@triton.jit
def store(ptrs, x, rows_ok, WIDTH: tl.constexpr, SPLIT: tl.constexpr = True):
    """Stores the parts ``x`` at pointer tiles ``ptrs`` (R, w), cast to the pointers' dtype, in the lanes
    below WIDTH and, unless ``rows_ok`` (R,) is None, the rows where it is true."""
    LANES = lanes(WIDTH, SPLIT)
    for i in tl.static_range(len(LANES)):
        mask = _mask(LANES[i], rows_ok, WIDTH, _ends_past(WIDTH, SPLIT, i), False)
        tl.store(ptrs[i], x[i].to(ptrs[i].dtype.element_ty), mask=mask)


@triton.jit
def zeros(ROWS: tl.constexpr, WIDTH: tl.constexpr, SPLIT: tl.constexpr = True):
    """float32 accumulator parts of ROWS rows."""
    x = ()
    for i in tl.static_range(len(_widths(WIDTH, SPLIT))):
        x = x + (tl.zeros((ROWS, _part_width(WIDTH, SPLIT, i)), dtype=tl.float32),)
    return x


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, TRANS_B: tl.constexpr = False):
    """The product over the head dim: the sum of ``a[i] @ b[i]`` (or ``b[i]^T``) over the parts, one
    accumulating dot each; a: (M, w) parts, b: (w, N) or, TRANS_B, (N, w). Returns (M, N) float32."""
    for i in tl.static_range(len(a)):
        b_i = tl.trans(b[i]) if TRANS_B else b[i]
        if i == 0:
            s = tl.dot(a[i], b_i, input_precision=PRECISION)
        else:
            s = tl.dot(a[i], b_i, s, input_precision=PRECISION)
    return s


@triton.jit
def dot_into(acc, x, b, PRECISION: tl.constexpr):
    """``acc[i] + x @ b[i]`` for each part: a product into the head dim; x: (M, K) in b's dtype, b: (K, w)
    parts, acc: (M, w) float32 parts."""
    out = ()
    for i in tl.static_range(len(acc)):
        out = out + (tl.dot(x, b[i], acc[i], input_precision=PRECISION),)
    return out


@triton.jit
def shifted(ptrs, offset):
    """The pointer tiles ``ptrs`` moved by ``offset`` elements."""
    out = ()
    for i in tl.static_range(len(ptrs)):
        out = out + (ptrs[i] + offset,)
    return out


@triton.jit
def added(x, y):
    """The sum of two tiles' parts."""
    out = ()
    for i in tl.static_range(len(x)):
        out = out + (x[i] + y[i],)
    return out


@triton.jit
def scaled(x, factor):
    """The parts ``x`` times ``factor``."""
    out = ()
    for i in tl.static_range(len(x)):
        out = out + (x[i] * factor,)
    return out
