"""The Triton forward kernel: one program per (Q tile, query heads, batch), online softmax over KV blocks.

Each program loads its ``(BLOCK_M, D)`` Q tile once and walks the KV blocks that
:func:`gstar.kernels.ranges.kv_range` (the in-kernel twin of :func:`gstar.pattern.kv_blocks`) finds for it,
in four segments: sink-token blocks, the leading boundary of the window band, the fully visible interior,
and the trailing boundary. Only boundary blocks evaluate the visibility rule
(:func:`gstar.kernels.ranges.visible`); the interior runs without any mask arithmetic. The softmax runs in
base 2: each block's max is taken over raw scores and scaled once per row, and ``exp2(s * qk_scale - m)``
is one FMA per score (the factor must be positive: the host folds a negative or zero scale into q). A
learned sink starts each row's running max (and its running sum at 1), so it costs nothing inside the loop.

Switches, chosen per call by :func:`gstar.kernels.configs.forward_config` and timed by
``scripts/tune-forward``: ``PACK`` stacks several query heads of one GQA group in a tile so each K/V block
is loaded once for all of them; ``FLAT`` walks the window band in one masked loop (narrow windows);
``HALVES`` runs the tile as two halves whose softmax and products overlap (D = 128 on Hopper). The rest
follows from the arguments: learned sinks from ``Sinks``, packed sequences from ``CuQ`` / ``CuK`` (each
sequence's bounds read on the device, one launch for all), the grid order from the window bounds
(:func:`tiles_fastest`), the padded head dims from ``HEAD_DIM`` (queries and keys) and ``VALUE_DIM``
(values and the output, which may be narrower or wider).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .configs import pad_head_dim
from .ranges import kv_range, sequence_bounds, tile_rows, visible

_LOG2E = tl.constexpr(math.log2(math.e))
_LN2 = tl.constexpr(math.log(2.0))


@triton.constexpr_function
def tiles_fastest(has_left: bool, has_right: bool) -> bool:
    """Whether the grid walks Q tiles fastest (else heads): only without any mask bound. There every tile
    reads all of its head's K/V, so the programs running together should be one head's tiles, which share
    that K/V in L2; with heads fastest they span every head (fa D128 full: 16 heads of 4 MB of K/V against
    a 50 MB L2). Under a causal mask or a window the tiles do unequal work, and heads fastest with tiles
    last to first starts the longest first (benchmarks/NOTES.md, 'Full attention walks Q tiles fastest').
    The kernel and the host's grid both ask here."""
    return not has_left and not has_right


@triton.jit
def softmax_step(s, m_i, l_i, rows, cols, qk_scale, Nq, Nk, left, right, sink_tokens,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
                 MASKED: tl.constexpr, MAY_BE_EMPTY: tl.constexpr):
    """One KV block's online-softmax update of R rows: returns ``(p, alpha, m_i, l_i)``, ``p`` the block's
    float32 weights and ``alpha`` (R,) the factor that takes the accumulator to the new max, before
    ``acc = acc * alpha + p @ v``. Every forward kernel calls it (the Hopper one from Gluon).

    s: (R, BLOCK_N) raw scores; m_i, l_i: (R,) float32 running max (base 2, scaled) and running sum; rows: (R,)
    query positions; cols: (BLOCK_N,) key indices; qk_scale > 0.
    ``MASKED`` blocks evaluate :func:`gstar.kernels.ranges.visible`; the others are whole blocks visible to
    every stored row. ``MAY_BE_EMPTY``: a row can still have ``m_i = -inf`` here (no learned sink), so
    masked blocks must shift such rows by 0.
    """
    if MASKED:
        ok = visible(rows[:, None], cols[None, :], Nq, Nk, left, right, sink_tokens,
                     HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS)
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # (R,); max commutes with a positive scale
    if MASKED and MAY_BE_EMPTY:
        # a row that has seen no key yet keeps m = -inf; shift it by 0 so exp2 gives 0, not NaN.
        # m_i itself stays -inf: a finite stand-in could sit far above later scores and flush them to 0
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        shift = m_new  # a whole visible block, or a learned sink, gives every row a finite max
    alpha = tl.math.exp2(m_i - shift)  # (R,)
    p = tl.math.exp2(s * qk_scale - shift[:, None])  # (R, BLOCK_N): one FMA per score
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_blocks(acc, m_i, l_i, q, rows, acc2, m2, l2, q2, rows2,
                   k_ptrs, v_ptrs, stride_kn, stride_vn, offs_n, block_lo, block_hi, qk_scale, Nq, Nk,
                   left, right, sink_tokens, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
                   MASKED: tl.constexpr, MAY_BE_EMPTY: tl.constexpr, PRECISION: tl.constexpr,
                   HALVES: tl.constexpr):
    """Fold KV blocks ``[block_lo, block_hi)`` into the running state of one Q tile.

    ``(acc, m_i, l_i, q, rows)`` are the state and rows of the tile (or of its first half with HALVES), as
    in :func:`softmax_step`, with q: (R, D_PAD); ``(acc2, ..., rows2)`` those of the second half (ignored
    and returned as they came without HALVES). k_ptrs: (D_PAD, BLOCK_N) and v_ptrs: (BLOCK_N, DV_PAD) point
    at keys 0..BLOCK_N-1 of this kv head; offs_n: (BLOCK_N,). Masked blocks also guard the loads of keys
    past ``Nk``; whole blocks load unmasked unless their head dim is padded.
    HALVES: both halves' score products are issued before either softmax, so the tensor cores work on
    the second half's scores, then the first half's output, while the softmax of the other half runs.
    """
    EVEN_D: tl.constexpr = HEAD_DIM == pad_head_dim(HEAD_DIM)
    EVEN_DV: tl.constexpr = VALUE_DIM == pad_head_dim(VALUE_DIM)
    d_ok = tl.arange(0, pad_head_dim(HEAD_DIM)) < HEAD_DIM  # (D_PAD,) real lanes of q and k
    dv_ok = tl.arange(0, pad_head_dim(VALUE_DIM)) < VALUE_DIM  # (DV_PAD,) of v
    for block in range(block_lo, block_hi):
        start_n = block * BLOCK_N
        cols = start_n + offs_n  # (BLOCK_N,)
        k_block = k_ptrs + start_n.to(tl.int64) * stride_kn
        if MASKED:
            k = tl.load(k_block, mask=d_ok[:, None] & (cols[None, :] < Nk), other=0.0)
        elif EVEN_D:
            k = tl.load(k_block)
        else:
            k = tl.load(k_block, mask=d_ok[:, None], other=0.0)
        s = tl.dot(q, k, input_precision=PRECISION)  # (R, BLOCK_N) raw scores
        if HALVES:
            s2 = tl.dot(q2, k, input_precision=PRECISION)
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, rows, cols, qk_scale, Nq, Nk, left, right, sink_tokens,
                                          HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, MASKED, MAY_BE_EMPTY)
        # the rescaled accumulator goes into the next dot as its accumulator, so the MMA adds into it in place
        acc = acc * alpha[:, None]
        v_block = v_ptrs + start_n.to(tl.int64) * stride_vn
        if MASKED:
            v = tl.load(v_block, mask=(cols[:, None] < Nk) & dv_ok[None, :], other=0.0)
        elif EVEN_DV:
            v = tl.load(v_block)
        else:
            v = tl.load(v_block, mask=dv_ok[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        if HALVES:
            p2, alpha2, m2, l2 = softmax_step(s2, m2, l2, rows2, cols, qk_scale, Nq, Nk, left, right,
                                              sink_tokens, HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, MASKED,
                                              MAY_BE_EMPTY)
            acc2 = acc2 * alpha2[:, None]
            acc2 = tl.dot(p2.to(v.dtype), v, acc2, input_precision=PRECISION)
    return acc, m_i, l_i, acc2, m2, l2


def descale_args(descale) -> tuple:
    """A call's descales as the kernels take them: ``(q's, k's, v's)`` pointer arguments (each None for a
    descale of 1; all three None without FP8 inputs) and their (batch, head) strides, six ints (0 for None)."""
    descale = descale or (None,) * 3
    return descale, tuple(s for d in descale for s in (d.stride() if d is not None else (0, 0)))


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
def _start_rows(Q, Sinks, offs, h0, row_start, q_start, b, stride_q, Nq, ROWS: tl.constexpr,
                HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr):
    """Load the Q rows ``offs`` (R,) of the tile and start their softmax state: returns
    ``(q, rows, acc, m_i, l_i)`` as :func:`_attend_blocks` takes them (acc: (R, DV_PAD))."""
    D_PAD: tl.constexpr = pad_head_dim(HEAD_DIM)
    offs_d = tl.arange(0, D_PAD)
    heads, rows, row_ok, tokens = tile_rows(offs, h0, row_start, q_start, Nq, ROWS)
    q_rows = b * stride_q[0] + heads.to(tl.int64) * stride_q[1] + tokens * stride_q[2]  # (R,)
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0)  # (R, D_PAD)
    acc, m_i, l_i = start_state(Sinks, heads, VALUE_DIM)
    return q, rows, acc, m_i, l_i


@triton.jit
def start_state(Sinks, heads, VALUE_DIM: tl.constexpr):
    """The softmax state of rows of query heads ``heads`` (R,) before any key: ``(acc, m_i, l_i)``, acc (R,
    DV_PAD) zeros; with learned sinks (Sinks: (Hq,) float32) the sink is already in the sum."""
    R: tl.constexpr = heads.shape[0]
    acc = tl.zeros([R, pad_head_dim(VALUE_DIM)], dtype=tl.float32)
    if Sinks is not None:
        # exp2(m) * l = exp(sink): the sink is already in the sum, with no value to carry
        m_i = tl.load(Sinks + heads) * _LOG2E  # (R,)
        l_i = tl.zeros([R], dtype=tl.float32) + 1.0
    else:
        m_i = tl.full([R], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([R], dtype=tl.float32)
    return acc, m_i, l_i


@triton.jit
def finish_state(acc, m_i, l_i):
    """``(out, lse)`` of rows' softmax state: out (R, DV_PAD) float32, the natural-log LSE (R,). Rows that saw
    no key (and no sink) have l = 0 and acc = 0: divided by 1, they give exact zeros and LSE -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    return acc / l_safe[:, None], tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * _LN2)


@triton.jit
def _finish_rows(Out, Lse, acc, m_i, l_i, offs, h0, row_start, q_start, b, stride_o, stride_lse, Nq,
                 ROWS: tl.constexpr, VALUE_DIM: tl.constexpr):
    """Normalise and store the rows ``offs`` (R,) of the tile: Out (VALUE_DIM wide) in its dtype, the
    natural-log LSE."""
    offs_d = tl.arange(0, pad_head_dim(VALUE_DIM))
    heads, rows, row_ok, tokens = tile_rows(offs, h0, row_start, q_start, Nq, ROWS)
    out, lse = finish_state(acc, m_i, l_i)  # (R, DV_PAD), (R,)
    out = out.to(Out.dtype.element_ty)
    o_rows = b * stride_o[0] + heads.to(tl.int64) * stride_o[1] + tokens * stride_o[2]  # (R,)
    tl.store(Out + o_rows[:, None] + offs_d[None, :], out, mask=row_ok[:, None] & (offs_d[None, :] < VALUE_DIM))
    tl.store(Lse + b * stride_lse[0] + heads.to(tl.int64) * stride_lse[1] + tokens, lse, mask=row_ok)


# sequence lengths and window bounds change from call to call: specialising on them (== 1, % 16) would
# recompile the kernel for new lengths and buys nothing, since they only enter masks and loop bounds
@triton.jit(do_not_specialize=["Nq", "Nk", "left", "right", "sink_tokens"])
def _forward_kernel(
        Q, K, V, Sinks, Out, Lse, CuQ, CuK, QDescale, KDescale, VDescale,
        stride_q, stride_k, stride_v, stride_o, stride_lse,
        group, Nq, Nk, left, right, sink_tokens, qk_scale, stride_ds,
        HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PACK: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
        FLAT: tl.constexpr, HALVES: tl.constexpr, PRECISION: tl.constexpr):
    """Grid ``(Hq // PACK, n_tiles, B)``, its first two axes swapped where :func:`tiles_fastest`.

    Dense (CuQ, CuK None): Q: (B, Hq, Nq, HEAD_DIM); K: (B, Hkv, Nk, HEAD_DIM); V: (B, Hkv, Nk, VALUE_DIM);
    Out: (B, Hq, Nq, VALUE_DIM); Lse: (B, Hq, Nq) float32; n_tiles = cdiv(Nq, BLOCK_M // PACK).
    Packed (CuQ, CuK: (B + 1,) int32): axis 2 is the sequence s, whose rows are ``CuQ[s] .. CuQ[s + 1]`` of
    Q: (total_q, Hq, HEAD_DIM), Out: (total_q, Hq, VALUE_DIM) and keys ``CuK[s] .. CuK[s + 1]`` of
    K: (total_k, Hkv, HEAD_DIM), V: (total_k, Hkv, VALUE_DIM) (batch strides 0); Lse: (Hq, total_q); n_tiles covers the longest sequence and the tiles past a shorter
    one exit at once; Nq, Nk are unused.
    ``stride_x``: the (batch, head, row) strides of x, whose last stride is 1; stride_lse: (batch, head),
    unit row stride. Hkv = Hq // group. Sinks: None or (Hq,) float32 learned sink logits.
    qk_scale = scale * log2(e) > 0. HAS_LEFT, HAS_RIGHT: whether ``left`` / ``right`` bound the
    window; HAS_SINK_TOKENS: whether ``sink_tokens`` > 0 (under a left bound).
    FP8 inputs (float8_e4m3fn Q and K; V widened to bfloat16 before the launch, so that ``P V`` runs in
    bfloat16): QDescale, KDescale, VDescale and ``stride_ds`` the descales as :func:`load_descales` takes
    them, Out bfloat16, float16 or float32; else the three are None.
    PACK: query heads of one GQA group (PACK divides group) stacked in one tile of BLOCK_M rows, PACK
    heads times BLOCK_M // PACK positions: each K/V block is loaded once for all of them.
    FLAT: walk the window band in one loop with every block masked, instead of masked / unmasked / masked.
    HALVES: the tile's rows as two halves of BLOCK_M // 2, each with its own scores and softmax state, so
    that one half's softmax overlaps the other half's products (BLOCK_M // 2 must still fill the MMA).
    """
    D_PAD: tl.constexpr = pad_head_dim(HEAD_DIM)
    DV_PAD: tl.constexpr = pad_head_dim(VALUE_DIM)
    VARLEN: tl.constexpr = CuQ is not None
    ROWS: tl.constexpr = BLOCK_M // PACK
    # Heads vary fastest, so the query heads of a GQA group run side by side and share K/V through L2, or
    # without mask bounds one head's tiles do, each of which reads all of that head's K/V; tiles run last to
    # first, so under a causal mask the longest rows start first and short ones fill in.
    HEAD_AXIS: tl.constexpr = 1 if tiles_fastest(HAS_LEFT, HAS_RIGHT) else 0
    h0 = tl.program_id(HEAD_AXIS) * PACK  # first query head of this tile
    tile = tl.num_programs(1 - HEAD_AXIS) - 1 - tl.program_id(1 - HEAD_AXIS)
    b = tl.program_id(2).to(tl.int64)  # 64-bit offsets from here on: one head's offset may pass 2^31
    q_start, Nq = sequence_bounds(CuQ, b, Nq, VARLEN)
    k_start, Nk = sequence_bounds(CuK, b, Nk, VARLEN)
    row_start = tile * ROWS
    if VARLEN:  # tiles past a shorter packed sequence (a dense grid has none: no branch around the body)
        if row_start >= Nq:
            return
    h_kv = (h0 // group).to(tl.int64)
    qk_scale, v_descale = load_descales(QDescale, KDescale, VDescale, b, h_kv, stride_ds, qk_scale)

    R: tl.constexpr = BLOCK_M // 2 if HALVES else BLOCK_M  # rows per softmax state
    offs_m = tl.arange(0, R)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q, rows, acc, m_i, l_i = _start_rows(Q, Sinks, offs_m, h0, row_start, q_start, b, stride_q, Nq, ROWS,
                                         HEAD_DIM, VALUE_DIM)
    if HALVES:
        q2, rows2, acc2, m2, l2 = _start_rows(Q, Sinks, offs_m + R, h0, row_start, q_start, b, stride_q, Nq,
                                              ROWS, HEAD_DIM, VALUE_DIM)
    else:  # placeholders that _attend_blocks passes through untouched
        q2, rows2, acc2, m2, l2 = q, rows, acc, m_i, l_i
    k_first = b * stride_k[0] + h_kv * stride_k[1] + k_start * stride_k[2]
    v_first = b * stride_v[0] + h_kv * stride_v[1] + k_start * stride_v[2]
    k_ptrs = K + k_first + offs_n[None, :] * stride_k[2] + offs_d[:, None]  # (D_PAD, BLOCK_N) K^T
    v_ptrs = V + v_first + offs_n[:, None] * stride_v[2] + offs_dv[None, :]  # (BLOCK_N, DV_PAD)

    sink_end, band_start, full_start, full_end, band_end = kv_range(
        row_start, Nq, Nk, left, right, sink_tokens, ROWS, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    if FLAT:
        # one pipelined loop over the whole band, every block masked: a narrow window's few blocks per
        # segment would otherwise spend most of their time filling and draining three short pipelines
        full_start = band_end
    # sink-token blocks, then the band's masked leading edge, unmasked interior and masked trailing edge;
    # only the segments that can hold blocks are compiled
    starts = (0, band_start, full_start, full_end)
    ends = (sink_end, full_start, full_end, band_end)
    for segment in tl.static_range(4):
        if (segment > 0 or HAS_SINK_TOKENS) and (segment < 2 or not FLAT):
            acc, m_i, l_i, acc2, m2, l2 = _attend_blocks(
                acc, m_i, l_i, q, rows, acc2, m2, l2, q2, rows2, k_ptrs=k_ptrs, v_ptrs=v_ptrs,
                stride_kn=stride_k[2], stride_vn=stride_v[2], offs_n=offs_n, block_lo=starts[segment],
                block_hi=ends[segment], qk_scale=qk_scale, Nq=Nq, Nk=Nk, left=left, right=right,
                sink_tokens=sink_tokens, HEAD_DIM=HEAD_DIM, VALUE_DIM=VALUE_DIM, BLOCK_N=BLOCK_N, HAS_LEFT=HAS_LEFT,
                HAS_RIGHT=HAS_RIGHT, HAS_SINK_TOKENS=HAS_SINK_TOKENS, MASKED=segment != 2,
                MAY_BE_EMPTY=Sinks is None, PRECISION=PRECISION, HALVES=HALVES)

    if VDescale is not None:  # v's descale: one multiply of the finished tile
        acc, acc2 = acc * v_descale, acc2 * v_descale
    _finish_rows(Out, Lse, acc, m_i, l_i, offs_m, h0, row_start, q_start, b, stride_o, stride_lse, Nq, ROWS,
                 VALUE_DIM)
    if HALVES:
        _finish_rows(Out, Lse, acc2, m2, l2, offs_m + R, h0, row_start, q_start, b, stride_o, stride_lse, Nq, ROWS,
                     VALUE_DIM)
