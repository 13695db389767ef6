"""The rule of docs/design.md section 1 inside the kernels, as one value.

The host describes a call's pattern to a kernel with two arguments: its runtime bounds (:func:`bounds`: ``left``,
``right``, ``sink_tokens``, ``chunk``, never specialised on, so new windows recompile nothing) and which of them
are on (:class:`Mask`, one constexpr); a call with spans adds their bounds as a tensor. Inside, the kernel joins
them with its sequence's lengths into a :class:`Rule` (:func:`rule`), the value every helper takes: :func:`visible`
here, the block walk of :mod:`.walk`, the softmax step of :mod:`.softmax`. :func:`visible` is the twin of
:meth:`gstar.pattern.Pattern.visible`, which stays the specification; ``tests/test_ranges.py`` holds the two
equal.
"""

from typing import NamedTuple

import triton
import triton.language as tl
from triton.language.core import _aggregate as aggregate  # named bundles of values, as Triton's own Gluon code
from triton.language.core import base_value  # a field that is a tensor in some calls, a constant in others

from ...pattern import Pattern


class Mask(NamedTuple):
    """Which bounds of a pattern are on: a kernel's ``MASK`` constexpr (a tuple Triton specialises on)."""

    has_left: bool         # keys below p(i) - left are hidden
    has_right: bool        # keys past p(i) + right are hidden (causal: right = 0)
    has_sink_tokens: bool  # keys below sink_tokens escape the left bounds (the window's, the chunk's)
    has_chunk: bool = False  # keys outside the query's chunk of positions are hidden
    has_spans: bool = False  # a position's span (data: :func:`gstar.pattern.span_bounds`) lifts the right bound


def mask(pattern: Pattern, spans: bool = False) -> Mask:
    """The :class:`Mask` of a normalised pattern (its sink tokens count only under a left bound), with or without
    spans."""
    return Mask(pattern.left >= 0, pattern.right >= 0, pattern.has_left and pattern.sink_tokens > 0,
                pattern.chunk > 0, spans)


def bounds(pattern: Pattern) -> dict:
    """A pattern's runtime bounds, by the names the kernels' parameters take."""
    return {"left": pattern.left, "right": pattern.right, "sink_tokens": pattern.sink_tokens,
            "chunk": pattern.chunk}


@triton.constexpr_function
def _value(x):
    """A field of :class:`Rule`: a runtime value as it is, a Python constant as a constexpr."""
    return x if isinstance(x, base_value) else tl.constexpr(x)


@aggregate
class Rule:
    """The rule of one sequence: its lengths ``nq``, ``nk``, the pattern's bounds and its keys' span bounds
    (``spans``: (nk, 2) int32 ``[start, end)`` per key position, or None), with the constexpr flags ``HAS_LEFT``,
    ``HAS_RIGHT``, ``HAS_SINK_TOKENS``, ``HAS_CHUNK``, ``HAS_SPANS`` (what is off is never read)."""

    nq: base_value
    nk: base_value
    left: base_value
    right: base_value
    sink_tokens: base_value
    chunk: base_value
    spans: base_value
    HAS_LEFT: tl.constexpr
    HAS_RIGHT: tl.constexpr
    HAS_SINK_TOKENS: tl.constexpr
    HAS_CHUNK: tl.constexpr
    HAS_SPANS: tl.constexpr

    @triton.constexpr_function
    def __init__(self, nq, nk, left, right, sink_tokens, chunk, spans, HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS,
                 HAS_CHUNK, HAS_SPANS):
        self.nq, self.nk, self.left, self.right = _value(nq), _value(nk), _value(left), _value(right)
        self.sink_tokens, self.chunk, self.spans = _value(sink_tokens), _value(chunk), _value(spans)
        self.HAS_LEFT, self.HAS_RIGHT = tl.constexpr(HAS_LEFT), tl.constexpr(HAS_RIGHT)
        self.HAS_SINK_TOKENS, self.HAS_CHUNK = tl.constexpr(HAS_SINK_TOKENS), tl.constexpr(HAS_CHUNK)
        self.HAS_SPANS = tl.constexpr(HAS_SPANS)


@triton.jit
def rule(nq, nk, left, right, sink_tokens, chunk, spans, MASK: tl.constexpr):
    """The :class:`Rule` of a sequence of ``nq`` queries and ``nk`` keys under the kernel's bounds and ``MASK``;
    ``spans`` points at the span bounds of the sequence's first key (None without spans)."""
    return Rule(nq, nk, left, right, sink_tokens, chunk, spans, MASK.has_left, MASK.has_right, MASK.has_sink_tokens,
                MASK.has_chunk, MASK.has_spans)


@triton.jit
def span_of(rule, pos):
    """``(start, end)``: the span of key positions ``pos`` (any shape) under ``rule.spans``; empty (``start >=
    end``) for a position in none or outside ``[0, nk)``."""
    inside = (pos >= 0) & (pos < rule.nk)
    at = rule.spans + 2 * tl.where(inside, pos, 0)
    return tl.load(at, mask=inside, other=0), tl.load(at + 1, mask=inside, other=0)


@triton.jit
def chunk_start(pos, chunk):
    """The first position of the chunk holding ``pos``, floored for a negative one (a row before the keys)."""
    return tl.where(pos >= 0, pos // chunk, -((chunk - 1 - pos) // chunk)) * chunk


@triton.jit
def visible(rule, rows, cols):
    """Whether key ``cols`` is visible to query ``rows`` (broadcastable index blocks, ``0 <= rows < nq`` and
    ``cols >= 0``) under ``rule``; keys past ``nk`` are hidden.

    Rows past ``nq`` (the padding of a sequence's last Q tile) are not checked, which saves an operation per
    score: the forward never stores them, and the backward gives them an infinite LSE, hence zero weight.
    """
    ok = cols < rule.nk
    pos = rows + (rule.nk - rule.nq)  # p(i): queries are the last nq positions of the keys
    if rule.HAS_RIGHT:
        near = cols <= pos + rule.right
        if rule.HAS_SPANS:  # the row's span escapes the right bound
            start, end = span_of(rule, pos)
            near = near | ((cols >= start) & (cols < end))
        ok = ok & near
    if rule.HAS_LEFT:
        inside = cols >= pos - rule.left
        if rule.HAS_SINK_TOKENS:
            inside = inside | (cols < rule.sink_tokens)
        ok = ok & inside
    if rule.HAS_CHUNK:  # the query's own chunk; a row before the keys (p(i) < 0) has none
        start = pos // rule.chunk * rule.chunk  # (non-negative pos: the truncated quotient is the floored one)
        inside = cols >= start
        if rule.HAS_SINK_TOKENS:
            inside = inside | (cols < rule.sink_tokens)
        ok = ok & inside & (cols < start + rule.chunk) & (pos >= 0)
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
def packed_slot(Cu, slot, batch, per_query, ROWS: tl.constexpr):
    """``(seq, tile)`` of program ``slot`` of a launch whose grid follows a packed batch's total length, not its
    longest sequence: sequence ``seq`` (of ``batch``; rows ``Cu[seq] .. Cu[seq + 1]``) owns the slots ``[first(seq),
    first(seq + 1))``, ``first(s) = Cu[s] * per_query // ROWS + s``, at least the tiles of ``ROWS`` rows that its
    rows (``per_query`` a query) fill; slots past them are the kernel's to skip. Found by bisection; int64."""
    lo = 0
    hi = batch
    while hi - lo > 1:  # first(lo) <= slot < first(hi)
        mid = (lo + hi) // 2
        inside = tl.load(Cu + mid).to(tl.int64) * per_query // ROWS + mid <= slot
        lo = tl.where(inside, mid, lo)
        hi = tl.where(inside, hi, mid)
    return lo.to(tl.int64), slot - (tl.load(Cu + lo).to(tl.int64) * per_query // ROWS + lo)


@triton.jit
def tile_rows(offs, h0, row_start, q_start, Nq, ROWS: tl.constexpr):
    """Where tile rows ``offs`` (R,) live when a tile stacks query heads ``h0, h0 + 1, ...`` of ROWS
    positions each (PACK_GQA): their query head, their position in the sequence, whether it is a real row
    (< Nq), and their index along the sequence axis of Q / dO / Out (``q_start`` + position). Each is (R,)."""
    heads = h0 + offs // ROWS
    rows = row_start + offs % ROWS
    return heads, rows, rows < Nq, q_start + rows
