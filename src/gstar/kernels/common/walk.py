"""The block walk, stated once: which KV blocks a Q tile visits, in which order, and which need the mask; and
which Q tiles see a KV block (the backward's dK/dV walk).

A Q tile visits its sink-token blocks, then the window's band: a masked leading edge, an unmasked interior, a
masked trailing edge (:class:`Blocks`, from :func:`kv_blocks`). Kernels walk it either by block, one loop per
segment (:func:`segment`), or by step, one index over every visited block (:func:`block_at`, :func:`steps`),
which pipelined and split kernels prefer. The twins on the host are :func:`gstar.pattern.kv_blocks` and
:func:`gstar.pattern.q_blocks` (the specification; ``tests/test_ranges.py`` compares them tile by tile). Every
division here has a non-negative numerator (Triton's integer division truncates towards zero, Python's floors).
"""

import triton
import triton.language as tl
from triton.language.core import _aggregate as aggregate
from triton.language.core import base_value

from .rule import chunk_start, span_of

ALL_ROWS = tl.constexpr(2**30)  # a tile height that covers every query row: a decode program's union of keys


@aggregate
class Blocks:
    """The KV blocks a Q tile visits, as :func:`gstar.pattern.kv_blocks` returns them: ``[0, sink_end)`` hold sink
    tokens outside the band (masked), ``[band_start, band_end)`` is the band, of which ``[full_start, full_end)``
    every row of the tile sees whole (unmasked). ``sink_end <= band_start``: no block is visited twice."""

    sink_end: base_value
    band_start: base_value
    full_start: base_value
    full_end: base_value
    band_end: base_value

    @triton.constexpr_function
    def __init__(self, sink_end, band_start, full_start, full_end, band_end):
        self.sink_end, self.band_start, self.full_start = sink_end, band_start, full_start
        self.full_end, self.band_end = full_end, band_end


@aggregate
class Tiles:
    """The Q tiles that see a KV block, as :func:`gstar.pattern.q_blocks` returns them: ``[start, end)``, of which
    ``[full_start, full_end)`` see every key of the block (unmasked)."""

    start: base_value
    full_start: base_value
    full_end: base_value
    end: base_value

    @triton.constexpr_function
    def __init__(self, start, full_start, full_end, end):
        self.start, self.full_start, self.full_end, self.end = start, full_start, full_end, end


@triton.jit
def kv_blocks(rule, row_start, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The :class:`Blocks` of ``BLOCK_N`` keys that the Q tile of rows ``[row_start, row_start + ROWS)`` visits
    under ``rule`` (a :class:`gstar.kernels.common.rule.Rule`)."""
    nq, nk, left, right, sink_tokens = rule.nq, rule.nk, rule.left, rule.right, rule.sink_tokens
    offset = nk - nq
    row_end = tl.minimum(row_start + ROWS, nq)
    pmin = row_start + offset
    pmax = row_end - 1 + offset
    lo = 0
    hi = nk
    if rule.HAS_LEFT:
        lo = tl.minimum(tl.maximum(pmin - left, 0), nk)
    if rule.HAS_RIGHT:
        hi = tl.maximum(tl.minimum(pmax + right + 1, nk), 0)
    if rule.HAS_CHUNK:  # the chunks of the first and the last row
        lo = tl.minimum(tl.maximum(lo, chunk_start(pmin, rule.chunk)), nk)
        hi = tl.maximum(tl.minimum(hi, chunk_start(pmax, rule.chunk) + rule.chunk), 0)
    sink_blocks = (tl.minimum(sink_tokens, hi) + BLOCK_N - 1) // BLOCK_N  # sink keys obey the right bound
    if rule.HAS_SPANS:  # the last row's span lifts its right bound (any other row's ends at or before it)
        first, last = span_of(rule, pmax)
        if rule.HAS_CHUNK:  # not its chunk's end
            last = tl.minimum(last, chunk_start(pmax, rule.chunk) + rule.chunk)
        hi = tl.where(first < last, tl.maximum(hi, last), hi)
    empty = hi <= lo
    band_start = lo // BLOCK_N
    band_end = (hi + BLOCK_N - 1) // BLOCK_N
    sink_end = tl.minimum(sink_blocks, band_start)
    full_start = band_start
    if rule.HAS_LEFT:
        full_start = tl.maximum(band_start, (tl.maximum(pmax - left, 0) + BLOCK_N - 1) // BLOCK_N)
    full_end = tl.minimum(band_end, nk // BLOCK_N)
    if rule.HAS_RIGHT:
        full_end = tl.minimum(full_end, tl.maximum(pmin + right + 1, 0) // BLOCK_N)
    if rule.HAS_CHUNK:  # keys every row's chunk holds: from the last row's chunk start to the first row's end
        full_start = tl.maximum(full_start, (tl.maximum(chunk_start(pmax, rule.chunk), 0) + BLOCK_N - 1) // BLOCK_N)
        full_end = tl.minimum(full_end, tl.maximum(chunk_start(pmin, rule.chunk) + rule.chunk, 0) // BLOCK_N)
    no_interior = full_end <= full_start
    full_start = tl.where(no_interior, band_end, full_start)
    full_end = tl.where(no_interior, band_end, full_end)
    # an empty band leaves only the sink blocks, as one masked range
    sink_end = tl.where(empty, sink_blocks, sink_end)
    band_start = tl.where(empty, sink_blocks, band_start)
    full_start = tl.where(empty, sink_blocks, full_start)
    full_end = tl.where(empty, sink_blocks, full_end)
    band_end = tl.where(empty, sink_blocks, band_end)
    return Blocks(sink_end, band_start, full_start, full_end, band_end)


@triton.jit
def flat(blocks):
    """The same walk with the whole band as one masked run (segment 1; segments 2 and 3 left unvisited): a narrow
    window's few blocks per segment would otherwise spend most of their time filling and draining three short
    software pipelines."""
    return Blocks(blocks.sink_end, blocks.band_start, blocks.band_end, blocks.full_end, blocks.band_end)


@triton.constexpr_function
def tiles_fastest(has_left: bool, has_right: bool) -> bool:
    """Whether a forward grid walks Q tiles fastest (else heads), given which bounds the pattern has: only
    without any. There every tile reads all of its head's K/V, so the programs running together should be one
    head's tiles, which share that K/V in L2; with heads fastest they span every head. Under a causal mask or a
    window the tiles do unequal work, and heads fastest with tiles last to first starts the longest first. The
    kernels and the host's grids both ask here."""
    return not has_left and not has_right


@triton.jit
def table_blocks(Table, index):
    """The :class:`Blocks` in row ``index`` of a host-built ``(n, 5)`` int32 table
    (:func:`gstar.pattern.kv_block_table`, whose columns are in :class:`Blocks`' order)."""
    row = Table + index * 5
    return Blocks(tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4))


@triton.jit
def segment(blocks, s: tl.constexpr):
    """``(lo, hi)``: the blocks of segment ``s`` of the walk by block: 0 the sink-token blocks, 1 the band's masked
    leading edge, 2 its unmasked interior, 3 its masked trailing edge."""
    if s == 0:
        return 0, blocks.sink_end
    elif s == 1:
        return blocks.band_start, blocks.full_start
    elif s == 2:
        return blocks.full_start, blocks.full_end
    else:
        return blocks.full_end, blocks.band_end


@triton.jit
def block_at(blocks, i):
    """The block of step ``i`` of the walk by step: the sink-token blocks first, then the band."""
    return tl.where(i < blocks.sink_end, i, i - blocks.sink_end + blocks.band_start)


@triton.jit
def first_block(blocks):
    """The block of step 0 (the first sink-token block, else the band's first)."""
    return tl.where(blocks.sink_end > 0, 0, blocks.band_start)


@triton.jit
def steps(blocks):
    """``(lead_end, full_end, n)`` of the walk by step: steps ``[0, lead_end)`` are masked (the sink-token blocks and
    the band's leading edge), ``[lead_end, full_end)`` unmasked, ``[full_end, n)`` masked; ``n`` steps in all."""
    return (blocks.sink_end + blocks.full_start - blocks.band_start,
            blocks.sink_end + blocks.full_end - blocks.band_start,
            blocks.sink_end + blocks.band_end - blocks.band_start)


@triton.jit
def tile_segment(tiles, r: tl.constexpr):
    """``(lo, hi)``: the Q tiles of segment ``r`` of a KV block's walk: 0 its masked leading edge, 1 its unmasked
    interior, 2 its masked trailing edge."""
    if r == 0:
        return tiles.start, tiles.full_start
    elif r == 1:
        return tiles.full_start, tiles.full_end
    else:
        return tiles.full_end, tiles.end


@triton.jit
def q_tiles(rule, key_start, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The :class:`Tiles` of ``BLOCK_M`` rows that see a key of the block ``[key_start, key_start + BLOCK_N)``
    under ``rule``."""
    nq, nk, left, right, sink_tokens = rule.nq, rule.nk, rule.left, rule.right, rule.sink_tokens
    offset = nk - nq
    key_end = tl.minimum(key_start + BLOCK_N, nk)
    rmin = 0
    rmax = nq
    if rule.HAS_RIGHT:
        rmin = tl.maximum(key_start - right - offset, 0)  # first row whose right bound reaches the block
        if rule.HAS_SPANS:  # earlier rows of the first key's span (any other key's span starts at or after it)
            first, last = span_of(rule, key_start)
            rmin = tl.where(first < last, tl.maximum(tl.minimum(rmin, first - offset), 0), rmin)
    if rule.HAS_LEFT:
        # rows after the last one whose left bound reaches the block; a sink key is seen by every later row
        reach = tl.minimum(key_end + left - offset, nq)
        rmax = tl.where(key_start >= sink_tokens, reach, nq)
    if rule.HAS_CHUNK:  # rows in the chunks of the block's keys (a sink key escapes the chunk's start)
        rmin = tl.maximum(rmin, key_start // rule.chunk * rule.chunk - offset)
        reach = tl.minimum(rmax, (key_end - 1) // rule.chunk * rule.chunk + rule.chunk - offset)
        rmax = tl.where(key_start >= sink_tokens, reach, rmax)
    empty = rmax <= rmin
    start = rmin // BLOCK_M
    end = (tl.maximum(rmax, 0) + BLOCK_M - 1) // BLOCK_M
    full_start = start
    if rule.HAS_RIGHT:
        full_start = tl.maximum(start, (tl.maximum(key_end - 1 - right - offset, 0) + BLOCK_M - 1) // BLOCK_M)
    full_end = tl.minimum(end, nq // BLOCK_M)
    if rule.HAS_CHUNK:  # rows whose chunk ends past the block
        chunk_rows = tl.maximum((key_end - 1) // rule.chunk * rule.chunk - offset, 0)
        full_start = tl.maximum(full_start, (chunk_rows + BLOCK_M - 1) // BLOCK_M)
    if rule.HAS_LEFT:
        first_plain_key = tl.maximum(key_start, sink_tokens)  # smallest key that needs the left bound
        plain_end = tl.maximum(first_plain_key + left - offset + 1, 0) // BLOCK_M
        full_end = tl.where(key_end > sink_tokens, tl.minimum(full_end, plain_end), full_end)
    if rule.HAS_CHUNK:  # rows whose chunk starts at or before the block's first plain key
        first_plain_key = tl.maximum(key_start, sink_tokens)
        chunk_end = tl.maximum(first_plain_key // rule.chunk * rule.chunk + rule.chunk - offset, 0) // BLOCK_M
        full_end = tl.where(key_end > sink_tokens, tl.minimum(full_end, chunk_end), full_end)
    no_interior = (key_end - key_start < BLOCK_N) | (full_end <= full_start)
    full_start = tl.where(no_interior, end, full_start)
    full_end = tl.where(no_interior, end, full_end)
    start = tl.where(empty, 0, start)
    full_start = tl.where(empty, 0, full_start)
    full_end = tl.where(empty, 0, full_end)
    end = tl.where(empty, 0, end)
    return Tiles(start, full_start, full_end, end)
