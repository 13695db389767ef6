"""The Triton backward: dQ, dK, dV and dsinks, recomputing probabilities from the forward's LSE.

Kernels, each one family specialised by ``tl.constexpr`` flags, in launch order:

* ``_dq``: one program per (Q tile, query head). It first derives its rows'
  ``delta_i = rowsum(dO_i * O_i) - dLSE_i`` and base-2 LSE (stored for ``_dkdv``, so that both compute
  ``P = exp2(s * scale * log2(e) - lse2)`` with one multiply folded into the scores) and its share of
  dsinks, then visits the KV blocks of :func:`gstar.pattern.kv_block_table` (packed sequences:
  :func:`gstar.kernels.ranges.kv_range`, its in-kernel twin).
* ``_dkdv``: one program per (work item, kv head, head split). A work item is a KV tile, or a chunk of the
  Q tiles that see it (:func:`gstar.pattern.q_block_table`), and a head split a slice of the kv head's
  GQA group; the program keeps K, V and the dK, dV accumulators on chip while it walks those (head,
  Q tile) pairs. K/V are never expanded. :func:`split_plan` picks the split from the SM count: with few kv
  heads (MQA: 64 KV tiles on 132 SMs) or one KV tile seen by every Q tile (sink tokens, causal starts)
  a single program per tile would leave SMs idle behind one long program. With learned sinks the program
  of the first item (of the first sequence) of each (kv head, head split) also adds up its query heads'
  dsinks shares, after its own tile.
* ``_sum_partials``: when work is split, each program writes float32 partials and this kernel adds them,
  per KV tile, in a fixed order. Without a split ``_dkdv`` writes dK, dV directly.

On Hopper, large dense problems read the tiles each step loads (dQ: K, V; dK/dV: Q, dO) through tensor
descriptors (``TMA``, :mod:`gstar.kernels.descriptors`; chosen by ``configs.backward_config``): the copy
engine zero-fills rows past the sequence and lanes past the head dim, so those loads need no masks.

Packed sequences (``VARLEN``) run the same kernels with the sequence on grid axis 2: each program reads
its sequence's bounds from ``cu_seqlens`` on the device, so one launch per kernel covers every sequence.

Each tile step is one ``@triton.jit`` helper with a ``MASKED`` flag. By default a program walks masked
boundary ranges and an unmasked interior as separate loops (interior tiles skip the visibility rule of
:mod:`gstar.pattern`); with ``FLAT`` it walks all its tiles as one masked loop, which narrow windows
prefer (their ranges are one or two tiles long, too short to pipeline). No atomics and a fixed loop and
summation order: the gradients are bitwise reproducible. Memory is linear in N: besides the gradients,
``delta`` and the base-2 LSE, both ``(B, Hq, Nq)`` float32, and the partials, at most
``_MAX_PARTIAL_RATIO`` times dK + dV's size in float32 (and only when the grid is small).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..pattern import (KV_BAND_END, KV_BAND_START, KV_FULL_END, KV_FULL_START, KV_SINK_END, Q_END, Q_FULL_END,
                       Q_FULL_START, Q_START, Pattern, cdiv, kv_block_table, q_block_table)
from .. import buffers
from . import descriptors
from .configs import BackwardConfig, backward_config, dot_precision, next_power_of_2, pad_head_dim
from .forward import batch_strides
from .launch import constexprs, launch
from .ranges import kv_range, q_range, sequence_bounds, tile_rows, visible

LOG2E = math.log2(math.e)
_LOG2E = tl.constexpr(LOG2E)
# columns of the dK/dV work table (split_plan): the KV tile, then its Q tile ranges like q_block_table's
W_TILE, W_START, W_FULL_START, W_FULL_END, W_END = range(5)
# the kernels read table rows in column order (_table_row)
assert (KV_SINK_END, KV_BAND_START, KV_FULL_START, KV_FULL_END, KV_BAND_END) == tuple(range(5))
# dK/dV splitting: programs aim at this many (Q tile, head) steps at least (a K/V load and a partial store
# must pay off), at most this many items per KV tile, and partials at most this many times dK + dV's size
_MIN_STEPS = 4
_MAX_Q_SPLITS = 16
_MAX_PARTIAL_RATIO = 8


@triton.jit
def _load_rows(ptr, idx, n, stride, offs_d, CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
               D_PAD: tl.constexpr):
    """Rows ``idx`` (R,) of an (n, HEAD_DIM) matrix with row stride ``stride`` as an (R, D_PAD) tile, zeros
    outside. Unchecked rows and an unpadded head dim load without a mask."""
    ptrs = ptr + idx.to(tl.int64)[:, None] * stride + offs_d[None, :]
    if CHECK_ROWS:
        x = tl.load(ptrs, mask=(idx[:, None] < n) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM != D_PAD:
        x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _load_pair(A, B, seq, head, start, n, stride_a, stride_b, offs_d, ROWS: tl.constexpr, CHECK_ROWS: tl.constexpr,
               HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TMA: tl.constexpr):
    """Rows ``start .. start + ROWS - 1`` of one head of two operands as (ROWS, D_PAD) tiles, zeros outside.

    With TMA, A and B are descriptors over (B, H, n, HEAD_DIM) read at batch ``seq``, head ``head`` (int32),
    whose copy engine zero-fills rows past n and lanes past HEAD_DIM; otherwise pointers at row 0 of the
    head (see ``_load_rows``).
    """
    if TMA:
        a = A.load([seq, head, start, 0]).reshape(ROWS, D_PAD)
        b = B.load([seq, head, start, 0]).reshape(ROWS, D_PAD)
    else:
        idx = start + tl.arange(0, ROWS)                                                # (ROWS,)
        a = _load_rows(A, idx, n, stride_a, offs_d, CHECK_ROWS, HEAD_DIM, D_PAD)
        b = _load_rows(B, idx, n, stride_b, offs_d, CHECK_ROWS, HEAD_DIM, D_PAD)
    return a, b


@triton.jit
def _store_rows(ptr, idx, n, stride, offs_d, x, HEAD_DIM: tl.constexpr):
    """Stores the (R, D_PAD) tile ``x`` into rows ``idx`` (R,) of an (n, HEAD_DIM) matrix, cast to its dtype."""
    ptrs = ptr + idx.to(tl.int64)[:, None] * stride + offs_d[None, :]
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=(idx[:, None] < n) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _head_rows(A, B, b, h, start, stride_ab, stride_ah, stride_an, stride_bb, stride_bh, stride_bn,
               TMA: tl.constexpr):
    """Row ``start`` of head ``h`` of batch ``b`` (int64) in two (B, H, N, D) operands, or with TMA the
    descriptors themselves (their loads take the indices)."""
    if TMA:
        a_rows = A
        b_rows = B
    else:
        a_rows = A + b * stride_ab + h * stride_ah + start * stride_an
        b_rows = B + b * stride_bb + h * stride_bh + start * stride_bn
    return a_rows, b_rows


@triton.jit
def _table_row(Table, index):
    """The five int32 columns of row ``index`` of an ``(n, 5)`` contiguous table, in column order."""
    row = Table + index * 5
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)


@triton.jit
def _dkdv_step(
    dk, dv, k, v, Q, DO, LSE2, DELTA, seq, head, m_start, stride_qn, stride_don, offs_n, offs_d,
    nq, nk, left, right, sink_tokens, qk_scale,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TMA: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Adds one Q tile's contribution to dk, dv (BLOCK_N, D_PAD) float32.

    k, v: (BLOCK_N, D_PAD); LSE2, DELTA point at the (Nq,) rows of one query head, and so do Q, DO, or
    with TMA they are descriptors over (B, Hq, Nq, HEAD_DIM) read at batch ``seq``, head ``head`` (int32).
    Scores are kept transposed, (BLOCK_N, BLOCK_M), so that both products land in the accumulators' layout.
    """
    offs_m = m_start + tl.arange(0, BLOCK_M)                                            # (BLOCK_M,)
    q, do = _load_pair(Q, DO, seq, head, m_start, nq, stride_qn, stride_don, offs_d, BLOCK_M, MASKED, HEAD_DIM,
                       D_PAD, TMA)                                                      # (BLOCK_M, D_PAD)
    if MASKED:
        lse2 = tl.load(LSE2 + offs_m, mask=offs_m < nq, other=float("inf"))             # (BLOCK_M,)
        delta = tl.load(DELTA + offs_m, mask=offs_m < nq, other=0.0)                    # (BLOCK_M,)
    else:
        lse2 = tl.load(LSE2 + offs_m)
        delta = tl.load(DELTA + offs_m)
    # both products that need only loaded tiles first, then the softmax work: H200, dK/dV at gpt-oss causal
    # 1.395 -> 1.33 ms, D128 full 8.48 -> 7.78 ms (the same order made dQ 57% slower: it keeps its own)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)                              # (BLOCK_N, BLOCK_M)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)                            # (BLOCK_N, BLOCK_M)
    p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
    if MASKED:
        ok = visible(offs_m[None, :], offs_n[:, None], nq, nk, left, right, sink_tokens,
                     HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS)
        p_t = tl.where(ok, p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _sum_sink_shares(SHARES, DSINKS, h_first, heads, hq, n_rows, GROUP_PAD: tl.constexpr,
                     SHARE_ROWS: tl.constexpr):
    """dsinks[h] for query heads ``h_first .. h_first + heads - 1``: the sum of their columns of SHARES,
    (n_rows, hq) float32 (``_dq``'s per-tile shares), in a fixed order. GROUP_PAD: a power of two >= heads."""
    offs_h = tl.arange(0, GROUP_PAD)                                                    # (GROUP_PAD,)
    head_ok = offs_h < heads
    total = tl.zeros([GROUP_PAD], dtype=tl.float32)
    for r in range(0, n_rows, SHARE_ROWS):
        rows = r + tl.arange(0, SHARE_ROWS)                                             # (SHARE_ROWS,)
        ptrs = SHARES + rows.to(tl.int64)[:, None] * hq + h_first + offs_h[None, :]      # (SHARE_ROWS, GROUP_PAD)
        total += tl.sum(tl.load(ptrs, mask=(rows[:, None] < n_rows) & head_ok[None, :], other=0.0), axis=0)
    tl.store(DSINKS + h_first + offs_h, total, mask=head_ok)


@triton.jit
def _dkdv(
    Q, K, V, DO, LSE2, DELTA, DK, DV, WORK, SHARES, DSINKS, CuQ, CuK,
    stride_qb, stride_qh, stride_qn,        # Q: (B, Hq, Nq, D)
    stride_kb, stride_kh, stride_kn,        # K: (B, Hkv, Nk, D)
    stride_vb, stride_vh, stride_vn,        # V: (B, Hkv, Nk, D)
    stride_dob, stride_doh, stride_don,     # DO: (B, Hq, Nq, D)
    stride_dkb, stride_dkh, stride_dkn,     # DK: (B, Hkv, Nk, D) (unused if SPLIT)
    stride_dvb, stride_dvh, stride_dvn,     # DV: (B, Hkv, Nk, D) (unused if SPLIT)
    stride_lb, stride_lh,                   # LSE2, DELTA: (B, Hq, Nq) float32, unit last stride
    nq, nk, head_splits, n_items,           # WORK: (n_items, 5) int32 (dense only)
    n_shares,                               # SHARES: (n_shares, Hq) float32, DSINKS: (Hq,) (if HAS_SINKS)
    left, right, sink_tokens, scale, qk_scale,
    SPLIT: tl.constexpr, HAS_SINKS: tl.constexpr, GROUP_PAD: tl.constexpr, SHARE_ROWS: tl.constexpr,
    FLAT: tl.constexpr, VARLEN: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr, PRECISION: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    TMA: tl.constexpr,
):
    """Grid ``(n_items, Hkv * head_splits, B)``: dK, dV of one KV tile of one kv head, summed over
    ``GROUP // head_splits`` query heads and the Q tiles of one work item.

    Dense: the items and their Q tile ranges come from WORK (see :func:`split_plan`). VARLEN: axis 2 is the
    sequence, found through CuQ, CuK (see ``_forward_kernel``), every KV tile of the longest one is an item,
    and :func:`gstar.kernels.ranges.q_range` finds its Q tiles. Without SPLIT every KV tile is one item and
    the whole group one split: the result goes to DK, DV in their dtype. With SPLIT (dense only) DK and DV
    are float32 partials ``(B, Hkv, head_splits, n_items, BLOCK_N, D_PAD)`` contiguous, summed by
    ``_sum_partials``. TMA (dense only): Q and DO are tensor descriptors moving (1, 1, BLOCK_M, D_PAD) tiles.
    HAS_SINKS: the program of item 0 and sequence 0 of each (kv head, head split) also sums its query
    heads' dsinks shares, which ``_dq`` (launched before) stored, into DSINKS (one launch fewer).
    """
    item = tl.program_id(0)
    pid_h = tl.program_id(1)
    seq = tl.program_id(2)
    b = seq.to(tl.int64)
    hkv = (pid_h // head_splits).to(tl.int64)
    split = pid_h % head_splits
    heads = GROUP // head_splits
    q_start, nq = sequence_bounds(CuQ, b, nq, VARLEN)
    k_start, nk = sequence_bounds(CuK, b, nk, VARLEN)
    h_first = hkv * GROUP + split * heads  # this program's query heads: h_first .. h_first + heads - 1
    hq = (tl.num_programs(1) // head_splits) * GROUP
    if VARLEN:
        tile = item
        if tile * BLOCK_N >= nk:  # tiles past a shorter packed sequence
            if HAS_SINKS:
                if (item == 0) & (seq == 0):  # a first sequence without keys still owes its dsinks sum
                    _sum_sink_shares(SHARES, DSINKS, h_first, heads, hq, n_shares, GROUP_PAD, SHARE_ROWS)
            return
        m_start, m_full_start, m_full_end, m_end = q_range(tile * BLOCK_N, nq, nk, left, right, sink_tokens,
                                                           BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    else:
        # a dense batch reads its ranges from the host-built table: computing them here (as packed sequences
        # must) measured slower, e.g. dK/dV at D = 128 full attention 8.6 -> 9.6 ms on an H200
        tile, m_start, m_full_start, m_full_end, m_end = _table_row(WORK, item)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)                                     # (BLOCK_N,)
    offs_d = tl.arange(0, D_PAD)                                                        # (D_PAD,)
    k_head = K + b * stride_kb + hkv * stride_kh + k_start * stride_kn
    v_head = V + b * stride_vb + hkv * stride_vh + k_start * stride_vn
    k = _load_rows(k_head, offs_n, nk, stride_kn, offs_d, True, HEAD_DIM, D_PAD)
    v = _load_rows(v_head, offs_n, nk, stride_vn, offs_d, True, HEAD_DIM, D_PAD)
    dk = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
    if FLAT:  # one pipelined loop over (head, Q tile) pairs, every tile masked
        n_m = m_end - m_start
        for it in range(0, heads * n_m):
            h = h_first + it // n_m
            m = m_start + it % n_m
            q_head, do_head = _head_rows(Q, DO, b, h, q_start, stride_qb, stride_qh, stride_qn, stride_dob,
                                         stride_doh, stride_don, TMA)
            lse2_head = LSE2 + b * stride_lb + h * stride_lh + q_start
            delta_head = DELTA + b * stride_lb + h * stride_lh + q_start
            dk, dv = _dkdv_step(dk, dv, k, v, q_head, do_head, lse2_head, delta_head, seq, h.to(tl.int32),
                                m * BLOCK_M, stride_qn, stride_don, offs_n, offs_d, nq, nk, left, right, sink_tokens,
                                qk_scale, True, HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, BLOCK_M, HEAD_DIM, D_PAD, TMA,
                                PRECISION)
    else:
        for g in range(split * heads, split * heads + heads):
            h = hkv * GROUP + g
            q_head, do_head = _head_rows(Q, DO, b, h, q_start, stride_qb, stride_qh, stride_qn, stride_dob,
                                         stride_doh, stride_don, TMA)
            lse2_head = LSE2 + b * stride_lb + h * stride_lh + q_start
            delta_head = DELTA + b * stride_lb + h * stride_lh + q_start
            bounds = (m_start, m_full_start, m_full_end, m_end)
            for r in tl.static_range(3):  # masked edge, unmasked interior, masked edge: one loop each
                for m in range(bounds[r], bounds[r + 1]):
                    dk, dv = _dkdv_step(dk, dv, k, v, q_head, do_head, lse2_head, delta_head, seq, h.to(tl.int32),
                                        m * BLOCK_M, stride_qn, stride_don, offs_n, offs_d, nq, nk, left, right,
                                        sink_tokens, qk_scale, r != 1, HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS,
                                        BLOCK_M, HEAD_DIM, D_PAD, TMA, PRECISION)
    if SPLIT:
        # pid_h = hkv * head_splits + split, so this is partial [b, hkv, split, item]
        slot = ((b * tl.num_programs(1) + pid_h) * n_items + item) * (BLOCK_N * D_PAD)
        tile_offs = tl.arange(0, BLOCK_N)[:, None] * D_PAD + offs_d[None, :]           # (BLOCK_N, D_PAD)
        tl.store(DK + slot + tile_offs, dk * scale)
        tl.store(DV + slot + tile_offs, dv)
    else:
        dk_head = DK + b * stride_dkb + hkv * stride_dkh + k_start * stride_dkn
        dv_head = DV + b * stride_dvb + hkv * stride_dvh + k_start * stride_dvn
        _store_rows(dk_head, offs_n, nk, stride_dkn, offs_d, dk * scale, HEAD_DIM)
        _store_rows(dv_head, offs_n, nk, stride_dvn, offs_d, dv, HEAD_DIM)
    if HAS_SINKS:
        if (item == 0) & (seq == 0):  # last: placed first, it measurably changed the code of the loops above
            _sum_sink_shares(SHARES, DSINKS, h_first, heads, hq, n_shares, GROUP_PAD, SHARE_ROWS)


@triton.jit
def _sum_partials(
    PK, PV, DK, DV, FIRST,
    stride_dkb, stride_dkh, stride_dkn,     # DK: (B, Hkv, Nk, D)
    stride_dvb, stride_dvh, stride_dvn,     # DV: (B, Hkv, Nk, D)
    Hkv, nk, head_splits, n_items,          # PK, PV: (B, Hkv, head_splits, n_items, BLOCK_N, D_PAD) float32
    BLOCK_N: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    """Grid ``(cdiv(Nk, BLOCK_N), Hkv, B)``: dK, dV of one KV tile = the sum of its partials, head split by
    head split and work item by work item (a fixed order: bitwise reproducible). FIRST: (n tiles + 1,) int32,
    the tile's items are ``FIRST[t] .. FIRST[t + 1] - 1``."""
    tile = tl.program_id(0)
    hkv = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    first = tl.load(FIRST + tile)
    last = tl.load(FIRST + tile + 1)
    offs_d = tl.arange(0, D_PAD)                                                        # (D_PAD,)
    head_base = (b * Hkv + hkv) * head_splits
    for r in range(0, BLOCK_N, ROWS):
        offs_r = r + tl.arange(0, ROWS)                                                 # (ROWS,)
        tile_offs = offs_r[:, None] * D_PAD + offs_d[None, :]                           # (ROWS, D_PAD)
        dk = tl.zeros((ROWS, D_PAD), dtype=tl.float32)
        dv = tl.zeros((ROWS, D_PAD), dtype=tl.float32)
        for s in range(0, head_splits):
            for i in range(first, last):
                slot = ((head_base + s) * n_items + i) * (BLOCK_N * D_PAD)
                dk += tl.load(PK + slot + tile_offs)
                dv += tl.load(PV + slot + tile_offs)
        offs_n = tile * BLOCK_N + offs_r
        _store_rows(DK + b * stride_dkb + hkv * stride_dkh, offs_n, nk, stride_dkn, offs_d, dk, HEAD_DIM)
        _store_rows(DV + b * stride_dvb + hkv * stride_dvh, offs_n, nk, stride_dvn, offs_d, dv, HEAD_DIM)


@triton.jit
def _dq_step(
    dq, q, do, lse2, delta, K, V, seq, kv_head, n_start, stride_kn, stride_vn, offs_m, offs_d,
    nq, nk, left, right, sink_tokens, qk_scale,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, TMA: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Adds one KV block's contribution to dq (BLOCK_M, D_PAD) float32.

    q, do: (BLOCK_M, D_PAD); lse2, delta: (BLOCK_M,); K, V point at key 0 of the kv head, or with TMA are
    descriptors over (B, Hkv, Nk, HEAD_DIM) read at batch ``seq``, head ``kv_head`` (int32).
    """
    offs_n = n_start + tl.arange(0, BLOCK_N)                                            # (BLOCK_N,)
    k, v = _load_pair(K, V, seq, kv_head, n_start, nk, stride_kn, stride_vn, offs_d, BLOCK_N, MASKED, HEAD_DIM,
                      D_PAD, TMA)                                                       # (BLOCK_N, D_PAD)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)                                # (BLOCK_M, BLOCK_N)
    p = tl.math.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        ok = visible(offs_m[:, None], offs_n[None, :], nq, nk, left, right, sink_tokens,
                     HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS)
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                              # (BLOCK_M, BLOCK_N)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _dq(
    Q, K, V, O, DO, DLSE, LSE, Sinks, LSE2, DELTA, DQ, DSINKS, KVTABLE, CuQ, CuK,
    stride_qb, stride_qh, stride_qn,        # Q: (B, Hq, Nq, D)
    stride_kb, stride_kh, stride_kn,        # K: (B, Hkv, Nk, D)
    stride_vb, stride_vh, stride_vn,        # V: (B, Hkv, Nk, D)
    stride_ob, stride_oh, stride_on,        # O: (B, Hq, Nq, D)
    stride_dob, stride_doh, stride_don,     # DO: (B, Hq, Nq, D)
    stride_dqb, stride_dqh, stride_dqn,     # DQ: (B, Hq, Nq, D)
    stride_dlb, stride_dlh, stride_dln,     # DLSE: (B, Hq, Nq), any float dtype (read if HAS_DLSE)
    stride_lb, stride_lh, nq, nk,           # LSE, LSE2, DELTA: (B, Hq, Nq) float32, unit last stride
    left, right, sink_tokens, scale, qk_scale,  # KVTABLE: (cdiv(Nq, BLOCK_M), 5) int32 (dense only)
    HAS_DLSE: tl.constexpr, HAS_SINKS: tl.constexpr, FLAT: tl.constexpr, VARLEN: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr, PRECISION: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, TMA: tl.constexpr,
):
    """Grid ``(n_tiles, Hq // PACK, B)``: dQ of one Q tile of PACK query heads, over the KV blocks that
    :func:`gstar.pattern.kv_block_table` lists (dense) or :func:`gstar.kernels.ranges.kv_range` finds
    (VARLEN: axis 2 is the sequence, see ``_forward_kernel``). PACK (a power of two dividing GROUP) stacks
    query heads of one GQA group in the tile as in the forward: BLOCK_M // PACK positions of each, so every
    K/V block is loaded once for all of them and a narrow window's tile spans fewer keys; n_tiles =
    cdiv(Nq, BLOCK_M // PACK).

    The program first derives its rows' statistics, ``delta = rowsum(dO * O) - dLSE`` and the base-2 LSE,
    and stores them to DELTA and LSE2 for ``_dkdv`` (launched after it). With HAS_SINKS it also stores this
    tile's share of dsinks[h] for each of its heads, ``-sum_rows exp(sinks[h] - lse) * delta``, to DSINKS:
    (B, n_tiles, Hq) float32.
    TMA (dense only): K and V are tensor descriptors moving (1, 1, BLOCK_N, D_PAD) tiles.
    """
    pid_m = tl.program_id(0)
    h0 = tl.program_id(1).to(tl.int64) * PACK  # first query head of the tile
    seq = tl.program_id(2)
    b = seq.to(tl.int64)
    ROWS: tl.constexpr = BLOCK_M // PACK  # positions per tile and head
    q_start, nq = sequence_bounds(CuQ, b, nq, VARLEN)
    k_start, nk = sequence_bounds(CuK, b, nk, VARLEN)
    if HAS_SINKS:  # this tile's shares of dsinks[h0 .. h0 + PACK - 1]: DSINKS[b, pid_m, h0 ...], (B, n_tiles, Hq)
        dsink_slots = (DSINKS + (b * tl.num_programs(0) + pid_m) * (tl.num_programs(1) * PACK) + h0
                       + tl.arange(0, PACK))                                            # (PACK,)
    if VARLEN:  # tiles past a shorter packed sequence (a dense grid has none: no branch around the body)
        if pid_m * ROWS >= nq:
            if HAS_SINKS:
                tl.store(dsink_slots, tl.zeros([PACK], dtype=tl.float32))
            return
    hkv = h0 // GROUP
    # each row's query head, position, whether it is < nq, and index along the sequence axis: (BLOCK_M,)
    heads, pos, rows, tokens = tile_rows(tl.arange(0, BLOCK_M), h0, pid_m * ROWS, q_start, nq, ROWS)
    offs_d = tl.arange(0, D_PAD)                                                        # (D_PAD,)
    tile_ok = rows[:, None] & (offs_d[None, :] < HEAD_DIM)                              # (BLOCK_M, D_PAD)
    q_rows = b * stride_qb + heads * stride_qh + tokens * stride_qn                     # (BLOCK_M,)
    do_rows = b * stride_dob + heads * stride_doh + tokens * stride_don
    o_rows = b * stride_ob + heads * stride_oh + tokens * stride_on
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=tile_ok, other=0.0)         # (BLOCK_M, D_PAD)
    do = tl.load(DO + do_rows[:, None] + offs_d[None, :], mask=tile_ok, other=0.0)
    o = tl.load(O + o_rows[:, None] + offs_d[None, :], mask=tile_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)                        # (BLOCK_M,)
    if HAS_DLSE:
        dlse_rows = b * stride_dlb + heads * stride_dlh + tokens * stride_dln
        delta -= tl.load(DLSE + dlse_rows, mask=rows, other=0.0).to(tl.float32)
    row_ptr = b * stride_lb + heads * stride_lh + tokens                                # (BLOCK_M,)
    # an empty row (lse = -inf, no sinks) sees no key, so it only meets masked tiles: there exp2(s - lse2)
    # is +inf (never NaN, s is finite) and the mask replaces it by 0; rows past the end get +inf, so 0
    lse2 = tl.load(LSE + row_ptr, mask=rows, other=float("inf")) * _LOG2E               # (BLOCK_M,)
    tl.store(DELTA + row_ptr, delta, mask=rows)
    tl.store(LSE2 + row_ptr, lse2, mask=rows)
    if HAS_SINKS:
        # with sinks every lse is finite (>= sinks[h]); rows past the end have delta = 0 and lse2 = inf
        p_sink = tl.math.exp2(tl.load(Sinks + heads) * _LOG2E - lse2)                   # (BLOCK_M,)
        tl.store(dsink_slots, -tl.sum(tl.reshape(p_sink * delta, (PACK, ROWS)), axis=1))
    k_head, v_head = _head_rows(K, V, b, hkv, k_start, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                                stride_vn, TMA)
    kv_head = hkv.to(tl.int32)
    if VARLEN:
        sink_end, band_start, full_start, full_end, band_end = kv_range(
            pid_m * ROWS, nq, nk, left, right, sink_tokens, ROWS, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    else:  # the host table, as in _dkdv (computing the ranges here measured slower for dense batches)
        sink_end, band_start, full_start, full_end, band_end = _table_row(KVTABLE, pid_m)
    dq = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
    if FLAT:  # one pipelined loop over the sink blocks then the band, every block masked
        for i in range(0, sink_end + band_end - band_start):
            n = tl.where(i < sink_end, i, band_start + i - sink_end)
            dq = _dq_step(dq, q, do, lse2, delta, k_head, v_head, seq, kv_head, n * BLOCK_N, stride_kn, stride_vn,
                          pos, offs_d, nq, nk, left, right, sink_tokens, qk_scale, True, HAS_LEFT, HAS_RIGHT,
                          HAS_SINK_TOKENS, BLOCK_N, HEAD_DIM, D_PAD, TMA, PRECISION)
    else:
        # sink blocks, then the band's masked edge, unmasked interior and masked edge: one loop each
        starts = (0, band_start, full_start, full_end)
        ends = (sink_end, full_start, full_end, band_end)
        for r in tl.static_range(4):
            for n in range(starts[r], ends[r]):
                dq = _dq_step(dq, q, do, lse2, delta, k_head, v_head, seq, kv_head, n * BLOCK_N, stride_kn,
                              stride_vn, pos, offs_d, nq, nk, left, right, sink_tokens, qk_scale, r != 2,
                              HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, BLOCK_N, HEAD_DIM, D_PAD, TMA, PRECISION)
    dq_rows = b * stride_dqb + heads * stride_dqh + tokens * stride_dqn                 # (BLOCK_M,)
    tl.store(DQ + dq_rows[:, None] + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=tile_ok)


@functools.lru_cache(maxsize=16)
def _sm_count(device: str) -> int:
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


def _auto_split(counts: list[int], group: int, programs: int, sms: int) -> tuple[int, int]:
    """``(head_splits, q_chunk)`` for a KV tile list with ``counts[t]`` Q tiles each; ``programs`` kv heads
    times batch. Aims every program at about ``1 / (2 * sms)`` of the steps (two waves), splitting the group
    first by how long a typical KV tile is, then the Q range of tiles far longer than that (a sink-token
    tile, the first tiles of a causal pattern), within a bounded partial buffer. A grid that needs no split
    to fill the card still gets two half-group programs per tile when its tiles are long-tailed (causal)."""
    longest = max(counts)
    busy = sorted(c for c in counts if c)
    steps = sum(busy) * group * programs
    if sms == 0 or steps < 2 * sms * _MIN_STEPS:  # tiny problems: the partial sum's launch would cost more
        return 1, max(1, longest)
    target = max(_MIN_STEPS, cdiv(steps, 2 * sms))
    typical = busy[len(busy) // 2]
    while True:
        heads = max(d for d in range(1, group + 1) if group % d == 0 and (d == 1 or d * typical <= target))
        q_splits = 1
        if heads * longest > 2 * target:
            q_splits = min(_MAX_Q_SPLITS, cdiv(heads * longest, target))
        chunk = cdiv(longest, q_splits)
        if heads == group and q_splits == 1:
            # causal: the longest tiles run twice the mean, and halving their programs shortens the tail
            # (H200: gpt-oss causal backward 2.39 -> 2.28 ms, 8k 4.40 -> 4.25); a 128-key window is even
            # and prefers whole-group programs (0.334 vs 0.374 ms split)
            if group % 2 == 0 and 2 * longest > 3 * sum(busy) / len(busy):
                return 2, longest
            return 1, longest
        items = sum(max(1, cdiv(c, chunk)) for c in counts)
        if group // heads * items <= _MAX_PARTIAL_RATIO * len(counts):
            return group // heads, chunk
        target *= 2


@functools.lru_cache(maxsize=256)
def _plan(pattern: Pattern, block_m: int, block_n: int, group: int, programs: int, sms: int, head_splits: int,
          q_chunk: int, device: str):
    ranges = q_block_table(pattern, block_m, block_n).tolist()                    # (n tiles, 4)
    counts = [r[Q_END] - r[Q_START] for r in ranges]
    auto_heads, auto_chunk = _auto_split(counts, group, programs, sms)
    head_splits, q_chunk = head_splits or auto_heads, q_chunk or auto_chunk
    if group % head_splits:
        raise ValueError(f"head_splits={head_splits} must divide the GQA group ({group})")
    items, first = [], [0]
    for tile, r in enumerate(ranges):
        start, full_start, full_end, end = r[Q_START], r[Q_FULL_START], r[Q_FULL_END], r[Q_END]
        lo = start
        while True:  # one item per chunk of q_chunk Q tiles, at least one per tile (it zeroes unseen keys)
            hi = min(end, lo + q_chunk)
            items.append((tile, lo, min(max(full_start, lo), hi), min(max(full_end, lo), hi), hi))
            lo = hi
            if lo >= end:
                break
        first.append(len(items))
    work = torch.tensor(items, dtype=torch.int32).to(device)                      # (n items, 5)
    return head_splits, work, torch.tensor(first, dtype=torch.int32).to(device)


def split_plan(pattern: Pattern, block_m: int, block_n: int, group: int, programs: int, device, *,
               head_splits: int = 0, q_chunk: int = 0) -> tuple[int, torch.Tensor, torch.Tensor]:
    """How ``_dkdv`` divides its work: ``(head_splits, work, first)``, cached per arguments.

    Each KV tile of ``block_n`` keys (seen by the Q tiles of :func:`gstar.pattern.q_block_table`) becomes
    one or more work items of at most ``q_chunk`` Q tiles, and each GQA group of ``group`` query heads
    ``head_splits`` slices; ``programs`` is kv heads times batch. ``work``: int32 ``(n items, 5)`` on
    ``device`` (columns ``W_TILE, W_START, W_FULL_START, W_FULL_END, W_END``); ``first``: int32
    ``(n tiles + 1,)``, tile ``t``'s items are ``first[t] .. first[t + 1] - 1``. Zero arguments are chosen
    from the device's SM count (never split on CPU); one item per tile and one split means no partials.
    """
    sms = _sm_count(str(device)) if torch.device(device).type == "cuda" else 0
    return _plan(pattern, block_m, block_n, group, programs, sms, head_splits, q_chunk, str(device))


class _Plan(NamedTuple):
    """What the backward's launches need besides the data, derived once per layout by :func:`_launch_plan`.
    Scalar tuples are split around the strides of the gradients, which are read from them at each call."""

    stats_shape: tuple          # delta and lse2: (2, B, Hq, Nq) float32
    shares_shape: tuple | None  # dsinks shares: (seqs, n_q_tiles, Hq) float32, None without sinks
    partials_shape: tuple | None  # dK, dV partials: (2, B, Hkv, head_splits, n_items, dkdv_n, D_PAD) or None
    dq_grid: tuple
    dq_head: tuple              # strides of q, k, v, out, dout
    dq_tail: tuple              # strides of dLSE and LSE, Nq, Nk, left, right, sink_tokens, scale, qk_scale
    dq_options: tuple           # constexprs, without and with descriptors
    dq_tma: bool
    kv_table: torch.Tensor | None
    dkdv_grid: tuple
    dkdv_head: tuple            # strides of q, k, v, dout
    dkdv_tail: tuple            # strides of LSE, Nq, Nk, head_splits, n_items, n_shares, left, ..., qk_scale
    dkdv_options: tuple
    dkdv_tma: bool
    work: torch.Tensor | None
    sum_grid: tuple | None      # _sum_partials, when the dK/dV work is split
    sum_tail: tuple
    sum_options: tuple
    first: torch.Tensor | None
    dq_tile: tuple              # descriptor blocks: (1, 1, dq_n, D_PAD) and (1, 1, dkdv_m, D_PAD)
    dkdv_tile: tuple


@functools.lru_cache(maxsize=256)
def _launch_plan(q_shape: tuple, q_stride: tuple, k_shape: tuple, k_stride: tuple, v_stride: tuple,
                 o_stride: tuple, do_stride: tuple, dlse_stride: tuple | None, dtype: torch.dtype,
                 device: torch.device, has_sinks: bool, pattern: Pattern, scale: float, seqs: int | None,
                 config: BackwardConfig | None, precision: str) -> _Plan:
    """The launches of one layout (as ``forward._launch_plan``; ``dlse_stride`` None without an LSE gradient)."""
    B, Hq, Nq, D = q_shape
    Hkv, Nk = k_shape[1], k_shape[2]
    group = Hq // Hkv
    varlen = seqs is not None
    cfg = config or backward_config(D, dtype, pattern, device, batch_heads=B * Hq, group=group)
    d_pad = pad_head_dim(D)
    shared = dict(
        HAS_LEFT=pattern.left >= 0, HAS_RIGHT=pattern.right >= 0, HAS_SINK_TOKENS=pattern.sink_tokens > 0,
        PRECISION=precision, GROUP=group, HEAD_DIM=D, D_PAD=d_pad, FLAT=cfg.flat, VARLEN=varlen,
    )
    runtime = (pattern.left, pattern.right, pattern.sink_tokens, float(scale), scale * LOG2E)
    stats_strides = (Hq * Nq, Nq)  # delta, lse2 and LSE: (B, Hq, Nq) contiguous
    lse_strides = batch_strides((*stats_strides, 1), varlen)[:2]
    q_s, k_s, v_s, o_s, do_s = (batch_strides(s, varlen) for s in (q_stride, k_stride, v_stride, o_stride, do_stride))
    dl_s = batch_strides(dlse_stride or (0, 0, 0), varlen)  # dLSE's (unused without one)

    pack = math.gcd(cfg.dq_pack, group, cfg.dq_m)
    rows = cfg.dq_m // pack  # positions per dQ tile and head
    n_q_tiles = cdiv(pattern.nq, rows)
    programs = seqs if varlen else B
    dq_options = [constexprs(
        HAS_DLSE=dlse_stride is not None, HAS_SINKS=has_sinks, BLOCK_M=cfg.dq_m, BLOCK_N=cfg.dq_n, PACK=pack,
        num_warps=cfg.dq_warps, num_stages=cfg.dq_stages, TMA=tma, **shared) for tma in (False, True)]

    if varlen:
        head_splits, work, first = 1, None, None
        n_items = n_tiles = cdiv(pattern.nk, cfg.dkdv_n)
    else:
        head_splits, work, first = split_plan(pattern, cfg.dkdv_m, cfg.dkdv_n, group, Hkv * B, device,
                                              head_splits=cfg.head_splits, q_chunk=cfg.q_chunk)
        n_tiles, n_items = first.shape[0] - 1, work.shape[0]
    split = head_splits > 1 or n_items > n_tiles
    group_pad = next_power_of_2(group)
    dkdv_options = [constexprs(
        SPLIT=split, HAS_SINKS=has_sinks, GROUP_PAD=group_pad, SHARE_ROWS=max(16, 2048 // group_pad),
        BLOCK_M=cfg.dkdv_m, BLOCK_N=cfg.dkdv_n, num_warps=cfg.dkdv_warps, num_stages=cfg.dkdv_stages, TMA=tma,
        **shared) for tma in (False, True)]
    return _Plan(
        stats_shape=(2, B, Hq, Nq),
        shares_shape=(programs, n_q_tiles, Hq) if has_sinks else None,
        partials_shape=(2, B, Hkv, head_splits, n_items, cfg.dkdv_n, d_pad) if split else None,
        dq_grid=(n_q_tiles, Hq // pack, programs),
        dq_head=(*q_s, *k_s, *v_s, *o_s, *do_s),
        dq_tail=(*dl_s, *lse_strides, Nq, Nk, *runtime),
        dq_options=tuple(dq_options), dq_tma=cfg.dq_tma and not varlen,
        kv_table=None if varlen else kv_block_table(pattern, rows, cfg.dq_n, device),  # (n_q_tiles, 5)
        dkdv_grid=(n_items, Hkv * head_splits, programs),
        dkdv_head=(*q_s, *k_s, *v_s, *do_s),
        dkdv_tail=(*lse_strides, Nq, Nk, head_splits, n_items, programs * n_q_tiles, *runtime),
        dkdv_options=tuple(dkdv_options), dkdv_tma=cfg.dkdv_tma and not varlen, work=work,
        sum_grid=(n_tiles, Hkv, B) if split else None,
        sum_tail=(Hkv, Nk, head_splits, n_items),
        sum_options=constexprs(BLOCK_N=cfg.dkdv_n, ROWS=min(cfg.dkdv_n, max(16, 2048 // d_pad)), HEAD_DIM=D,
                               D_PAD=d_pad, num_warps=4),
        first=first, dq_tile=(1, 1, cfg.dq_n, d_pad), dkdv_tile=(1, 1, cfg.dkdv_m, d_pad),
    )


def attention_backward(dout, q, k, v, out, lse, dlse, sinks, pattern: Pattern, scale: float, *,
                       config: BackwardConfig | None = None,
                       cu_seqlens: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Gradients of attention (docs/design.md section 1) from the forward's output and LSE.

    Args:
        dout, q, out: ``(B, Hq, Nq, D)``; k, v: ``(B, Hkv, Nk, D)``; any strides with unit last stride
            (never copied).
        lse: ``(B, Hq, Nq)`` float32 contiguous, natural log, sink term included (``-inf`` for empty rows).
        dlse: ``None`` or ``(B, Hq, Nq)`` gradient of the returned LSE (any strides and float dtype).
        sinks: ``None`` or ``(Hq,)`` float32 learned sink logits.
        pattern: the normalised :class:`gstar.pattern.Pattern`; scale: multiplies ``q . k``.
        config: a :class:`BackwardConfig` overriding :func:`backward_config` (tests use other tiles, splits
            and loop forms; scripts/tune-backward sweeps them).
        cu_seqlens: ``(cu_q, cu_k)`` for packed sequences, as in
            :func:`gstar.kernels.forward.attention_forward` (B = 1, the sequence axis is total_q / total_k,
            ``pattern`` holds the longest lengths). The dK/dV work is never split then.

    Returns ``(dq, dk, dv, dsinks)``: dq like q, dk like k, dv like v (dtype and memory layout; packed:
    heads-first views of contiguous packed tensors), dsinks
    ``(Hq,)`` float32 or ``None``. Bitwise deterministic on one device (the split depends on its SM
    count): no atomics, fixed loop and summation order.
    """
    B, Hq, Nq, _ = q.shape
    varlen = cu_seqlens is not None
    like = buffers.empty_packed_like if varlen else buffers.empty_like
    if B * Hq * Nq == 0 or k.shape[2] == 0:
        grads = [like(t).zero_() for t in (q, k, v)]
        dsinks = None
        if sinks is not None:  # no keys: out = 0 and lse = sinks[h], so only the LSE's gradient reaches them
            dsinks = torch.zeros(Hq, dtype=torch.float32, device=q.device)
            if dlse is not None:
                dsinks += dlse.float().sum(dim=(0, 2))
        return (*grads, dsinks)
    plan = _launch_plan(q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), dout.stride(),
                        None if dlse is None else dlse.stride(), q.dtype, q.device, sinks is not None, pattern,
                        scale, cu_seqlens[0].shape[0] - 1 if varlen else None, config, dot_precision(q.dtype))
    stats = buffers.empty(plan.stats_shape, dtype=torch.float32, device=q.device)
    delta, lse2 = stats[0], stats[1]                                                # (B, Hq, Nq) each
    cu_q, cu_k = cu_seqlens if varlen else (lse, lse)  # any pointer when VARLEN is off
    dq_tma = plan.dq_tma and descriptors.supported(k, v)
    dkdv_tma = plan.dkdv_tma and descriptors.supported(q, dout)
    k_in, v_in, q_in, do_in = k, v, q, dout
    if dq_tma:  # dQ reads its K, V tiles through descriptors
        k_in, v_in = (descriptors.tiles(t, plan.dq_tile) for t in (k, v))
    if dkdv_tma:  # dK/dV its Q, dO tiles
        q_in, do_in = (descriptors.tiles(t, plan.dkdv_tile) for t in (q, dout))

    # dQ first: its programs also store delta and lse2, which every dK/dV program reads
    dq = like(q)
    shares = dsinks = None
    if sinks is not None:
        shares = buffers.empty(plan.shares_shape, dtype=torch.float32, device=q.device)  # (seqs, n_q_tiles, Hq)
        dsinks = buffers.empty((Hq,), dtype=torch.float32, device=q.device)             # summed by _dkdv
    launch(_dq, plan.dq_grid, (q, k_in, v_in, out, dout, dlse, lse, sinks, lse2, delta, dq, shares,
                               plan.kv_table, cu_q, cu_k),
           (*plan.dq_head, *batch_strides(dq.stride(), varlen), *plan.dq_tail), plan.dq_options[dq_tma])

    dk, dv = like(k), like(v)
    pk, pv = dk, dv
    if plan.partials_shape is not None:
        pk, pv = buffers.empty(plan.partials_shape, dtype=torch.float32, device=q.device)
    launch(_dkdv, plan.dkdv_grid, (q_in, k, v, do_in, lse2, delta, pk, pv, plan.work, shares, dsinks, cu_q, cu_k),
           (*plan.dkdv_head, *batch_strides(dk.stride(), varlen), *batch_strides(dv.stride(), varlen),
            *plan.dkdv_tail), plan.dkdv_options[dkdv_tma])
    if plan.sum_grid is not None:
        launch(_sum_partials, plan.sum_grid, (pk, pv, dk, dv, plan.first),
               (*dk.stride()[:3], *dv.stride()[:3], *plan.sum_tail), plan.sum_options)
    return dq, dk, dv, dsinks
