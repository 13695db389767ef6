"""The portable backward kernels (any Triton GPU, and the CPU under the interpreter): dQ, dK, dV and dsinks,
recomputing probabilities from the forward's LSE; and their host side (launch plans cached per layout).

Kernels, each one family specialised by ``tl.constexpr`` flags, in launch order:

* ``_dq``: one program per (Q tile, query head). It first derives its rows'
  ``delta_i = rowsum(dO_i * O_i) - dLSE_i`` and base-2 LSE (stored for ``_dkdv``, so that both compute
  ``P = exp2(s * scale * log2(e) - lse2)`` with one multiply folded into the scores) and its share of
  dsinks, then walks the KV blocks of :func:`gstar.pattern.kv_block_table` (packed sequences:
  :func:`gstar.kernels.common.walk.kv_blocks`, its in-kernel twin).
* ``_dkdv``: one program per (work item, kv head, head split). A work item is a KV tile, or a chunk of the
  Q tiles that see it (:func:`gstar.pattern.q_block_table`), and a head split a slice of the kv head's
  GQA group; the program keeps K, V and the dK, dV accumulators on chip while it walks those (head,
  Q tile) pairs. K/V are never expanded. :func:`gstar.kernels.portable.schedule.split_plan` picks the split
  from the SM count: with few kv heads (MQA: 64 KV tiles on 132 SMs) or one KV tile seen by every Q tile
  (sink tokens, causal starts) a single program per tile would leave SMs idle behind one long program. With
  learned sinks the program of the first item (of the first sequence) of each (kv head, head split) also
  adds up its query heads' dsinks shares, after its own tile.
* :func:`gstar.kernels.common.partials.sum_partials`: when work is split, each program writes float32 partials
  and this kernel adds them, per KV tile, in a fixed order. Without a split ``_dkdv`` writes dK, dV directly.

On Hopper, large dense problems read the tiles each step loads (dQ: K, V; dK/dV: Q, dO) through tensor
descriptors (``TMA``, :mod:`gstar.kernels.common.descriptors`; chosen by
:func:`gstar.kernels.portable.tiles.backward_config`): the copy engine zero-fills rows past the sequence and
lanes past the head dim, so those loads need no masks.

Packed sequences (``CuQ``, ``CuK`` given) run the same kernels with the sequence on grid axis 2: each program
reads its sequence's bounds from ``cu_seqlens`` on the device, so one launch per kernel covers every
sequence. Learned sinks, an LSE gradient and the padded head dim likewise follow from the arguments.

Each tile step is one ``@triton.jit`` helper with a ``MASKED`` flag. By default a program walks masked
boundary ranges and an unmasked interior as separate loops (interior tiles skip the rule); with ``FLAT`` it
walks all its tiles as one masked loop, which narrow windows prefer (their ranges are one or two tiles long,
too short to pipeline). No atomics and a fixed loop and summation order: the gradients are bitwise
reproducible. Memory is linear in N: besides the gradients, ``delta`` and the base-2 LSE, both ``(B, Hq, Nq)``
float32, and the partials, a bounded multiple of dK + dV's size in float32 (and only when the grid is small).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ... import buffers
from ...pattern import Pattern, cdiv, kv_block_table
from ..common import descriptors
from ..common.partials import block_rows, store_rows, sum_partials
from ..common.rule import bounds, mask, rule, sequence_bounds, tile_rows, visible
from ..common.sizes import next_power_of_2, pad_head_dim
from ..common.softmax import LOG2E, sink_max, softcap_args, softcapped
from ..common.walk import Tiles, block_at, kv_blocks, q_tiles, segment, steps, table_blocks, tile_segment
from ..launch import constexprs, launch
from .forward import batch_strides
from .schedule import W_END, W_FULL_END, W_FULL_START, W_START, W_TILE, split_plan
from .tiles import BackwardConfig, backward_config, dot_precision

# the kernels read the work table's rows in column order (_work_item)
assert (W_TILE, W_START, W_FULL_START, W_FULL_END, W_END) == tuple(range(5))


@triton.jit
def _work_item(Work, index):
    """``(tile, tiles)`` of row ``index`` of the dK/dV work table (:func:`split_plan`): the KV tile and the
    :class:`Tiles` of its Q range this item walks."""
    row = Work + index * 5
    return tl.load(row), Tiles(tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4))


@triton.jit
def _load_rows(ptr, idx, n, stride, CHECK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows ``idx`` (R,) of an (n, HEAD_DIM) matrix with row stride ``stride`` as an (R, D_PAD) tile, zeros
    outside. Unchecked rows and an unpadded head dim load without a mask."""
    offs_d = tl.arange(0, pad_head_dim(HEAD_DIM))                                       # (D_PAD,)
    ptrs = ptr + idx.to(tl.int64)[:, None] * stride + offs_d[None, :]
    if CHECK_ROWS:
        x = tl.load(ptrs, mask=(idx[:, None] < n) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    elif HEAD_DIM != pad_head_dim(HEAD_DIM):
        x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _load_pair(A, B, seq, head, start, n, stride_a, stride_b, ROWS: tl.constexpr, CHECK_ROWS: tl.constexpr,
               A_DIM: tl.constexpr, B_DIM: tl.constexpr, TMA: tl.constexpr):
    """Rows ``start .. start + ROWS - 1`` of one head of two operands, A_DIM and B_DIM wide, as (ROWS, A_PAD)
    and (ROWS, B_PAD) tiles, zeros outside.

    With TMA, A and B are descriptors over (B, H, n, A_DIM or B_DIM) read at batch ``seq``, head ``head``
    (int32), whose copy engine zero-fills rows past n and lanes past the head dim; otherwise pointers at row
    0 of the head with row strides ``stride_a``, ``stride_b`` (see ``_load_rows``).
    """
    if TMA:
        a = A.load([seq, head, start, 0]).reshape(ROWS, pad_head_dim(A_DIM))
        b = B.load([seq, head, start, 0]).reshape(ROWS, pad_head_dim(B_DIM))
    else:
        idx = start + tl.arange(0, ROWS)                                                # (ROWS,)
        a = _load_rows(A, idx, n, stride_a, CHECK_ROWS, A_DIM)
        b = _load_rows(B, idx, n, stride_b, CHECK_ROWS, B_DIM)
    return a, b


@triton.jit
def _head_rows(A, B, b, h, start, stride_a, stride_b, TMA: tl.constexpr):
    """Row ``start`` of head ``h`` of batch ``b`` (int64) in two (B, H, N, D) operands with (batch, head,
    row) strides ``stride_a``, ``stride_b``, or with TMA the descriptors themselves (their loads take the
    indices)."""
    if TMA:
        a_rows = A
        b_rows = B
    else:
        a_rows = A + b * stride_a[0] + h * stride_a[1] + start * stride_a[2]
        b_rows = B + b * stride_b[0] + h * stride_b[1] + start * stride_b[2]
    return a_rows, b_rows


@triton.jit
def _dkdv_step(
    dk, dv, k, v, Q, DO, LSE2, DELTA, seq, head, m_start, stride_qn, stride_don, offs_n, rule, qk_scale, softcap,
    MASKED: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, TMA: tl.constexpr,
    PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Adds one Q tile's contribution to dk (BLOCK_N, D_PAD) and dv (BLOCK_N, DV_PAD), float32.

    k: (BLOCK_N, D_PAD) and v: (BLOCK_N, DV_PAD) of keys ``offs_n`` (BLOCK_N,); LSE2, DELTA point at the
    (Nq,) rows of one query head, and so do Q, DO, or with TMA they are descriptors over (B, Hq, Nq,
    HEAD_DIM) and (B, Hq, Nq, VALUE_DIM) read at batch ``seq``, head ``head`` (int32). Scores are kept
    transposed, (BLOCK_N, BLOCK_M), so that both products land in the accumulators' layout.
    """
    offs_m = m_start + tl.arange(0, BLOCK_M)                                            # (BLOCK_M,)
    nq = rule.nq
    q, do = _load_pair(Q, DO, seq, head, m_start, nq, stride_qn, stride_don, ROWS=BLOCK_M, CHECK_ROWS=MASKED,
                       A_DIM=HEAD_DIM, B_DIM=VALUE_DIM, TMA=TMA)              # (BLOCK_M, D_PAD), (BLOCK_M, DV_PAD)
    if MASKED:
        lse2 = tl.load(LSE2 + offs_m, mask=offs_m < nq, other=float("inf"))             # (BLOCK_M,)
        delta = tl.load(DELTA + offs_m, mask=offs_m < nq, other=0.0)                    # (BLOCK_M,)
    else:
        lse2 = tl.load(LSE2 + offs_m)
        delta = tl.load(DELTA + offs_m)
    # both products that need only loaded tiles first, then the softmax work, so that the second product
    # overlaps the exponentials (dQ's step is faster in its own order)
    s_t = softcapped(tl.dot(k, tl.trans(q), input_precision=PRECISION), softcap, SOFTCAP)  # (BLOCK_N, BLOCK_M)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)                            # (BLOCK_N, BLOCK_M)
    p_t = tl.math.exp2(s_t * qk_scale - lse2[None, :])
    if MASKED:
        p_t = tl.where(visible(rule, offs_m[None, :], offs_n[:, None]), p_t, 0.0)
    dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:  # through the soft-cap: s_t holds tanh, whose derivative is 1 - tanh^2
        ds_t = ds_t * (1.0 - s_t * s_t)
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _sum_sink_shares(SHARES, DSINKS, h_first, heads, hq, n_rows, GROUP: tl.constexpr):
    """dsinks[h] for query heads ``h_first .. h_first + heads - 1`` (``heads`` <= GROUP): the sum of their
    columns of SHARES, (n_rows, hq) float32 (``_dq``'s per-tile shares), in a fixed order."""
    GROUP_PAD: tl.constexpr = next_power_of_2(GROUP)
    SHARE_ROWS: tl.constexpr = block_rows(GROUP_PAD)
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
    Q, K, V, DO, LSE2, DELTA, DK, DV, WORK, SHARES, DSINKS, CuQ, CuK, Spans,
    stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv, stride_lse,
    nq, nk, head_splits, n_items, n_shares, left, right, sink_tokens, chunk, scale, qk_scale, softcap, stride_spans,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr, MASK: tl.constexpr, FLAT: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr,
    PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Grid ``(n_items, Hkv * head_splits, B)``: dK, dV of one KV tile of one kv head, summed over
    ``GROUP // head_splits`` query heads and the Q tiles of one work item.

    Q: (B, Hq, Nq, HEAD_DIM), DO: (B, Hq, Nq, VALUE_DIM); K, DK: (B, Hkv, Nk, HEAD_DIM), V, DV: (B, Hkv, Nk,
    VALUE_DIM); ``stride_x``: the (batch, head, row) strides of x, unit last stride. LSE2, DELTA: (B, Hq, Nq)
    float32 with strides (*stride_lse, 1).
    Dense (CuQ, CuK None): the items and their Q tile ranges come from WORK, (n_items, 5) int32 (see
    :func:`split_plan`). Packed (CuQ, CuK: (B + 1,) int32): axis 2 is the sequence,
    found through CuQ, CuK (as in the forward), every KV tile of the longest one is an item, and
    :func:`q_tiles` finds its Q tiles; so with spans (Spans, stride_spans as the forward takes them), whose
    ranges are data. Without SPLIT every KV tile is one item and the
    whole group one split: the result goes to DK, DV in their dtype. With SPLIT (dense only) DK and DV are
    float32 partials ``(B, Hkv, head_splits, n_items, BLOCK_N, D_PAD or DV_PAD)`` contiguous, summed by
    :func:`sum_partials`. TMA (dense only): Q and DO are tensor descriptors moving (1, 1, BLOCK_M, D_PAD) and
    (1, 1, BLOCK_M, DV_PAD) tiles.
    With learned sinks (DSINKS: (Hq,) float32, SHARES: (n_shares, Hq) float32, else both None) the program
    of item 0 and sequence 0 of each (kv head, head split) also sums its query heads' dsinks shares, which
    ``_dq`` (launched before) stored, into DSINKS (one launch fewer). ``scale`` multiplies ``q . k``;
    ``qk_scale``, ``softcap`` and SOFTCAP are the score factors of the forward.
    """
    D_PAD: tl.constexpr = pad_head_dim(HEAD_DIM)
    DV_PAD: tl.constexpr = pad_head_dim(VALUE_DIM)
    HAS_SINKS: tl.constexpr = DSINKS is not None
    VARLEN: tl.constexpr = CuQ is not None
    WALK: tl.constexpr = VARLEN or Spans is not None  # ranges found here, not read from WORK
    item = tl.program_id(0)
    pid_h = tl.program_id(1)
    seq = tl.program_id(2)
    b = seq.to(tl.int64)
    hkv = (pid_h // head_splits).to(tl.int64)
    split = pid_h % head_splits
    heads = GROUP // head_splits
    q_start, nq = sequence_bounds(CuQ, b, nq, VARLEN)
    k_start, nk = sequence_bounds(CuK, b, nk, VARLEN)
    seq_spans = Spans
    if Spans is not None:
        seq_spans = Spans + b * stride_spans + k_start * 2
    seq_rule = rule(nq, nk, left, right, sink_tokens, chunk, seq_spans, MASK)
    h_first = hkv * GROUP + split * heads  # this program's query heads: h_first .. h_first + heads - 1
    hq = (tl.num_programs(1) // head_splits) * GROUP
    if WALK:
        tile = item
        if tile * BLOCK_N >= nk:  # tiles past a shorter packed sequence
            if HAS_SINKS:
                if (item == 0) & (seq == 0):  # a first sequence without keys still owes its dsinks sum
                    _sum_sink_shares(SHARES, DSINKS, h_first, heads, hq, n_shares, GROUP)
            return
        tiles = q_tiles(seq_rule, tile * BLOCK_N, BLOCK_M, BLOCK_N)
    else:  # a dense batch reads its ranges from the host-built table, faster than computing them here
        tile, tiles = _work_item(WORK, item)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)                                     # (BLOCK_N,)
    k_head = K + b * stride_k[0] + hkv * stride_k[1] + k_start * stride_k[2]
    v_head = V + b * stride_v[0] + hkv * stride_v[1] + k_start * stride_v[2]
    k = _load_rows(k_head, offs_n, nk, stride_k[2], True, HEAD_DIM)                     # (BLOCK_N, D_PAD)
    v = _load_rows(v_head, offs_n, nk, stride_v[2], True, VALUE_DIM)                    # (BLOCK_N, DV_PAD)
    dk = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, DV_PAD), dtype=tl.float32)
    if FLAT:  # one pipelined loop over (head, Q tile) pairs, every tile masked
        n_m = tiles.end - tiles.start
        for it in range(0, heads * n_m):
            h = h_first + it // n_m
            m = tiles.start + it % n_m
            q_head, do_head = _head_rows(Q, DO, b, h, q_start, stride_q, stride_do, TMA)
            lse2_head = LSE2 + b * stride_lse[0] + h * stride_lse[1] + q_start
            delta_head = DELTA + b * stride_lse[0] + h * stride_lse[1] + q_start
            dk, dv = _dkdv_step(
                dk, dv, k, v, q_head, do_head, lse2_head, delta_head, seq, h.to(tl.int32), m * BLOCK_M,
                stride_qn=stride_q[2], stride_don=stride_do[2], offs_n=offs_n, rule=seq_rule, qk_scale=qk_scale,
                softcap=softcap, MASKED=True, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, VALUE_DIM=VALUE_DIM, TMA=TMA,
                PRECISION=PRECISION, SOFTCAP=SOFTCAP)
    else:
        for g in range(split * heads, split * heads + heads):
            h = hkv * GROUP + g
            q_head, do_head = _head_rows(Q, DO, b, h, q_start, stride_q, stride_do, TMA)
            lse2_head = LSE2 + b * stride_lse[0] + h * stride_lse[1] + q_start
            delta_head = DELTA + b * stride_lse[0] + h * stride_lse[1] + q_start
            for r in tl.static_range(3):  # masked edge, unmasked interior, masked edge: one loop each
                lo, hi = tile_segment(tiles, r)
                for m in range(lo, hi):
                    dk, dv = _dkdv_step(
                        dk, dv, k, v, q_head, do_head, lse2_head, delta_head, seq, h.to(tl.int32), m * BLOCK_M,
                        stride_qn=stride_q[2], stride_don=stride_do[2], offs_n=offs_n, rule=seq_rule,
                        qk_scale=qk_scale, softcap=softcap, MASKED=r != 1, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM,
                        VALUE_DIM=VALUE_DIM, TMA=TMA, PRECISION=PRECISION, SOFTCAP=SOFTCAP)
    if SPLIT:
        # pid_h = hkv * head_splits + split, so this is partial [b, hkv, split, item]
        slot = (b * tl.num_programs(1) + pid_h) * n_items + item
        _store_partial(DK, slot, dk * scale)
        _store_partial(DV, slot, dv)
    else:
        dk_head = DK + b * stride_dk[0] + hkv * stride_dk[1] + k_start * stride_dk[2]
        dv_head = DV + b * stride_dv[0] + hkv * stride_dv[1] + k_start * stride_dv[2]
        store_rows(dk_head, offs_n, nk, stride_dk[2], dk * scale, HEAD_DIM)
        store_rows(dv_head, offs_n, nk, stride_dv[2], dv, VALUE_DIM)
    if HAS_SINKS:
        # after the tile's own work: before it, this sum changes the code ptxas generates for the loops above
        if (item == 0) & (seq == 0):
            _sum_sink_shares(SHARES, DSINKS, h_first, heads, hq, n_shares, GROUP)


@triton.jit
def _store_partial(P, slot, x):
    """Stores the (BLOCK_N, W) float32 tile ``x`` as partial ``slot`` of P, (n_slots, BLOCK_N, W) contiguous."""
    BLOCK_N: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    offs = tl.arange(0, BLOCK_N)[:, None] * W + tl.arange(0, W)[None, :]               # (BLOCK_N, W)
    tl.store(P + slot * (BLOCK_N * W) + offs, x)


@triton.jit
def _dq_step(
    dq, pdp, q, do, lse2, delta, K, V, seq, kv_head, n_start, stride_kn, stride_vn, offs_m, rule, qk_scale, softcap,
    MASKED: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, TMA: tl.constexpr,
    PRECISION: tl.constexpr, ROW_SUMS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Adds one KV block's contribution to dq (BLOCK_M, D_PAD) float32 and, with ROW_SUMS, to
    pdp (BLOCK_M,) float32, the rows' sums of P * dP.

    q: (BLOCK_M, D_PAD) and do: (BLOCK_M, DV_PAD) of query positions ``offs_m`` (BLOCK_M,); lse2, delta:
    (BLOCK_M,); K, V point at key 0 of the kv head, or with TMA are descriptors over (B, Hkv, Nk, HEAD_DIM)
    and (B, Hkv, Nk, VALUE_DIM) read at batch ``seq``, head ``kv_head`` (int32).
    """
    offs_n = n_start + tl.arange(0, BLOCK_N)                                            # (BLOCK_N,)
    k, v = _load_pair(K, V, seq, kv_head, n_start, rule.nk, stride_kn, stride_vn, ROWS=BLOCK_N, CHECK_ROWS=MASKED,
                      A_DIM=HEAD_DIM, B_DIM=VALUE_DIM, TMA=TMA)               # (BLOCK_N, D_PAD), (BLOCK_N, DV_PAD)
    s = softcapped(tl.dot(q, tl.trans(k), input_precision=PRECISION), softcap, SOFTCAP)  # (BLOCK_M, BLOCK_N)
    p = tl.math.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        p = tl.where(visible(rule, offs_m[:, None], offs_n[None, :]), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                              # (BLOCK_M, BLOCK_N)
    ds = p * (dp - delta[:, None])
    if ROW_SUMS:
        pdp += tl.sum(p * dp, 1)
    if SOFTCAP:  # through the soft-cap (s holds tanh)
        ds = ds * (1.0 - s * s)
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq, pdp


@triton.jit
def _dq(
    Q, K, V, O, DO, DLSE, LSE, Sinks, LSE2, DELTA, DQ, DSINKS, KVTABLE, CuQ, CuK, Spans,
    stride_q, stride_k, stride_v, stride_o, stride_do, stride_dq, stride_dlse, stride_lse,
    nq, nk, left, right, sink_tokens, chunk, scale, qk_scale, softcap, stride_spans,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr, HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr, MASK: tl.constexpr, FLAT: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, STATS_ONLY: tl.constexpr = False,
):
    """Grid ``(n_tiles, Hq // PACK, B)``: dQ of one Q tile of PACK query heads, over the KV blocks that
    :func:`gstar.pattern.kv_block_table` lists in KVTABLE, (n_tiles, 5) int32 (dense: CuQ, CuK None), or
    :func:`kv_blocks` finds (packed: axis 2 is the sequence, as in the forward; or with spans, Spans and
    stride_spans as the forward takes them).
    PACK (a power of two dividing GROUP) stacks query heads of one GQA group in the tile as in the forward:
    BLOCK_M // PACK positions of each, so every K/V block is loaded once for all of them and a narrow
    window's tile spans fewer keys; n_tiles = cdiv(Nq, BLOCK_M // PACK).

    Q, DQ: (B, Hq, Nq, HEAD_DIM); O, DO: (B, Hq, Nq, VALUE_DIM); K: (B, Hkv, Nk, HEAD_DIM); V: (B, Hkv, Nk,
    VALUE_DIM); ``stride_x``: the (batch, head, row) strides of x, unit last stride. LSE, LSE2, DELTA: (B, Hq,
    Nq) float32 with strides (*stride_lse, 1);
    DLSE: None or (B, Hq, Nq) of any float dtype and strides ``stride_dlse``. The program first derives its
    rows' statistics, ``delta = rowsum(dO * O) - dLSE`` and the base-2 LSE, and stores them to DELTA and LSE2
    for ``_dkdv`` (launched after it). With learned sinks (Sinks: (Hq,) float32, else None) it also stores
    this tile's share of dsinks[h] for each of its heads, ``-sum_rows exp(sinks[h] - lse) * delta``, to
    DSINKS: (B, n_tiles, Hq) float32, with delta summed as ``rowsum(P * dP) - dLSE`` over the blocks it
    visits: equal to the above in exact arithmetic, without the rounding of O to the input dtype, which
    a sum over every row of a head would add up.
    TMA (dense only): K and V are tensor descriptors moving (1, 1, BLOCK_N, D_PAD) and (1, 1, BLOCK_N,
    DV_PAD) tiles. STATS_ONLY (no sinks): only delta and LSE2, for a backward that accumulates dQ itself
    (:mod:`gstar.kernels.sm90.backward`).
    """
    D_PAD: tl.constexpr = pad_head_dim(HEAD_DIM)
    DV_PAD: tl.constexpr = pad_head_dim(VALUE_DIM)
    HAS_SINKS: tl.constexpr = Sinks is not None
    VARLEN: tl.constexpr = CuQ is not None
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
    offs_dv = tl.arange(0, DV_PAD)                                                      # (DV_PAD,)
    tile_ok = rows[:, None] & (offs_d[None, :] < HEAD_DIM)                              # (BLOCK_M, D_PAD)
    value_ok = rows[:, None] & (offs_dv[None, :] < VALUE_DIM)                           # (BLOCK_M, DV_PAD)
    q_rows = b * stride_q[0] + heads * stride_q[1] + tokens * stride_q[2]               # (BLOCK_M,)
    do_rows = b * stride_do[0] + heads * stride_do[1] + tokens * stride_do[2]
    o_rows = b * stride_o[0] + heads * stride_o[1] + tokens * stride_o[2]
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=tile_ok, other=0.0)         # (BLOCK_M, D_PAD)
    do = tl.load(DO + do_rows[:, None] + offs_dv[None, :], mask=value_ok, other=0.0)    # (BLOCK_M, DV_PAD)
    o = tl.load(O + o_rows[:, None] + offs_dv[None, :], mask=value_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)                        # (BLOCK_M,)
    dlse = tl.zeros([BLOCK_M], dtype=tl.float32)
    if DLSE is not None:
        dlse_rows = b * stride_dlse[0] + heads * stride_dlse[1] + tokens * stride_dlse[2]
        dlse = tl.load(DLSE + dlse_rows, mask=rows, other=0.0).to(tl.float32)
        delta -= dlse
    row_ptr = b * stride_lse[0] + heads * stride_lse[1] + tokens                        # (BLOCK_M,)
    # an empty row (lse = -inf, no sinks) sees no key, so it only meets masked tiles: there exp2(s - lse2)
    # is +inf (never NaN, s is finite) and the mask replaces it by 0; rows past the end get +inf, so 0
    lse2 = tl.load(LSE + row_ptr, mask=rows, other=float("inf")) * LOG2E               # (BLOCK_M,)
    tl.store(DELTA + row_ptr, delta, mask=rows)
    tl.store(LSE2 + row_ptr, lse2, mask=rows)
    if STATS_ONLY:
        return
    k_head, v_head = _head_rows(K, V, b, hkv, k_start, stride_k, stride_v, TMA)
    kv_head = hkv.to(tl.int32)
    seq_spans = Spans
    if Spans is not None:
        seq_spans = Spans + b * stride_spans + k_start * 2
    seq_rule = rule(nq, nk, left, right, sink_tokens, chunk, seq_spans, MASK)
    if VARLEN or Spans is not None:  # ranges that are data: found here
        blocks = kv_blocks(seq_rule, pid_m * ROWS, ROWS, BLOCK_N)
    else:  # the host table, as in _dkdv
        blocks = table_blocks(KVTABLE, pid_m)
    dq = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
    pdp = tl.zeros([BLOCK_M], dtype=tl.float32)  # rowsum(P * dP), summed for dsinks only
    if FLAT:  # one pipelined loop over the sink blocks then the band, every block masked
        for i in range(0, steps(blocks)[2]):
            n = block_at(blocks, i)
            dq, pdp = _dq_step(
                dq, pdp, q, do, lse2, delta, k_head, v_head, seq, kv_head, n * BLOCK_N, stride_kn=stride_k[2],
                stride_vn=stride_v[2], offs_m=pos, rule=seq_rule, qk_scale=qk_scale, softcap=softcap, MASKED=True,
                BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, VALUE_DIM=VALUE_DIM, TMA=TMA, PRECISION=PRECISION,
                ROW_SUMS=HAS_SINKS, SOFTCAP=SOFTCAP)
    else:
        # sink blocks, then the band's masked edge, unmasked interior and masked edge: one loop each
        for r in tl.static_range(4):
            lo, hi = segment(blocks, r)
            for n in range(lo, hi):
                dq, pdp = _dq_step(
                    dq, pdp, q, do, lse2, delta, k_head, v_head, seq, kv_head, n * BLOCK_N, stride_kn=stride_k[2],
                    stride_vn=stride_v[2], offs_m=pos, rule=seq_rule, qk_scale=qk_scale, softcap=softcap,
                    MASKED=r != 2, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, VALUE_DIM=VALUE_DIM, TMA=TMA,
                    PRECISION=PRECISION, ROW_SUMS=HAS_SINKS, SOFTCAP=SOFTCAP)
    dq_rows = b * stride_dq[0] + heads * stride_dq[1] + tokens * stride_dq[2]           # (BLOCK_M,)
    tl.store(DQ + dq_rows[:, None] + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=tile_ok)
    if HAS_SINKS:
        # with sinks every lse is finite (>= sinks[h]); rows past the end have pdp = dlse = 0 and lse2 = inf
        p_sink = tl.math.exp2(sink_max(Sinks, heads) - lse2)                   # (BLOCK_M,)
        tl.store(dsink_slots, -tl.sum(tl.reshape(p_sink * (pdp - dlse), (PACK, ROWS)), axis=1))


class _Launch(NamedTuple):
    """One kernel's launch: its grid, the runtime arguments fixed by the layout (by name), its constexprs (for
    the dQ and dK/dV kernels a pair: pointer loads, descriptor loads)."""

    grid: tuple
    args: dict
    options: tuple


class _Plan(NamedTuple):
    """What the backward's launches need besides the data, derived once per layout by :func:`_plan`."""

    stats_shape: tuple             # delta and lse2: (2, B, Hq, Nq) float32
    shares_shape: tuple | None     # dsinks shares: (seqs, n_q_tiles, Hq) float32, None without sinks
    partials_shapes: tuple | None  # dK, dV partials: (B, Hkv, head_splits, n_items, dkdv_n, D_PAD or DV_PAD)
    dq: _Launch
    stats: _Launch                 # the dQ kernel's row statistics alone (for the sm90 backward)
    dkdv: _Launch
    sum: _Launch | None            # sum_partials, when the dK/dV work is split
    dq_tma: bool
    dkdv_tma: bool
    dq_tiles: tuple                # descriptor blocks of K and V: (1, 1, dq_n, D_PAD or DV_PAD)
    dkdv_tiles: tuple              # of Q and dO: (1, 1, dkdv_m, D_PAD or DV_PAD)


@functools.lru_cache(maxsize=256)
def _plan(q_shape: tuple, q_stride: tuple, k_shape: tuple, k_stride: tuple, v_shape: tuple, v_stride: tuple,
          o_stride: tuple, do_stride: tuple, dlse_stride: tuple | None, dtype: torch.dtype, device: torch.device,
          has_sinks: bool, pattern: Pattern, scale: float, softcap: float, seqs: int | None,
          config: BackwardConfig | None, precision: str, spans: bool = False) -> _Plan:
    """The launches of one layout (as the forward's plan; ``dlse_stride`` None without an LSE gradient; with
    ``spans`` the kernels find their ranges themselves, as for packed sequences)."""
    B, Hq, Nq, D = q_shape
    Hkv, Nk, Dv = k_shape[1], k_shape[2], v_shape[3]
    group = Hq // Hkv
    varlen = seqs is not None
    cfg = config or backward_config(D, dtype, pattern, device, batch_heads=B * Hq, group=group, value_dim=Dv)
    d_pad, dv_pad = pad_head_dim(D), pad_head_dim(Dv)
    walk = varlen or spans  # ranges found in the kernels, not in host tables
    shared = dict(MASK=mask(pattern, spans), PRECISION=precision, GROUP=group, HEAD_DIM=D, VALUE_DIM=Dv, FLAT=cfg.flat,
                  SOFTCAP=softcap > 0)
    runtime = dict(nq=Nq, nk=Nk, **bounds(pattern), scale=float(scale), **softcap_args(scale, softcap))
    lse_strides = batch_strides((Hq * Nq, Nq, 1), varlen)[:2]  # delta, lse2 and LSE: (B, Hq, Nq) contiguous
    q_s, k_s, v_s, o_s, do_s = (batch_strides(s, varlen) for s in (q_stride, k_stride, v_stride, o_stride, do_stride))
    dl_s = batch_strides(dlse_stride or (0, 0, 0), varlen)  # dLSE's (unused without one)

    pack = math.gcd(cfg.dq_pack, group, cfg.dq_m)
    rows = cfg.dq_m // pack  # positions per dQ tile and head
    n_q_tiles = cdiv(pattern.nq, rows)
    programs = seqs if varlen else B
    registers = dict(maxnreg=cfg.dq_registers) if cfg.dq_registers else {}
    dq_options = [constexprs(BLOCK_M=cfg.dq_m, BLOCK_N=cfg.dq_n, PACK=pack, num_warps=cfg.dq_warps,
                             num_stages=cfg.dq_stages, TMA=tma, **registers, **shared) for tma in (False, True)]
    dq_args = dict(stride_q=q_s, stride_k=k_s, stride_v=v_s, stride_o=o_s, stride_do=do_s, stride_dlse=dl_s,
                   stride_lse=lse_strides, **runtime,
                   KVTABLE=None if walk else kv_block_table(pattern, rows, cfg.dq_n, device))  # (n_q_tiles, 5)

    if walk:
        head_splits, work, first = 1, None, None
        n_items = n_tiles = cdiv(pattern.nk, cfg.dkdv_n)
    else:
        head_splits, work, first = split_plan(pattern, cfg.dkdv_m, cfg.dkdv_n, group, Hkv * B, device,
                                              head_splits=cfg.head_splits, q_chunk=cfg.q_chunk)
        n_tiles, n_items = first.shape[0] - 1, work.shape[0]
    split = head_splits > 1 or n_items > n_tiles
    dkdv_options = [constexprs(SPLIT=split, BLOCK_M=cfg.dkdv_m, BLOCK_N=cfg.dkdv_n, num_warps=cfg.dkdv_warps,
                               num_stages=cfg.dkdv_stages, TMA=tma, **shared) for tma in (False, True)]
    dkdv_args = dict(stride_q=q_s, stride_k=k_s, stride_v=v_s, stride_do=do_s, stride_lse=lse_strides,
                     head_splits=head_splits, n_items=n_items, n_shares=programs * n_q_tiles, **runtime, WORK=work)
    total = None
    if split:
        total = _Launch((n_tiles, Hkv, B), dict(FIRST=first, Hkv=Hkv, nk=Nk, head_splits=head_splits,
                                                n_items=n_items),
                        constexprs(BLOCK_N=cfg.dkdv_n, HEAD_DIM=D, VALUE_DIM=Dv, num_warps=4))
    return _Plan(
        stats_shape=(2, B, Hq, Nq),
        shares_shape=(programs, n_q_tiles, Hq) if has_sinks else None,
        partials_shapes=tuple((B, Hkv, head_splits, n_items, cfg.dkdv_n, pad) for pad in (d_pad, dv_pad))
        if split else None,
        dq=_Launch((n_q_tiles, Hq // pack, programs), dq_args, tuple(dq_options)),
        stats=_Launch((n_q_tiles, Hq // pack, programs), dq_args, dq_options[0] + (("STATS_ONLY", True),)),
        dkdv=_Launch((n_items, Hkv * head_splits, programs), dkdv_args, tuple(dkdv_options)),
        sum=total, dq_tma=cfg.dq_tma and not varlen, dkdv_tma=cfg.dkdv_tma and not varlen,
        dq_tiles=tuple((1, 1, cfg.dq_n, pad) for pad in (d_pad, dv_pad)),
        dkdv_tiles=tuple((1, 1, cfg.dkdv_m, pad) for pad in (d_pad, dv_pad)),
    )


def _layout_plan(dout, q, k, v, out, dlse, sinks, pattern: Pattern, scale: float, config, cu_seqlens,
                 softcap: float = 0.0, spans: bool = False) -> _Plan:
    return _plan(q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.stride(), dout.stride(),
                 None if dlse is None else dlse.stride(), q.dtype, q.device, sinks is not None, pattern, scale,
                 softcap, None if cu_seqlens is None else cu_seqlens[0].shape[0] - 1, config, dot_precision(q.dtype),
                 spans)


def statistics(dout, q, k, v, out, lse, dlse, pattern: Pattern, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse2, delta)`` of a dense call, both (B, Hq, Nq) float32 contiguous: the base-2 LSE and
    ``rowsum(dO * O) - dLSE``, from the dQ kernel's first phase alone (a backward that accumulates dQ itself
    reads them; shapes as :func:`backward` takes them)."""
    plan = _layout_plan(dout, q, k, v, out, dlse, None, pattern, scale, None, None)
    stats = buffers.empty(plan.stats_shape, dtype=torch.float32, device=q.device)
    delta, lse2 = stats[0], stats[1]                                                # (B, Hq, Nq) each
    launch(_dq, plan.stats.grid, {**plan.stats.args, "Q": q, "K": k, "V": v, "O": out, "DO": dout, "DLSE": dlse,
                                  "LSE": lse, "Sinks": None, "LSE2": lse2, "DELTA": delta, "DQ": q, "DSINKS": None,
                                  "CuQ": None, "CuK": None, "stride_dq": batch_strides(q.stride(), False),
                                  "Spans": None, "stride_spans": 0}, plan.stats.options)  # (DQ: unused)
    return lse2, delta


def backward(dout, q, k, v, out, lse, dlse, sinks, pattern: Pattern, scale: float, *,
             config: BackwardConfig | None = None, softcap: float = 0.0, cu_seqlens=None, spans=None):
    """``(dq, dk, dv, dsinks)`` with the portable kernels, for the calls of
    :func:`gstar.kernels.dispatch.attention_backward` (shapes as it takes them, at least one row and one key).
    ``config`` overrides :func:`backward_config` (tests use other tiles, splits and loop forms;
    scripts/tune-backward sweeps them)."""
    Hq = q.shape[1]
    varlen = cu_seqlens is not None
    like = buffers.empty_packed_like if varlen else buffers.empty_like
    plan = _layout_plan(dout, q, k, v, out, dlse, sinks, pattern, scale, config, cu_seqlens, softcap,
                        spans is not None)
    span_args = {"Spans": spans, "stride_spans": 0 if spans is None or varlen else spans.stride(0)}
    stats = buffers.empty(plan.stats_shape, dtype=torch.float32, device=q.device)
    delta, lse2 = stats[0], stats[1]                                                # (B, Hq, Nq) each
    cu_q, cu_k = cu_seqlens if varlen else (None, None)
    dq_tma = plan.dq_tma and descriptors.supported(k, v)
    dkdv_tma = plan.dkdv_tma and descriptors.supported(q, dout)
    k_in, v_in, q_in, do_in = k, v, q, dout
    if dq_tma:  # dQ reads its K, V tiles through descriptors
        k_in, v_in = (descriptors.tiles(t, tile) for t, tile in zip((k, v), plan.dq_tiles))
    if dkdv_tma:  # dK/dV its Q, dO tiles
        q_in, do_in = (descriptors.tiles(t, tile) for t, tile in zip((q, dout), plan.dkdv_tiles))

    # dQ first: its programs also store delta and lse2, which every dK/dV program reads
    dq = like(q)
    shares = dsinks = None
    if sinks is not None:
        shares = buffers.empty(plan.shares_shape, dtype=torch.float32, device=q.device)  # (seqs, n_q_tiles, Hq)
        dsinks = buffers.empty((Hq,), dtype=torch.float32, device=q.device)             # summed by _dkdv
    launch(_dq, plan.dq.grid, {**plan.dq.args, "Q": q, "K": k_in, "V": v_in, "O": out, "DO": dout, "DLSE": dlse,
                               "LSE": lse, "Sinks": sinks, "LSE2": lse2, "DELTA": delta, "DQ": dq, "DSINKS": shares,
                               "CuQ": cu_q, "CuK": cu_k, "stride_dq": batch_strides(dq.stride(), varlen),
                               **span_args}, plan.dq.options[dq_tma])

    dk, dv = like(k), like(v)
    pk, pv = dk, dv
    if plan.partials_shapes is not None:
        pk, pv = (buffers.empty(shape, dtype=torch.float32, device=q.device) for shape in plan.partials_shapes)
    launch(_dkdv, plan.dkdv.grid, {**plan.dkdv.args, "Q": q_in, "K": k, "V": v, "DO": do_in, "LSE2": lse2,
                                   "DELTA": delta, "DK": pk, "DV": pv, "SHARES": shares, "DSINKS": dsinks,
                                   "CuQ": cu_q, "CuK": cu_k, "stride_dk": batch_strides(dk.stride(), varlen),
                                   "stride_dv": batch_strides(dv.stride(), varlen), **span_args},
           plan.dkdv.options[dkdv_tma])
    if plan.sum is not None:
        launch(sum_partials, plan.sum.grid, {**plan.sum.args, "PK": pk, "PV": pv, "DK": dk, "DV": dv,
                                             "stride_dk": batch_strides(dk.stride(), False),
                                             "stride_dv": batch_strides(dv.stride(), False)}, plan.sum.options)
    return dq, dk, dv, dsinks
