"""The rule and the tile ranges inside the kernels: :func:`visible`, the Triton twin of
:meth:`gstar.pattern.Pattern.visible` that every kernel masks with; the twins of
:func:`gstar.pattern.kv_blocks` and :func:`gstar.pattern.q_blocks`; the per-sequence bounds of packed
(varlen) inputs; and where the rows of a tile that packs several query heads live.

The kernels work out which blocks a tile visits from a few scalars instead of reading a host-built table:
with packed sequences the lengths live in ``cu_seqlens`` on the device, and a host table would need them on
the host (a sync, and a graph break under ``torch.compile``). The Python functions in :mod:`gstar.pattern`
stay the specification; ``tests/test_ranges.py`` checks these against them, element by element and tile by
tile. Every division
here has a non-negative numerator (Triton's integer division truncates towards zero, Python's floors).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def visible(rows, cols, nq, nk, left, right, sink_tokens,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr):
    """Whether key ``cols`` is visible to query ``rows`` (broadcastable index blocks, ``0 <= rows < nq`` and
    ``cols >= 0``): the rule of docs/design.md section 1, as :meth:`gstar.pattern.Pattern.visible` states it;
    keys past ``nk`` are hidden. ``HAS_LEFT`` / ``HAS_RIGHT``: whether ``left`` / ``right`` bound the window;
    ``HAS_SINK_TOKENS``: whether keys below ``sink_tokens`` are exempt from the left bound.

    Rows past ``nq`` (the padding of a sequence's last Q tile) are not checked, which saves an operation per
    score: the forward never stores them, and the backward gives them an infinite LSE, hence zero weight.
    """
    ok = cols < nk
    pos = rows + (nk - nq)  # p(i): queries are the last nq positions of the keys
    if HAS_RIGHT:
        ok = ok & (cols <= pos + right)
    if HAS_LEFT:
        inside = cols >= pos - left
        if HAS_SINK_TOKENS:
            inside = inside | (cols < sink_tokens)
        ok = ok & inside
    return ok


@triton.jit
def sequence_bounds(Cu, seq, n, VARLEN: tl.constexpr):
    """``(start, length)`` of sequence ``seq``: rows ``Cu[seq] .. Cu[seq + 1]`` of a packed tensor when
    VARLEN (Cu: (num_seqs + 1,) int32 cumulative lengths), else ``(0, n)`` (a dense batch row). ``start``
    has ``seq``'s integer type, so an int64 ``seq`` gives 64-bit offsets."""
    if VARLEN:
        first = tl.load(Cu + seq)
        length = tl.load(Cu + seq + 1) - first
        start = first.to(seq.dtype)
    else:
        start = seq * 0
        length = n
    return start, length


@triton.jit
def tile_rows(offs, h0, row_start, q_start, Nq, ROWS: tl.constexpr):
    """Where tile rows ``offs`` (R,) live when a tile stacks query heads ``h0, h0 + 1, ...`` of ROWS
    positions each (PACK_GQA): their query head, their position in the sequence, whether it is a real row
    (< Nq), and their index along the sequence axis of Q / dO / Out (``q_start`` + position). Each is (R,)."""
    heads = h0 + offs // ROWS
    rows = row_start + offs % ROWS
    return heads, rows, rows < Nq, q_start + rows


ALL_ROWS = tl.constexpr(2**30)  # kv_range's tile height for a decode program: the union of every query row's keys


@triton.jit
def decode_program(Seqlens, added, group, nq, BLOCK_R: tl.constexpr):
    """Where a decode program works, on its grid ``(splits, Hkv * row_tiles, B)`` (kv heads fastest, then the
    row tiles of ``BLOCK_R`` of the group's ``group * nq`` stacked rows): ``(split, splits, hkv, tile, b, nk)``,
    ``b`` int64 and ``nk`` its sequence's keys (Seqlens: (B,) int32, before the ``added`` appended ones)."""
    kv_heads = tl.num_programs(1) // tl.cdiv(group * nq, BLOCK_R)
    b = tl.program_id(2).to(tl.int64)
    return (tl.program_id(0), tl.num_programs(0), tl.program_id(1) % kv_heads, tl.program_id(1) // kv_heads, b,
            tl.load(Seqlens + b) + added)


@triton.jit
def decode_rows(b, heads, split, rows, stride_o, stride_lse, SPLIT: tl.constexpr):
    """Offsets of a decode program's rows (query heads ``heads``, queries ``rows``) in its outputs: the finished
    Out (B, Hq, nq, Dv) and Lse (B, Hq, nq), strides (batch, head, row) and (batch, head), or SPLIT the partials
    (B, Hq, splits, nq, Dv) and (B, Hq, splits, nq), strides (batch, head, split, row) and (batch, head, split):
    ``(out_rows, lse_rows)``."""
    if SPLIT:
        return (b * stride_o[0] + heads * stride_o[1] + split * stride_o[2] + rows * stride_o[3],
                b * stride_lse[0] + heads * stride_lse[1] + split * stride_lse[2] + rows)
    return b * stride_o[0] + heads * stride_o[1] + rows * stride_o[2], b * stride_lse[0] + heads * stride_lse[1] + rows


@triton.jit
def kv_range(row_start, nq, nk, left, right, sink_tokens, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
             HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """KV blocks of ``BLOCK_N`` keys that the Q tile of rows ``[row_start, row_start + ROWS)`` visits:
    ``(sink_end, band_start, full_start, full_end, band_end)`` exactly as :func:`gstar.pattern.kv_blocks`
    (``sink_tokens`` is 0 without a left bound)."""
    offset = nk - nq
    row_end = tl.minimum(row_start + ROWS, nq)
    pmin = row_start + offset
    pmax = row_end - 1 + offset
    lo = 0
    hi = nk
    if HAS_LEFT:
        lo = tl.minimum(tl.maximum(pmin - left, 0), nk)
    if HAS_RIGHT:
        hi = tl.maximum(tl.minimum(pmax + right + 1, nk), 0)
    sink_blocks = (tl.minimum(sink_tokens, hi) + BLOCK_N - 1) // BLOCK_N  # sink keys obey the right bound
    empty = hi <= lo
    band_start = lo // BLOCK_N
    band_end = (hi + BLOCK_N - 1) // BLOCK_N
    sink_end = tl.minimum(sink_blocks, band_start)
    full_start = band_start
    if HAS_LEFT:
        full_start = tl.maximum(band_start, (tl.maximum(pmax - left, 0) + BLOCK_N - 1) // BLOCK_N)
    full_end = tl.minimum(band_end, nk // BLOCK_N)
    if HAS_RIGHT:
        full_end = tl.minimum(full_end, tl.maximum(pmin + right + 1, 0) // BLOCK_N)
    no_interior = full_end <= full_start
    full_start = tl.where(no_interior, band_end, full_start)
    full_end = tl.where(no_interior, band_end, full_end)
    # an empty band leaves only the sink blocks, as one masked range
    sink_end = tl.where(empty, sink_blocks, sink_end)
    band_start = tl.where(empty, sink_blocks, band_start)
    full_start = tl.where(empty, sink_blocks, full_start)
    full_end = tl.where(empty, sink_blocks, full_end)
    band_end = tl.where(empty, sink_blocks, band_end)
    return sink_end, band_start, full_start, full_end, band_end


@triton.jit
def q_range(key_start, nq, nk, left, right, sink_tokens, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Q tiles of ``BLOCK_M`` rows that see a key of the block ``[key_start, key_start + BLOCK_N)``:
    ``(start, full_start, full_end, end)`` exactly as :func:`gstar.pattern.q_blocks`."""
    offset = nk - nq
    key_end = tl.minimum(key_start + BLOCK_N, nk)
    rmin = 0
    rmax = nq
    if HAS_RIGHT:
        rmin = tl.maximum(key_start - right - offset, 0)  # first row whose right bound reaches the block
    if HAS_LEFT:
        # rows after the last one whose left bound reaches the block; a sink key is seen by every later row
        reach = tl.minimum(key_end + left - offset, nq)
        rmax = tl.where(key_start >= sink_tokens, reach, nq)
    empty = rmax <= rmin
    start = rmin // BLOCK_M
    end = (tl.maximum(rmax, 0) + BLOCK_M - 1) // BLOCK_M
    full_start = start
    if HAS_RIGHT:
        full_start = tl.maximum(start, (tl.maximum(key_end - 1 - right - offset, 0) + BLOCK_M - 1) // BLOCK_M)
    full_end = tl.minimum(end, nq // BLOCK_M)
    if HAS_LEFT:
        first_plain_key = tl.maximum(key_start, sink_tokens)  # smallest key that needs the left bound
        plain_end = tl.maximum(first_plain_key + left - offset + 1, 0) // BLOCK_M
        full_end = tl.where(key_end > sink_tokens, tl.minimum(full_end, plain_end), full_end)
    no_interior = (key_end - key_start < BLOCK_N) | (full_end <= full_start)
    full_start = tl.where(no_interior, end, full_start)
    full_end = tl.where(no_interior, end, full_end)
    start = tl.where(empty, 0, start)
    full_start = tl.where(empty, 0, full_start)
    full_end = tl.where(empty, 0, full_end)
    end = tl.where(empty, 0, end)
    return start, full_start, full_end, end
