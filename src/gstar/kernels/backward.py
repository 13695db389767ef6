"""The Triton backward kernels: dQ, dK, dV and dsinks, recomputing probabilities from the forward's LSE.

Kernels, each one family specialised by ``tl.constexpr`` flags, in launch order:

* ``_dq``: one program per (Q tile, query head). It first derives its rows'
  ``delta_i = rowsum(dO_i * O_i) - dLSE_i`` and base-2 LSE (stored for ``_dkdv``, so that both compute
  ``P = exp2(s * scale * log2(e) - lse2)`` with one multiply folded into the scores) and its share of
  dsinks, then visits the KV blocks of :func:`gstar.pattern.kv_block_table` (packed sequences:
  :func:`gstar.kernels.ranges.kv_range`, its in-kernel twin).
* ``_dkdv``: one program per (work item, kv head, head split). A work item is a KV tile, or a chunk of the
  Q tiles that see it (:func:`gstar.pattern.q_block_table`), and a head split a slice of the kv head's
  GQA group; the program keeps K, V and the dK, dV accumulators on chip while it walks those (head,
  Q tile) pairs. K/V are never expanded. :func:`gstar.kernels.schedule.split_plan` picks the split from
  the SM count: with few kv heads (MQA: 64 KV tiles on 132 SMs) or one KV tile seen by every Q tile (sink
  tokens, causal starts) a single program per tile would leave SMs idle behind one long program. With
  learned sinks the program of the first item (of the first sequence) of each (kv head, head split) also
  adds up its query heads' dsinks shares, after its own tile.
* ``_sum_partials``: when work is split, each program writes float32 partials and this kernel adds them,
  per KV tile, in a fixed order. Without a split ``_dkdv`` writes dK, dV directly.

On Hopper, large dense problems read the tiles each step loads (dQ: K, V; dK/dV: Q, dO) through tensor
descriptors (``TMA``, :mod:`gstar.kernels.descriptors`; chosen by ``configs.backward_config``): the copy
engine zero-fills rows past the sequence and lanes past the head dim, so those loads need no masks.

Packed sequences (``CuQ``, ``CuK`` given) run the same kernels with the sequence on grid axis 2: each program
reads its sequence's bounds from ``cu_seqlens`` on the device, so one launch per kernel covers every
sequence. Learned sinks, an LSE gradient and the padded head dim likewise follow from the arguments.

Each tile step is one ``@triton.jit`` helper with a ``MASKED`` flag. By default a program walks masked
boundary ranges and an unmasked interior as separate loops (interior tiles skip the visibility rule,
:func:`gstar.kernels.ranges.visible`); with ``FLAT`` it walks all its tiles as one masked loop, which
narrow windows prefer (their ranges are one or two tiles long, too short to pipeline). No atomics and a
fixed loop and summation order: the gradients are bitwise reproducible. Memory is linear in N: besides the
gradients, ``delta`` and the base-2 LSE, both ``(B, Hq, Nq)`` float32, and the partials, at most
``schedule._MAX_PARTIAL_RATIO`` times dK + dV's size in float32 (and only when the grid is small).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ..pattern import KV_BAND_END, KV_BAND_START, KV_FULL_END, KV_FULL_START, KV_SINK_END
from .configs import next_power_of_2, pad_head_dim
from .ranges import kv_range, q_range, sequence_bounds, tile_rows, visible

_LOG2E = tl.constexpr(math.log2(math.e))
# the kernels read table rows in column order (_table_row)
assert (KV_SINK_END, KV_BAND_START, KV_FULL_START, KV_FULL_END, KV_BAND_END) == tuple(range(5))


@triton.constexpr_function
def _block_rows(width: int, limit: int = 1 << 30) -> int:
    """Rows per step of a float32 block ``width`` columns wide that a reduction adds up: about 2048
    elements, at least 16 rows (and at most ``limit``)."""
    return min(limit, max(16, 2048 // width))


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
def _store_rows(ptr, idx, n, stride, x, HEAD_DIM: tl.constexpr):
    """Stores the (R, D_PAD) tile ``x`` into rows ``idx`` (R,) of an (n, HEAD_DIM) matrix, cast to its dtype."""
    offs_d = tl.arange(0, pad_head_dim(HEAD_DIM))                                       # (D_PAD,)
    ptrs = ptr + idx.to(tl.int64)[:, None] * stride + offs_d[None, :]
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=(idx[:, None] < n) & (offs_d[None, :] < HEAD_DIM))


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
def _table_row(Table, index):
    """The five int32 columns of row ``index`` of an ``(n, 5)`` contiguous table, in column order."""
    row = Table + index * 5
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)


@triton.jit
def _dkdv_step(
    dk, dv, k, v, Q, DO, LSE2, DELTA, seq, head, m_start, stride_qn, stride_don, offs_n,
    nq, nk, left, right, sink_tokens, qk_scale,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, TMA: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Adds one Q tile's contribution to dk (BLOCK_N, D_PAD) and dv (BLOCK_N, DV_PAD), float32.

    k: (BLOCK_N, D_PAD) and v: (BLOCK_N, DV_PAD) of keys ``offs_n`` (BLOCK_N,); LSE2, DELTA point at the
    (Nq,) rows of one query head, and so do Q, DO, or with TMA they are descriptors over (B, Hq, Nq,
    HEAD_DIM) and (B, Hq, Nq, VALUE_DIM) read at batch ``seq``, head ``head`` (int32). Scores are kept transposed, (BLOCK_N, BLOCK_M), so that both products
    land in the accumulators' layout.
    """
    offs_m = m_start + tl.arange(0, BLOCK_M)                                            # (BLOCK_M,)
    q, do = _load_pair(Q, DO, seq, head, m_start, nq, stride_qn, stride_don, ROWS=BLOCK_M, CHECK_ROWS=MASKED,
                       A_DIM=HEAD_DIM, B_DIM=VALUE_DIM, TMA=TMA)              # (BLOCK_M, D_PAD), (BLOCK_M, DV_PAD)
    if MASKED:
        lse2 = tl.load(LSE2 + offs_m, mask=offs_m < nq, other=float("inf"))             # (BLOCK_M,)
        delta = tl.load(DELTA + offs_m, mask=offs_m < nq, other=0.0)                    # (BLOCK_M,)
    else:
        lse2 = tl.load(LSE2 + offs_m)
        delta = tl.load(DELTA + offs_m)
    # both products that need only loaded tiles first, then the softmax work, so that the second product
    # overlaps the exponentials (dQ's step is faster in its own order): benchmarks/NOTES.md, 'dK/dV product order'
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
def _sum_sink_shares(SHARES, DSINKS, h_first, heads, hq, n_rows, GROUP: tl.constexpr):
    """dsinks[h] for query heads ``h_first .. h_first + heads - 1`` (``heads`` <= GROUP): the sum of their
    columns of SHARES, (n_rows, hq) float32 (``_dq``'s per-tile shares), in a fixed order."""
    GROUP_PAD: tl.constexpr = next_power_of_2(GROUP)
    SHARE_ROWS: tl.constexpr = _block_rows(GROUP_PAD)
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
    stride_q, stride_k, stride_v, stride_do, stride_dk, stride_dv, stride_lse,
    nq, nk, head_splits, n_items, n_shares, left, right, sink_tokens, scale, qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    FLAT: tl.constexpr, SPLIT: tl.constexpr, TMA: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(n_items, Hkv * head_splits, B)``: dK, dV of one KV tile of one kv head, summed over
    ``GROUP // head_splits`` query heads and the Q tiles of one work item.

    Q: (B, Hq, Nq, HEAD_DIM), DO: (B, Hq, Nq, VALUE_DIM); K, DK: (B, Hkv, Nk, HEAD_DIM), V, DV: (B, Hkv, Nk,
    VALUE_DIM); ``stride_x``: the (batch, head, row) strides of x, unit last stride. LSE2, DELTA: (B, Hq, Nq) float32 with strides (*stride_lse, 1).
    Dense (CuQ, CuK None): the items and their Q tile ranges come from WORK, (n_items, 5) int32 (see
    :func:`gstar.kernels.schedule.split_plan`). Packed (CuQ, CuK: (B + 1,) int32): axis 2 is the sequence,
    found through CuQ, CuK (see ``_forward_kernel``), every KV tile of the longest one is an item, and
    :func:`gstar.kernels.ranges.q_range` finds its Q tiles. Without SPLIT every KV tile is one item and the
    whole group one split: the result goes to DK, DV in their dtype. With SPLIT (dense only) DK and DV are
    float32 partials ``(B, Hkv, head_splits, n_items, BLOCK_N, D_PAD or DV_PAD)`` contiguous, summed by
    ``_sum_partials``. TMA (dense only): Q and DO are tensor descriptors moving (1, 1, BLOCK_M, D_PAD) and
    (1, 1, BLOCK_M, DV_PAD) tiles.
    With learned sinks (DSINKS: (Hq,) float32, SHARES: (n_shares, Hq) float32, else both None) the program
    of item 0 and sequence 0 of each (kv head, head split) also sums its query heads' dsinks shares, which
    ``_dq`` (launched before) stored, into DSINKS (one launch fewer).
    """
    D_PAD: tl.constexpr = pad_head_dim(HEAD_DIM)
    DV_PAD: tl.constexpr = pad_head_dim(VALUE_DIM)
    HAS_SINKS: tl.constexpr = DSINKS is not None
    VARLEN: tl.constexpr = CuQ is not None
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
                    _sum_sink_shares(SHARES, DSINKS, h_first, heads, hq, n_shares, GROUP)
            return
        m_start, m_full_start, m_full_end, m_end = q_range(tile * BLOCK_N, nq, nk, left, right, sink_tokens,
                                                           BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    else:
        # a dense batch reads its ranges from the host-built table, which is faster than computing them here
        # as packed sequences must: benchmarks/NOTES.md, 'Backward tile ranges: host tables for dense batches'
        tile, m_start, m_full_start, m_full_end, m_end = _table_row(WORK, item)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)                                     # (BLOCK_N,)
    k_head = K + b * stride_k[0] + hkv * stride_k[1] + k_start * stride_k[2]
    v_head = V + b * stride_v[0] + hkv * stride_v[1] + k_start * stride_v[2]
    k = _load_rows(k_head, offs_n, nk, stride_k[2], True, HEAD_DIM)                     # (BLOCK_N, D_PAD)
    v = _load_rows(v_head, offs_n, nk, stride_v[2], True, VALUE_DIM)                    # (BLOCK_N, DV_PAD)
    dk = tl.zeros((BLOCK_N, D_PAD), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, DV_PAD), dtype=tl.float32)
    if FLAT:  # one pipelined loop over (head, Q tile) pairs, every tile masked
        n_m = m_end - m_start
        for it in range(0, heads * n_m):
            h = h_first + it // n_m
            m = m_start + it % n_m
            q_head, do_head = _head_rows(Q, DO, b, h, q_start, stride_q, stride_do, TMA)
            lse2_head = LSE2 + b * stride_lse[0] + h * stride_lse[1] + q_start
            delta_head = DELTA + b * stride_lse[0] + h * stride_lse[1] + q_start
            dk, dv = _dkdv_step(
                dk, dv, k, v, q_head, do_head, lse2_head, delta_head, seq, h.to(tl.int32), m * BLOCK_M,
                stride_qn=stride_q[2], stride_don=stride_do[2], offs_n=offs_n, nq=nq, nk=nk, left=left, right=right,
                sink_tokens=sink_tokens, qk_scale=qk_scale, MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
                HAS_SINK_TOKENS=HAS_SINK_TOKENS, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM, VALUE_DIM=VALUE_DIM, TMA=TMA,
                PRECISION=PRECISION)
    else:
        for g in range(split * heads, split * heads + heads):
            h = hkv * GROUP + g
            q_head, do_head = _head_rows(Q, DO, b, h, q_start, stride_q, stride_do, TMA)
            lse2_head = LSE2 + b * stride_lse[0] + h * stride_lse[1] + q_start
            delta_head = DELTA + b * stride_lse[0] + h * stride_lse[1] + q_start
            bounds = (m_start, m_full_start, m_full_end, m_end)
            for r in tl.static_range(3):  # masked edge, unmasked interior, masked edge: one loop each
                for m in range(bounds[r], bounds[r + 1]):
                    dk, dv = _dkdv_step(
                        dk, dv, k, v, q_head, do_head, lse2_head, delta_head, seq, h.to(tl.int32), m * BLOCK_M,
                        stride_qn=stride_q[2], stride_don=stride_do[2], offs_n=offs_n, nq=nq, nk=nk, left=left,
                        right=right, sink_tokens=sink_tokens, qk_scale=qk_scale, MASKED=r != 1, HAS_LEFT=HAS_LEFT,
                        HAS_RIGHT=HAS_RIGHT, HAS_SINK_TOKENS=HAS_SINK_TOKENS, BLOCK_M=BLOCK_M, HEAD_DIM=HEAD_DIM,
                        VALUE_DIM=VALUE_DIM, TMA=TMA, PRECISION=PRECISION)
    if SPLIT:
        # pid_h = hkv * head_splits + split, so this is partial [b, hkv, split, item]
        slot = (b * tl.num_programs(1) + pid_h) * n_items + item
        _store_partial(DK, slot, dk * scale)
        _store_partial(DV, slot, dv)
    else:
        dk_head = DK + b * stride_dk[0] + hkv * stride_dk[1] + k_start * stride_dk[2]
        dv_head = DV + b * stride_dv[0] + hkv * stride_dv[1] + k_start * stride_dv[2]
        _store_rows(dk_head, offs_n, nk, stride_dk[2], dk * scale, HEAD_DIM)
        _store_rows(dv_head, offs_n, nk, stride_dv[2], dv, VALUE_DIM)
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
def _sum_tile(P, D, first, last, head_base, n_items, tile, nk, stride_d, BLOCK_N: tl.constexpr,
              WIDTH: tl.constexpr, head_splits):
    """Rows ``tile * BLOCK_N ..`` of D (Nk, WIDTH) of one kv head = the sum of the partials ``(head_base + s,
    i)`` of P, (.., n_items, BLOCK_N, W_PAD) float32, for each head split s and item ``first <= i < last``,
    in that order."""
    W_PAD: tl.constexpr = pad_head_dim(WIDTH)
    ROWS: tl.constexpr = _block_rows(W_PAD, BLOCK_N)
    for r in range(0, BLOCK_N, ROWS):
        offs_r = r + tl.arange(0, ROWS)                                                 # (ROWS,)
        tile_offs = offs_r[:, None] * W_PAD + tl.arange(0, W_PAD)[None, :]              # (ROWS, W_PAD)
        acc = tl.zeros((ROWS, W_PAD), dtype=tl.float32)
        for s in range(0, head_splits):
            for i in range(first, last):
                acc += tl.load(P + ((head_base + s) * n_items + i) * (BLOCK_N * W_PAD) + tile_offs)
        _store_rows(D, tile * BLOCK_N + offs_r, nk, stride_d, acc, WIDTH)


@triton.jit
def _sum_partials(PK, PV, DK, DV, FIRST, stride_dk, stride_dv, Hkv, nk, head_splits, n_items,
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


@triton.jit
def _dq_step(
    dq, pdp, q, do, lse2, delta, K, V, seq, kv_head, n_start, stride_kn, stride_vn, offs_m,
    nq, nk, left, right, sink_tokens, qk_scale,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, TMA: tl.constexpr,
    PRECISION: tl.constexpr, ROW_SUMS: tl.constexpr,
):
    """Adds one KV block's contribution to dq (BLOCK_M, D_PAD) float32 and, with ROW_SUMS, to
    pdp (BLOCK_M,) float32, the rows' sums of P * dP.

    q: (BLOCK_M, D_PAD) and do: (BLOCK_M, DV_PAD) of query positions ``offs_m`` (BLOCK_M,); lse2, delta:
    (BLOCK_M,); K, V point at key 0 of the kv head, or with TMA are descriptors over (B, Hkv, Nk, HEAD_DIM)
    and (B, Hkv, Nk, VALUE_DIM) read at batch ``seq``, head ``kv_head`` (int32).
    """
    offs_n = n_start + tl.arange(0, BLOCK_N)                                            # (BLOCK_N,)
    k, v = _load_pair(K, V, seq, kv_head, n_start, nk, stride_kn, stride_vn, ROWS=BLOCK_N, CHECK_ROWS=MASKED,
                      A_DIM=HEAD_DIM, B_DIM=VALUE_DIM, TMA=TMA)               # (BLOCK_N, D_PAD), (BLOCK_N, DV_PAD)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)                                # (BLOCK_M, BLOCK_N)
    p = tl.math.exp2(s * qk_scale - lse2[:, None])
    if MASKED:
        ok = visible(offs_m[:, None], offs_n[None, :], nq, nk, left, right, sink_tokens,
                     HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS)
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)                              # (BLOCK_M, BLOCK_N)
    ds = p * (dp - delta[:, None])
    if ROW_SUMS:
        pdp += tl.sum(p * dp, 1)
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq, pdp


@triton.jit
def _dq(
    Q, K, V, O, DO, DLSE, LSE, Sinks, LSE2, DELTA, DQ, DSINKS, KVTABLE, CuQ, CuK,
    stride_q, stride_k, stride_v, stride_o, stride_do, stride_dq, stride_dlse, stride_lse,
    nq, nk, left, right, sink_tokens, scale, qk_scale,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr, HEAD_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr, FLAT: tl.constexpr,
    TMA: tl.constexpr, PRECISION: tl.constexpr, STATS_ONLY: tl.constexpr = False,
):
    """Grid ``(n_tiles, Hq // PACK, B)``: dQ of one Q tile of PACK query heads, over the KV blocks that
    :func:`gstar.pattern.kv_block_table` lists in KVTABLE, (n_tiles, 5) int32 (dense: CuQ, CuK None), or
    :func:`gstar.kernels.ranges.kv_range` finds (packed: axis 2 is the sequence, see ``_forward_kernel``).
    PACK (a power of two dividing GROUP) stacks query heads of one GQA group in the tile as in the forward:
    BLOCK_M // PACK positions of each, so every K/V block is loaded once for all of them and a narrow
    window's tile spans fewer keys; n_tiles = cdiv(Nq, BLOCK_M // PACK).

    Q, DQ: (B, Hq, Nq, HEAD_DIM); O, DO: (B, Hq, Nq, VALUE_DIM); K: (B, Hkv, Nk, HEAD_DIM); V: (B, Hkv, Nk,
    VALUE_DIM); ``stride_x``: the (batch, head, row) strides of x, unit last stride. LSE, LSE2, DELTA: (B, Hq, Nq) float32 with strides (*stride_lse, 1);
    DLSE: None or (B, Hq, Nq) of any float dtype and strides ``stride_dlse``. The program first derives its
    rows' statistics, ``delta = rowsum(dO * O) - dLSE`` and the base-2 LSE, and stores them to DELTA and LSE2
    for ``_dkdv`` (launched after it). With learned sinks (Sinks: (Hq,) float32, else None) it also stores
    this tile's share of dsinks[h] for each of its heads, ``-sum_rows exp(sinks[h] - lse) * delta``, to
    DSINKS: (B, n_tiles, Hq) float32, with delta summed as ``rowsum(P * dP) - dLSE`` over the blocks it
    visits: equal to the above in exact arithmetic, without the rounding of O to the input dtype, which
    a sum over every row of a head would add up (benchmarks/NOTES.md, 'dsinks from P * dP').
    TMA (dense only): K and V are tensor descriptors moving (1, 1, BLOCK_N, D_PAD) and (1, 1, BLOCK_N,
    DV_PAD) tiles. STATS_ONLY (no sinks): only delta and LSE2, for a backward that accumulates dQ itself
    (:mod:`gstar.kernels.hopper_backward`).
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
    lse2 = tl.load(LSE + row_ptr, mask=rows, other=float("inf")) * _LOG2E               # (BLOCK_M,)
    tl.store(DELTA + row_ptr, delta, mask=rows)
    tl.store(LSE2 + row_ptr, lse2, mask=rows)
    if STATS_ONLY:
        return
    k_head, v_head = _head_rows(K, V, b, hkv, k_start, stride_k, stride_v, TMA)
    kv_head = hkv.to(tl.int32)
    if VARLEN:
        sink_end, band_start, full_start, full_end, band_end = kv_range(
            pid_m * ROWS, nq, nk, left, right, sink_tokens, ROWS, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    else:  # the host table, as in _dkdv
        sink_end, band_start, full_start, full_end, band_end = _table_row(KVTABLE, pid_m)
    dq = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
    pdp = tl.zeros([BLOCK_M], dtype=tl.float32)  # rowsum(P * dP), summed for dsinks only
    if FLAT:  # one pipelined loop over the sink blocks then the band, every block masked
        for i in range(0, sink_end + band_end - band_start):
            n = tl.where(i < sink_end, i, band_start + i - sink_end)
            dq, pdp = _dq_step(
                dq, pdp, q, do, lse2, delta, k_head, v_head, seq, kv_head, n * BLOCK_N, stride_kn=stride_k[2],
                stride_vn=stride_v[2], offs_m=pos, nq=nq, nk=nk, left=left, right=right, sink_tokens=sink_tokens,
                qk_scale=qk_scale, MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
                HAS_SINK_TOKENS=HAS_SINK_TOKENS, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, VALUE_DIM=VALUE_DIM, TMA=TMA,
                PRECISION=PRECISION, ROW_SUMS=HAS_SINKS)
    else:
        # sink blocks, then the band's masked edge, unmasked interior and masked edge: one loop each
        starts = (0, band_start, full_start, full_end)
        ends = (sink_end, full_start, full_end, band_end)
        for r in tl.static_range(4):
            for n in range(starts[r], ends[r]):
                dq, pdp = _dq_step(
                    dq, pdp, q, do, lse2, delta, k_head, v_head, seq, kv_head, n * BLOCK_N, stride_kn=stride_k[2],
                    stride_vn=stride_v[2], offs_m=pos, nq=nq, nk=nk, left=left, right=right,
                    sink_tokens=sink_tokens, qk_scale=qk_scale, MASKED=r != 2, HAS_LEFT=HAS_LEFT,
                    HAS_RIGHT=HAS_RIGHT, HAS_SINK_TOKENS=HAS_SINK_TOKENS, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                    VALUE_DIM=VALUE_DIM, TMA=TMA, PRECISION=PRECISION, ROW_SUMS=HAS_SINKS)
    dq_rows = b * stride_dq[0] + heads * stride_dq[1] + tokens * stride_dq[2]           # (BLOCK_M,)
    tl.store(DQ + dq_rows[:, None] + offs_d[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=tile_ok)
    if HAS_SINKS:
        # with sinks every lse is finite (>= sinks[h]); rows past the end have pdp = dlse = 0 and lse2 = inf
        p_sink = tl.math.exp2(tl.load(Sinks + heads) * _LOG2E - lse2)                   # (BLOCK_M,)
        tl.store(dsink_slots, -tl.sum(tl.reshape(p_sink * (pdp - dlse), (PACK, ROWS)), axis=1))
