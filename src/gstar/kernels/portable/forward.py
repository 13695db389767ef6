"""The portable forward kernel (any Triton GPU, and the CPU under the interpreter): one program per (Q tile,
query heads, batch), online softmax over KV blocks, and its host side (a launch plan cached per layout).

Each program loads its ``(BLOCK_M, D)`` Q tile once and walks the KV blocks of :func:`kv_blocks` by segment: the
sink-token blocks, the band's masked leading edge, its unmasked interior and its masked trailing edge. Only the
masked segments evaluate the rule; the interior runs without any mask arithmetic.

Switches, chosen per call by :func:`gstar.kernels.portable.tiles.forward_config` and timed by
``scripts/tune-forward``: ``PACK`` stacks several query heads of one GQA group in a tile so each K/V block is
loaded once for all of them; ``FLAT`` walks the window band in one masked loop (narrow windows); ``HALVES`` runs
the tile as two halves whose softmax and products overlap (D = 128 on Hopper). The rest follows from the
arguments: learned sinks from ``Sinks``, packed sequences from ``CuQ`` / ``CuK`` (each sequence's bounds read on
the device, one launch for all), the grid order from the pattern's :class:`Mask` (:func:`tiles_fastest`), the
padded head dims from ``HEAD_DIM`` (queries and keys) and ``VALUE_DIM`` (values and the output, which may be
narrower or wider).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...pattern import Pattern, cdiv
from ..common.fp8 import descale_args, load_descales
from ..common.rule import bounds, mask, packed_slot, rule, sequence_bounds, tile_rows
from ..common.sizes import pad_head_dim
from ..common.softmax import finish_state, softcap_args, softcapped, softmax_step, start_state
from ..common.split import Plan
from ..common.walk import flat, kv_blocks, segment, tiles_fastest
from ..launch import constexprs, launch
from .tiles import dot_precision, forward_config

@triton.jit
def _block_offsets(Pages, start_n, page_size, key_strides, value_strides):
    """Offsets of keys ``start_n ..`` from the K and V pointers of key 0: ``*_strides`` (row, page). Paged
    (Pages: the sequence's row of the block table), the block lies in one page (BLOCK_N divides page_size)."""
    if Pages is None:  # the rows follow one another
        k_offset = start_n.to(tl.int64) * key_strides[0]
        v_offset = start_n.to(tl.int64) * value_strides[0]
    else:
        page = tl.load(Pages + start_n // page_size).to(tl.int64)
        row = (start_n % page_size).to(tl.int64)
        k_offset = page * key_strides[1] + row * key_strides[0]
        v_offset = page * value_strides[1] + row * value_strides[0]
    return k_offset, v_offset


@triton.jit
def _attend_blocks(acc, m_i, l_i, q, rows, acc2, m2, l2, q2, rows2, k_ptrs, v_ptrs, key_strides, value_strides,
                   Pages, page_size, offs_n, block_lo, block_hi, qk_scale, softcap, rule, HEAD_DIM: tl.constexpr,
                   VALUE_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, MASKED: tl.constexpr, MAY_BE_EMPTY: tl.constexpr, PRECISION: tl.constexpr,
                   HALVES: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold KV blocks ``[block_lo, block_hi)`` into the running state of one Q tile.

    ``(acc, m_i, l_i, q, rows)`` are the state and rows of the tile (or of its first half with HALVES), as
    in :func:`softmax_step`, with q: (R, D_PAD); ``(acc2, ..., rows2)`` those of the second half (ignored
    and returned as they came without HALVES). k_ptrs: (D_PAD, BLOCK_N) and v_ptrs: (BLOCK_N, DV_PAD) point
    at keys 0..BLOCK_N-1 of this kv head, the others found as :func:`_block_offsets` takes ``key_strides``,
    ``value_strides``, ``Pages`` and ``page_size``; offs_n: (BLOCK_N,). Masked blocks also guard the loads of keys
    past ``rule.nk``; whole blocks load unmasked unless their head dim is padded. ``qk_scale``, ``softcap`` and
    SOFTCAP: the score factors (:func:`softcapped`).
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
        k_offset, v_offset = _block_offsets(Pages, start_n, page_size, key_strides, value_strides)
        k_block = k_ptrs + k_offset
        if MASKED:
            k = tl.load(k_block, mask=d_ok[:, None] & (cols[None, :] < rule.nk), other=0.0)
        elif EVEN_D:
            k = tl.load(k_block)
        else:
            k = tl.load(k_block, mask=d_ok[:, None], other=0.0)
        s = softcapped(tl.dot(q, k, input_precision=PRECISION), softcap, SOFTCAP)  # (R, BLOCK_N) raw scores
        if HALVES:
            s2 = softcapped(tl.dot(q2, k, input_precision=PRECISION), softcap, SOFTCAP)
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, rows, cols, qk_scale, rule, MASKED, MAY_BE_EMPTY)
        # the rescaled accumulator goes into the next dot as its accumulator, so the MMA adds into it in place
        acc = acc * alpha[:, None]
        v_block = v_ptrs + v_offset
        if MASKED:
            v = tl.load(v_block, mask=(cols[:, None] < rule.nk) & dv_ok[None, :], other=0.0)
        elif EVEN_DV:
            v = tl.load(v_block)
        else:
            v = tl.load(v_block, mask=dv_ok[None, :], other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        if HALVES:
            p2, alpha2, m2, l2 = softmax_step(s2, m2, l2, rows2, cols, qk_scale, rule, MASKED, MAY_BE_EMPTY)
            acc2 = acc2 * alpha2[:, None]
            acc2 = tl.dot(p2.to(v.dtype), v, acc2, input_precision=PRECISION)
    return acc, m_i, l_i, acc2, m2, l2


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
@triton.jit(do_not_specialize=["Nq", "Nk", "left", "right", "sink_tokens", "chunk", "short_q", "batch", "page_size"])
def _forward(
        Q, K, V, Sinks, Out, Lse, CuQ, CuK, Seqlens, BlockTable, QDescale, KDescale, VDescale, Spans,
        stride_q, stride_k, stride_v, stride_o, stride_lse, stride_bt,
        group, Nq, Nk, short_q, batch, page_size, left, right, sink_tokens, chunk, qk_scale, softcap, stride_ds,
        stride_spans,
        HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        PACK: tl.constexpr, MASK: tl.constexpr, FLAT: tl.constexpr, HALVES: tl.constexpr, PRECISION: tl.constexpr,
        SOFTCAP: tl.constexpr):
    """Grid ``(Hq // PACK, n_tiles, B)``, its first two axes swapped where :func:`tiles_fastest`.

    Dense (CuQ, CuK None): Q: (B, Hq, Nq, HEAD_DIM); K: (B, Hkv, Nk, HEAD_DIM); V: (B, Hkv, Nk, VALUE_DIM);
    Out: (B, Hq, Nq, VALUE_DIM); Lse: (B, Hq, Nq) float32; n_tiles = cdiv(Nq, BLOCK_M // PACK).
    Packed (CuQ, CuK: (B + 1,) int32): axis 2 is the sequence s, whose rows are ``CuQ[s] .. CuQ[s + 1]`` of
    Q: (total_q, Hq, HEAD_DIM), Out: (total_q, Hq, VALUE_DIM) and keys ``CuK[s] .. CuK[s + 1]`` of
    K: (total_k, Hkv, HEAD_DIM), V: (total_k, Hkv, VALUE_DIM) (batch strides 0); Lse: (Hq, total_q); n_tiles
    covers the longest sequence and the tiles past a shorter one exit at once; Nq, Nk are unused.
    From a cache (Seqlens: (batch,) int32, sequence ``s``'s keys; CuK None; a serving step's long sequences,
    :func:`cache_plan`): K, V contiguous (batch, Hkv, Nmax, ...) or, with BlockTable (batch, max_blocks) int32
    and row stride ``stride_bt``, paged (pages, page_size, Hkv, ...) with strides (page, row, head); Q packed;
    the grid ``(slots, Hq // PACK, 1)``, one slot per tile of ``BLOCK_M // PACK`` queries
    (:func:`packed_slot`); only sequences of more than ``short_q`` queries are taken.
    ``stride_x``: the (batch, head, row) strides of x, whose last stride is 1; stride_lse: (batch, head),
    unit row stride. Hkv = Hq // group. Sinks: None or (Hq,) float32 learned sink logits.
    ``qk_scale``, ``softcap`` and SOFTCAP: the score factors of :func:`softcap_args` (qk_scale > 0).
    ``left``, ``right``, ``sink_tokens``, ``chunk`` and MASK: the pattern (:mod:`gstar.kernels.common.rule`).
    Spans: None, or the keys' span bounds (:func:`gstar.pattern.span_bounds`), (B, Nk, 2) int32 (packed:
    (total_k, 2)) with batch stride ``stride_spans``.
    FP8 inputs (float8_e4m3fn Q and K; V widened to bfloat16 before the launch, so that ``P V`` runs in
    bfloat16): QDescale, KDescale, VDescale and ``stride_ds`` the descales as :func:`load_descales` takes
    them, Out bfloat16, float16 or float32; else the three are None.
    PACK: query heads of one GQA group (PACK divides group) stacked in one tile of BLOCK_M rows, PACK
    heads times BLOCK_M // PACK positions: each K/V block is loaded once for all of them.
    FLAT: walk the window band in one loop with every block masked (:func:`flat`).
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
    # From a cache a pack holds the whole group (the kv heads share nothing), so a slot's neighbours are the
    # next tiles of its sequence, which read the same keys.
    CACHE: tl.constexpr = Seqlens is not None
    PAGED: tl.constexpr = BlockTable is not None
    HEAD_AXIS: tl.constexpr = 1 if CACHE or tiles_fastest(MASK.has_left or MASK.has_chunk, MASK.has_right) else 0
    h0 = tl.program_id(HEAD_AXIS) * PACK  # first query head of this tile
    tile = tl.num_programs(1 - HEAD_AXIS) - 1 - tl.program_id(1 - HEAD_AXIS)
    if CACHE:
        b, tile = packed_slot(CuQ, tile, batch, 1, ROWS)
        q_start, Nq = sequence_bounds(CuQ, b, Nq, True)
        Nq = tl.where(Nq > short_q, Nq, 0)  # the shorter sequences are the split-KV launch's
        k_start, Nk = b * 0, tl.load(Seqlens + b)
    else:
        b = tl.program_id(2).to(tl.int64)  # 64-bit offsets from here on: one head's offset may pass 2^31
        q_start, Nq = sequence_bounds(CuQ, b, Nq, VARLEN)
        k_start, Nk = sequence_bounds(CuK, b, Nk, VARLEN)
    row_start = tile * ROWS
    if VARLEN:  # tiles past a shorter packed sequence (a dense grid has none: no branch around the body)
        if row_start >= Nq:
            return
    seq_spans = Spans
    if Spans is not None:
        seq_spans = Spans + b * stride_spans + k_start * 2
    seq_rule = rule(Nq, Nk, left, right, sink_tokens, chunk, seq_spans, MASK)
    h_kv = (h0 // group).to(tl.int64)
    if SOFTCAP:  # the descales scale the raw scores, inside the tanh
        softcap, v_descale = load_descales(QDescale, KDescale, VDescale, b, h_kv, stride_ds, softcap)
    else:
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
    Pages = BlockTable
    if PAGED:  # strides (page, row, head): key 0's page is found per block
        Pages = BlockTable + b * stride_bt
        k_first, v_first = h_kv * stride_k[2], h_kv * stride_v[2]
        key_strides, value_strides = (stride_k[1], stride_k[0]), (stride_v[1], stride_v[0])
    else:
        k_first = b * stride_k[0] + h_kv * stride_k[1] + k_start * stride_k[2]
        v_first = b * stride_v[0] + h_kv * stride_v[1] + k_start * stride_v[2]
        key_strides, value_strides = (stride_k[2], 0), (stride_v[2], 0)
    k_ptrs = K + k_first + offs_n[None, :] * key_strides[0] + offs_d[:, None]  # (D_PAD, BLOCK_N) K^T
    v_ptrs = V + v_first + offs_n[:, None] * value_strides[0] + offs_dv[None, :]  # (BLOCK_N, DV_PAD)

    blocks = kv_blocks(seq_rule, row_start, ROWS, BLOCK_N)
    if FLAT:
        blocks = flat(blocks)
    # only the segments that can hold blocks are compiled
    for s in tl.static_range(4):
        if (s > 0 or MASK.has_sink_tokens) and (s < 2 or not FLAT):
            lo, hi = segment(blocks, s)
            acc, m_i, l_i, acc2, m2, l2 = _attend_blocks(
                acc, m_i, l_i, q, rows, acc2, m2, l2, q2, rows2, k_ptrs=k_ptrs, v_ptrs=v_ptrs,
                key_strides=key_strides, value_strides=value_strides, Pages=Pages, page_size=page_size,
                offs_n=offs_n, block_lo=lo, block_hi=hi,
                qk_scale=qk_scale, softcap=softcap, rule=seq_rule, HEAD_DIM=HEAD_DIM, VALUE_DIM=VALUE_DIM,
                BLOCK_N=BLOCK_N, MASKED=s != 2, MAY_BE_EMPTY=Sinks is None, PRECISION=PRECISION, HALVES=HALVES,
                SOFTCAP=SOFTCAP)

    if VDescale is not None:  # v's descale: one multiply of the finished tile
        acc, acc2 = acc * v_descale, acc2 * v_descale
    _finish_rows(Out, Lse, acc, m_i, l_i, offs_m, h0, row_start, q_start, b, stride_o, stride_lse, Nq, ROWS,
                 VALUE_DIM)
    if HALVES:
        _finish_rows(Out, Lse, acc2, m2, l2, offs_m + R, h0, row_start, q_start, b, stride_o, stride_lse, Nq, ROWS,
                     VALUE_DIM)


_NO_CACHE = dict(Seqlens=None, BlockTable=None, stride_bt=0, short_q=0, batch=1, page_size=1)  # keys passed as K, V


def batch_strides(stride: tuple, varlen: bool) -> tuple:
    """The (batch, head, row) strides a kernel takes, as one argument, from a tensor's ``stride()``: packed
    sequences are found through cu_seqlens, not a batch stride."""
    return (0, *stride[1:3]) if varlen else tuple(stride[:3])


class _Plan(NamedTuple):
    """A forward launch's grid, the arguments that stay fixed for its layout (by name), and its constexprs."""

    grid: tuple[int, int, int]
    args: dict
    options: tuple


@functools.lru_cache(maxsize=256)
def _plan(q_shape: tuple, q_stride: tuple, k_shape: tuple, k_stride: tuple, v_shape: tuple, v_stride: tuple,
          dtype: torch.dtype, device: torch.device, pattern: Pattern, scale: float, softcap: float, seqs: int | None,
          config: tuple | None, precision: str, spans: bool = False) -> _Plan:
    """The launch of one layout (shapes, strides, dtype, pattern, score factors; ``seqs``: the number of packed
    sequences, None for a dense batch; ``config``: the caller's overrides as sorted items; ``spans``: whether the
    call has spans). A cache hit costs a
    few us, where deriving the launch costs tens at every call, more than a small layer's GPU time."""
    B, Hq, Nq, D = q_shape
    Hkv, Nk, Dv = k_shape[1], k_shape[2], v_shape[3]
    varlen = seqs is not None
    cfg = forward_config(D, dtype, pattern, device, group=Hq // Hkv, value_dim=Dv)
    cfg.update(config or ())
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    pack = math.gcd(cfg["PACK_GQA"], Hq // Hkv, block_m)
    rows = block_m // pack  # positions per tile and head
    grid = (Hq // pack, cdiv(pattern.nq, rows), seqs if varlen else B)
    if tiles_fastest(pattern.has_left, pattern.right >= 0):  # the kernel reads its grid axes by the same rule
        grid = (grid[1], grid[0], grid[2])
    q_s, k_s, v_s = (batch_strides(s, varlen) for s in (q_stride, k_stride, v_stride))
    args = dict(stride_q=q_s, stride_k=k_s, stride_v=v_s, stride_lse=(0 if varlen else Hq * Nq, Nq),
                group=Hq // Hkv, Nq=Nq, Nk=Nk, **_NO_CACHE, **bounds(pattern), **softcap_args(scale, softcap))
    return _Plan(grid, args, constexprs(
        HEAD_DIM=D, VALUE_DIM=Dv, BLOCK_M=block_m, BLOCK_N=block_n, PACK=pack, MASK=mask(pattern, spans),
        FLAT=bool(cfg["FLAT"]), HALVES=bool(cfg["HALVES"]), PRECISION=precision, SOFTCAP=softcap > 0,
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"]))


@functools.lru_cache(maxsize=256)
def cache_plan(B: int, Hq: int, Hkv: int, max_q: int, D: int, Dv: int, dtype: torch.dtype, block_size: int,
               pattern: Pattern, device: torch.device, precision: str, softcap: bool, short_q: int) -> Plan:
    """The launch of a packed serving step's long sequences (more than ``short_q`` of at most ``max_q`` queries;
    ``pattern`` at ``max_q``) against a cache, contiguous or paged (``block_size``; 0: contiguous), as
    :func:`gstar.kernels.common.split.decode` launches it: this kernel's prefill tiles, the keys read in place
    (a paged block within one page). The grid's axis 0 holds a slot per ``BLOCK_M // PACK`` queries of the
    step plus one per sequence (:class:`Plan`'s ``slot_rows``), so it follows total_q, not B times max_q."""
    group = Hq // Hkv
    cfg = forward_config(D, dtype, pattern, device, group=group, value_dim=Dv)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    while block_size % block_n:  # block sizes are multiples of 16, the least BLOCK_N
        block_n //= 2
    pack = math.gcd(cfg["PACK_GQA"], group, block_m)
    args = dict(group=group, Nq=max_q, Nk=0, short_q=short_q, batch=B, page_size=block_size or 1, CuK=None,
                Spans=None, stride_spans=0, **bounds(pattern))
    return Plan(_forward, (B, Hq // pack, 1), 1, args, constexprs(
        HEAD_DIM=D, VALUE_DIM=Dv, BLOCK_M=block_m, BLOCK_N=block_n, PACK=pack, MASK=mask(pattern),
        FLAT=bool(cfg["FLAT"]), HALVES=bool(cfg["HALVES"]), PRECISION=precision, SOFTCAP=softcap,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]), (), max_q, block_m // pack * group)


def forward(q, k, v, sinks, out, lse, pattern: Pattern, scale: float, config: dict | None = None, cu_seqlens=None,
            descale=None, softcap: float = 0.0, spans=None) -> None:
    """Fill ``out`` and ``lse`` with the portable kernel, for the calls of
    :func:`gstar.kernels.dispatch.attention_forward` (shapes as it takes them; scale > 0; an FP8 call's V already
    widened). ``config`` overrides :func:`forward_config` (same keys; missing switches take its defaults), for
    tests and tuning; ``PACK_GQA`` is a request that shrinks to the largest power of two dividing the GQA group.
    ``spans``: None or the keys' span bounds, (B, Nk, 2) int32 contiguous (packed: (total_k, 2))."""
    varlen = cu_seqlens is not None
    plan = _plan(q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, pattern, scale,
                 softcap, cu_seqlens[0].shape[0] - 1 if varlen else None,
                 tuple(sorted(config.items())) if config else None, dot_precision(q.dtype), spans is not None)
    cu_q, cu_k = cu_seqlens if varlen else (None, None)
    launch(_forward, plan.grid, {**plan.args, "Q": q, "K": k, "V": v, "Sinks": sinks, "Out": out, "Lse": lse,
                                 "CuQ": cu_q, "CuK": cu_k, "stride_o": batch_strides(out.stride(), varlen),
                                 "Spans": spans, "stride_spans": 0 if spans is None or varlen else spans.stride(0),
                                 **descale_args(descale)}, plan.options)
