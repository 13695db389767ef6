"""The sm_90 backward kernel, warp-specialised, in Gluon: dK, dV and dQ from one pass over the
(KV tile, Q tile) pairs, dQ added up across KV tiles in float32 by the copy engine's reduce-add
(FlashAttention-3's schedule). Five products per pair where the portable two-kernel backward
(:mod:`gstar.kernels.portable.backward`) spends seven. The calls :mod:`gstar.kernels.dispatch` gives it (full and
causal at D = 128, causal GQA 8 at D = 64) take it by default with
each dQ tile's adds in a fixed order (bitwise reproducible); ``deterministic=False`` drops the order
(docs/hopper.md draws it). With learned sinks the consumers also sum their gradient's terms (``Shares``).

A program owns a 128-key tile of one kv head (of one batch row) and walks ``HEADS`` query heads of its GQA
group and, for each, the 64-row Q tiles that see the tile (:func:`gstar.kernels.common.walk.q_tiles`: masked edges,
unmasked interior). One producer warp copies K and V once, then each step's Q and dO tiles into rings of
``STAGES`` slots (TMA), each copy completing on its slot's ``ready`` barrier. Each of two consumer
warpgroups owns 64 of the tile's keys and keeps their dK, dV accumulators in registers; per step it

1. issues ``S^T = K Q^T`` and ``dP^T = V dO^T`` (keys x queries; K and V from registers at D = 64 without
   learned sinks, else from shared memory),
2. turns the scores into ``P^T`` (the forward's base-2 LSE, the rule's mask on the edge tiles) while dP^T
   runs, issues ``dV += P^T dO``, then forms ``dS^T = P^T (dP^T - delta)`` and issues ``dK += dS^T Q``,
3. writes dS^T into its half of a shared (128 keys x 64 queries) tile and arrives at ``ds_ready``.

dQ of a step needs both halves, so one warpgroup computes it, the two taking turns (even steps the first,
odd steps the second): it starts ``dS K`` over its own 64 keys, waits at ``ds_ready`` for the other half,
finishes over the other 64 keys and writes the (64, D) float32 result into its staging tile (``dq_staged``).
A writer warp hands the tile to the copy engine, which adds it into the dQ accumulator, and frees it once read
(``dq_free``); the add's latency stays in the writer, and the other warpgroup has meanwhile moved on to the
next step's products, so the tensor cores stay busy. A symmetric split (each warpgroup half of dQ's columns
every step) keeps both in lockstep and is slower. The
dS tile is double-buffered by step parity: the barrier a warpgroup waits at tells it that the other has
finished reading the tile it is about to overwrite.

Ordered adds (``ORDERED``): the writer of KV tile j adds into a dQ tile once the count of adds done to it
(an int32 per (batch, head, Q tile)) shows every later KV tile's, and counts its own once complete. In a causal
call with no more keys than queries the program of tile j + 1 reaches each Q tile at least two steps before
tile j's, so the count is there in time; in full attention the programs of a head that start together settle
into a stagger of one add's latency each. The grid launches the last tile first, so a program waits only on
programs launched before it and the order cannot deadlock.

The host (:func:`backward`) runs the portable dQ kernel's row statistics first (delta and the base-2 LSE),
zeroes the accumulator, launches this kernel, sums dK, dV over the group's parts when the group is split
(:func:`heads_per_program`; :func:`gstar.kernels.common.partials.sum_partials`), and casts the accumulator
into dQ.
"""


import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton import constexpr_function
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate  # named bundles of values, as Triton's own Gluon code
from triton.language.core import base_value  # a field that is a tensor in some calls, a constant in others

from ...pattern import Pattern, cdiv
from ..common.partials import sum_partials
from ..common.rule import Rule, mask, rule, visible
from ..common.softmax import LOG2E, sink_max
from ..common.walk import kv_blocks, q_tiles
from .. import card
from ..launch import constexprs, launch
from .ring import descriptor, operand, ring_barriers, ring_load, sync_warpgroup, tma_add, tma_load

ROWS = gl.constexpr(64)  # queries per step, and keys per consumer warpgroup: wgmma's M
BLOCK_N = gl.constexpr(128)  # keys per program: two consumers
STAGES = gl.constexpr(2)  # Q and dO slots each
WRITER = gl.constexpr(32)  # threads of the dQ writer warp, each counting an ordered add once
# a program's fixed cost in steps of its walk, by head dim, as :func:`heads_per_program` weighs it against the
# ordered grid's tail (fitted to GQA 4 and 8 causal calls, 2k to 32k queries)
PROGRAM_STEPS = {128: 10, 64: 4}


@aggregate
class BackwardSmem:
    """A program's shared memory, by name. Tiles: ``k``, ``v`` (128 keys x D), the rings ``q``, ``do``
    (STAGES x 64 queries x D), ``ds`` (dS^T, 2 x 128 keys x 64 queries, by step parity), ``dq`` (2 x 64 x D
    float32 staging tiles, by consumer). Barriers (docs/hopper.md's table): ``kv_ready``; ``q_ready``,
    ``q_empty``, ``do_ready``, ``do_empty`` per ring slot; ``ds_ready`` per parity; ``dq_staged``, ``dq_free``
    per staging tile."""
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    q: gl.shared_memory_descriptor
    do: gl.shared_memory_descriptor
    ds: gl.shared_memory_descriptor
    dq: gl.shared_memory_descriptor
    kv_ready: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    do_ready: gl.shared_memory_descriptor
    do_empty: gl.shared_memory_descriptor
    ds_ready: gl.shared_memory_descriptor
    dq_staged: gl.shared_memory_descriptor
    dq_free: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, k, v, q, do, ds, dq, kv_ready, q_ready, q_empty, do_ready, do_empty, ds_ready, dq_staged,
                 dq_free):
        self.k, self.v, self.q, self.do, self.ds, self.dq = k, v, q, do, ds, dq
        self.kv_ready, self.q_ready, self.q_empty, self.do_ready, self.do_empty = (kv_ready, q_ready, q_empty,
                                                                                   do_ready, do_empty)
        self.ds_ready, self.dq_staged, self.dq_free = ds_ready, dq_staged, dq_free


@gluon.jit
def _last_tile(m, seq_rule):
    """The last 128-key tile that Q tile ``m`` sees (causal, or full): tiles ``0 ..`` it each add into its
    dQ."""
    return kv_blocks(seq_rule, m * ROWS, ROWS, BLOCK_N).band_end - 1


@gluon.jit
def _wait_count(count, target):
    """Every thread of the warp polls the int32 at ``count`` until it reaches ``target`` (an acquire: the adds
    it counts are complete)."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; poll: ld.acquire.gpu.global.b32 $0, [$1]; setp.lt.s32 p, $0, $2; @p bra poll; }",
        "=r,l,r", [count, target], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _release_count(count, PENDING: gl.constexpr):
    """Once at most ``PENDING`` (0 or 1) of this thread's TMA adds are still in flight, adds one to the int32
    at ``count`` (a release). Complete, not only read out of shared memory, which is all ``tma.store_wait``
    waits for; the thread that issued the adds counts only after they are, so WRITER counts mean done."""
    if PENDING == 0:
        gl.inline_asm_elementwise("cp.async.bulk.wait_group 0; red.release.gpu.global.add.s32 [$1], 1; mov.b32 $0, 0;",
                                  "=r,l", [count], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("cp.async.bulk.wait_group 1; red.release.gpu.global.add.s32 [$1], 1; mov.b32 $0, 0;",
                                  "=r,l", [count], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _loader(q_desc, k_desc, v_desc, do_desc, shared, batch, hkv, h_first, key0, m_start, n_m, HEADS: gl.constexpr):
    """One warp: K and V, then Q and dO of every step into slot ``step % STAGES`` of their rings. Step ``it``
    is query head ``h_first + it // n_m``, Q tile ``m_start + it % n_m``."""
    mbarrier.expect(shared.kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [batch, hkv, key0, 0], shared.kv_ready, shared.k)
    tma_load(v_desc, [batch, hkv, key0, 0], shared.kv_ready, shared.v)
    for it in range(HEADS * n_m):
        coord = [batch, h_first + it // n_m, (m_start + it % n_m) * ROWS, 0]
        ring_load(q_desc, coord, shared.q, shared.q_ready, shared.q_empty, it)
        ring_load(do_desc, coord, shared.do, shared.do_ready, shared.do_empty, it)


@gluon.jit
def _dq_writer(dqa_desc, Counts, shared, batch, h_first, tile, m_start, n_m, seq_rule, HEADS: gl.constexpr,
               ORDERED: gl.constexpr, COUNT_LATE: gl.constexpr):
    """One warp: adds each step's dQ tile, staged by the warpgroup whose turn it was (step ``it``: buffer
    ``it % 2``), into the float32 accumulator by the copy engine's reduce-add, and frees the buffer once the
    add has read it; the latency of the adds stays off the consumers. ORDERED: a dQ tile's adds go in
    descending KV-tile order. Counts (B, Hq, n_q_tiles) int32 holds WRITER per add done; the writer waits
    until its tile's count shows every later KV tile's add, and counts its own add once it is complete:
    at once, or with COUNT_LATE once it has issued the next add (the last at the end), so that the wait for
    completion overlaps that add."""
    n_q_tiles = gl.cdiv(seq_rule.nq, ROWS)
    count = Counts
    for it in range(HEADS * n_m):
        h = h_first + it // n_m
        m = m_start + it % n_m
        mbarrier.wait(shared.dq_staged.index(it % 2), (it // 2) & 1)
        if ORDERED:
            done = count
            count = Counts + (batch * gl.num_programs(1) * HEADS + h) * n_q_tiles + m
            _wait_count(count, (_last_tile(m, seq_rule) - tile) * WRITER)
        tma_add(dqa_desc, [batch, h, m * ROWS, 0], shared.dq.index(it % 2))  # rows past Nq are clipped
        if COUNT_LATE and it > 0:
            _release_count(done, 1)
        tma.store_wait(0)
        mbarrier.arrive(shared.dq_free.index(it % 2), count=1)
        if ORDERED and not COUNT_LATE:
            _release_count(count, 0)
    if COUNT_LATE and HEADS * n_m > 0:
        _release_count(count, 0)


@aggregate
class KeyHalf:
    """What a consumer warpgroup's steps read and never change. ``half``: which 64 of the tile's keys it owns
    (0 or 1); ``k_op``, ``v_op``: their K and V as the A operands of S^T and dP^T (registers or shared memory,
    :func:`_key_warpgroup`); ``k``: its keys in shared memory (dQ's B operand), ``k_other``: the other's; ``keys``:
    their positions (64,); ``s_zero``, ``dq_zero``: zero (64, 64) and (64, D) float32 accumulators in the
    products' layouts; ``Lse2``, ``Delta``: the rows' statistics; ``qk_scale``, ``scale``; ``rule``: the
    sequence's :class:`gstar.kernels.common.rule.Rule` (full attention, or causal)."""
    half: gl.constexpr
    k_op: base_value
    v_op: base_value
    k: gl.shared_memory_descriptor
    k_other: gl.shared_memory_descriptor
    keys: gl.tensor
    s_zero: gl.tensor
    dq_zero: gl.tensor
    Lse2: base_value
    Delta: base_value
    qk_scale: base_value
    scale: base_value
    rule: Rule

    @constexpr_function
    def __init__(self, half, k_op, v_op, k, k_other, keys, s_zero, dq_zero, Lse2, Delta, qk_scale, scale, rule):
        self.half = gl.constexpr(half)
        self.k_op, self.v_op, self.k, self.k_other, self.keys = k_op, v_op, k, k_other, keys
        self.s_zero, self.dq_zero, self.Lse2, self.Delta = s_zero, dq_zero, Lse2, Delta
        self.qk_scale, self.scale, self.rule = qk_scale, scale, rule


@gluon.jit
def _tile_run(me, shared, dk, dv, pdp_sum, lo, hi, it0, row_base, sink2, MASKED: gl.constexpr,
              HAS_SINKS: gl.constexpr):
    """Q tiles ``[lo, hi)`` of one query head (steps ``it0 ..``): adds each one's share to this warpgroup's
    (``me``, a :class:`KeyHalf`) dk, dv (64, D) float32 and, on its turns, stages the step's dQ for the
    writer. row_base: Lse2's and Delta's offset of the head's row 0. HAS_SINKS: pdp_sum (64,) float32 also
    gathers, per key, ``P * dP`` weighted by each row's sink probability ``exp2(sink2 - lse2)`` (sink2: the
    head's base-2 sink logit), the rows' dsinks terms."""
    HEAD_DIM: gl.constexpr = me.k.shape[1]
    col_layout: gl.constexpr = gl.SliceLayout(0, me.s_zero.type.layout)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    half: gl.constexpr = me.half
    dq_tile = shared.dq.index(half).reshape([ROWS, HEAD_DIM])  # (64 queries, D) float32
    for m in range(lo, hi):
        it = it0 + m - lo
        slot = it % STAGES
        phase = (it // STAGES) & 1
        q = shared.q.index(slot).reshape([ROWS, HEAD_DIM])    # (64 queries, D)
        do = shared.do.index(slot).reshape([ROWS, HEAD_DIM])  # (64 queries, D)
        mbarrier.wait(shared.q_ready.index(slot), phase)
        # S^T and dP^T: (64 keys, 64 queries) each
        s_t = warpgroup_mma(me.k_op, q.permute((1, 0)), me.s_zero, use_acc=False, is_async=True)
        mbarrier.wait(shared.do_ready.index(slot), phase)
        dp_t = warpgroup_mma(me.v_op, do.permute((1, 0)), me.s_zero, use_acc=False, is_async=True)
        # the rows' statistics, one register each until the scores land (then one per score column)
        rows = m * ROWS + gl.arange(0, ROWS, layout=row_layout)  # (64,) query positions
        lse2 = gl.load(me.Lse2 + row_base + rows, mask=rows < me.rule.nq, other=float("inf"))  # past Nq: no weight
        delta = gl.load(me.Delta + row_base + rows, mask=rows < me.rule.nq, other=0.0)
        s_t = warpgroup_mma_wait(num_outstanding=1, deps=(s_t, ))
        p_t = gl.exp2(s_t * me.qk_scale - gl.convert_layout(lse2, col_layout)[None, :])
        if MASKED:
            cols = m * ROWS + gl.arange(0, ROWS, layout=col_layout)
            p_t = gl.where(visible(me.rule, cols[None, :], me.keys[:, None]), p_t, 0.0)
        dv = warpgroup_mma(operand(p_t, dv, q.dtype), do, dv, is_async=True)
        dp_t = warpgroup_mma_wait(num_outstanding=1, deps=(dp_t, ))
        if HAS_SINKS:  # P * dP once: the sinks' share from it, then dS
            pdp = p_t * dp_t
            sink_p = gl.convert_layout(gl.exp2(sink2 - lse2), col_layout)  # (64,) each row's sink probability
            pdp_sum += gl.sum(pdp * sink_p[None, :], axis=1)
            ds_t = pdp - p_t * gl.convert_layout(delta, col_layout)[None, :]
        else:
            ds_t = p_t * (dp_t - gl.convert_layout(delta, col_layout)[None, :])
        dk = warpgroup_mma(operand(ds_t, dk, q.dtype), q, dk, is_async=True)
        # this warpgroup's dS^T rows into the shared tile; the other's arrive completes the barrier
        ds = shared.ds.index(it % 2)
        ds.slice(half * ROWS, ROWS, dim=0).store(ds_t.to(q.dtype))
        fence_async_shared()
        sync_warpgroup()
        mbarrier.arrive(shared.ds_ready.index(it % 2), count=1)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        if it % 2 == half:  # this warpgroup's turn: dQ over all 128 keys, while the other runs ahead
            own = ds.slice(half * ROWS, ROWS, dim=0).permute((1, 0))       # (64 queries, its 64 keys)
            dq = warpgroup_mma(own, me.k, me.dq_zero, use_acc=False, is_async=True)  # (64 queries, D)
            mbarrier.wait(shared.ds_ready.index(it % 2), (it // 2) & 1)
            other = ds.slice((1 - half) * ROWS, ROWS, dim=0).permute((1, 0))
            dq = warpgroup_mma(other, me.k_other, dq, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
            # into the staging tile once the writer's last add from it has read it; the writer adds it to dQ
            mbarrier.wait(shared.dq_free.index(half), ((it // 2) & 1) ^ 1)
            dq_tile.store(dq * me.scale)
            fence_async_shared()
            sync_warpgroup()
            mbarrier.arrive(shared.dq_staged.index(half), count=1)
        mbarrier.arrive(shared.q_empty.index(slot), count=1)
        mbarrier.arrive(shared.do_empty.index(slot), count=1)
    return dk, dv, pdp_sum


@gluon.jit
def _key_warpgroup(DK, DV, Lse2, Delta, Sinks, Shares, shared, b, hkv, part, h_first, tile, half, starts, n_m,
                   seq_rule, qk_scale, scale, stride_dk, stride_dv, HEADS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """One warpgroup: keys ``tile * 128 + half * 64 ...`` of the tile, from K and V in shared memory to their
    rows of DK and DV (of part ``part``). starts: ``(m_start, full_start, full_end, m_end)`` of
    :func:`q_tiles`. With learned sinks (Sinks: (Hq,) float32, else None) it stores each head's sum of
    ``exp(sinks - lse) * P * dP`` over its keys to Shares (B, n_tiles, 2, Hq) float32."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    s_zero = gl.zeros([ROWS, ROWS], gl.float32, layout=s_layout)            # (64 keys, 64 queries)
    dq_zero = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)    # (64 queries, D)
    dk = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)          # (64 keys, D)
    dv = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=acc_layout)
    k = shared.k.reshape([BLOCK_N, HEAD_DIM]).slice(half * ROWS, ROWS, dim=0)  # (64 keys, D)
    v = shared.v.reshape([BLOCK_N, HEAD_DIM]).slice(half * ROWS, ROWS, dim=0)
    k_other = shared.k.reshape([BLOCK_N, HEAD_DIM]).slice((1 - half) * ROWS, ROWS, dim=0)  # the other's keys
    key0 = tile * BLOCK_N
    keys = key0 + half * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))  # (64,)
    mbarrier.wait(shared.kv_ready, 0)
    # S^T's and dP^T's A operands. A 64 x 64 product with both in shared memory reads 128 bytes a clock, all the
    # SM's shared-memory bandwidth, so at D = 64 (32 registers) K and V come from registers. Not with learned
    # sinks (their sum's registers leave no room) nor at D = 128 (it would spill)
    if HEAD_DIM <= 64 and Sinks is None:
        op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
        k_op = k.load(op_layout)  # (64 keys, D)
        v_op = v.load(op_layout)
    else:
        k_op = k
        v_op = v
    me = KeyHalf(half=half, k_op=k_op, v_op=v_op, k=k, k_other=k_other, keys=keys, s_zero=s_zero, dq_zero=dq_zero,
                 Lse2=Lse2, Delta=Delta, qk_scale=qk_scale, scale=scale, rule=seq_rule)
    for g in range(HEADS):
        h = h_first + g
        row_base = (b * gl.num_programs(1) * HEADS + h) * seq_rule.nq  # (B, Hq, Nq) row 0 of head h
        it = g * n_m
        pdp_sum = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))  # (64,) per key
        sink2 = 0.0
        if Sinks is not None:
            sink2 = sink_max(Sinks, h)  # base 2, as Lse2
        for segment in gl.static_range(3):  # masked edge, unmasked interior, masked edge
            lo = starts[segment]
            hi = starts[segment + 1]
            dk, dv, pdp_sum = _tile_run(me, shared, dk, dv, pdp_sum, lo, hi, it + lo - starts[0], row_base, sink2,
                                        segment != 1, Sinks is not None)
        if Sinks is not None:
            gl.store(Shares + ((b * gl.num_programs(0) + tile) * 2 + half) * (gl.num_programs(1) * HEADS) + h,
                     gl.sum(pdp_sum, axis=0))
    key_rows = key0 + half * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_layout))  # (64,)
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))                      # (D,)
    ok = (key_rows < seq_rule.nk)[:, None]
    dk_rows = (part * stride_dk[0] + b.to(gl.int64) * stride_dk[1] + hkv * stride_dk[2]
               + key_rows.to(gl.int64) * stride_dk[3])
    gl.store(DK + dk_rows[:, None] + cols[None, :], (dk * scale).to(DK.dtype.element_ty), mask=ok)
    dv_rows = (part * stride_dv[0] + b.to(gl.int64) * stride_dv[1] + hkv * stride_dv[2]
               + key_rows.to(gl.int64) * stride_dv[3])
    gl.store(DV + dv_rows[:, None] + cols[None, :], dv.to(DV.dtype.element_ty), mask=ok)


@gluon.jit(do_not_specialize=["Nq", "Nk", "right"])
def _backward_sm90(q_desc, k_desc, v_desc, do_desc, dqa_desc, DK, DV, Lse2, Delta, Sinks, Shares, Counts, Nq, Nk,
                   right, qk_scale, scale, stride_dk, stride_dv, GROUP: gl.constexpr, HEADS: gl.constexpr,
                   HEAD_DIM: gl.constexpr, MASK: gl.constexpr, ORDERED: gl.constexpr, COUNT_LATE: gl.constexpr):
    """Grid ``(cdiv(Nk, 128), Hq // HEADS, B)``: one 128-key tile of one kv head against HEADS of its GROUP
    query heads: their share of the tile's dK, dV and of dQ.

    q_desc, do_desc: descriptors over (B, Hq, Nq, D) moving (1, 1, 64, D) tiles; k_desc, v_desc: over (B,
    Hkv, Nk, D) moving (1, 1, 128, D). DK, DV: (GROUP // HEADS, B, Hkv, Nk, D), one part per program of a
    group, with (part, batch, head, row) strides ``stride_dk``, ``stride_dv`` (part stride 0 when one program
    takes the whole group); Lse2 (base-2 LSE), Delta: (B, Hq, Nq) float32 contiguous; dqa_desc: over
    (B, Hq, Nq, D) float32, zeroed, moving (1, 1, 64, D) tiles: receives ``scale * dS K``. Full attention, or
    causal (``right`` = 0 under MASK's right bound); qk_scale = scale * log2(e). ORDERED, COUNT_LATE: the writer's
    (:func:`_dq_writer`); Counts: its (B, Hq, n_q_tiles) int32, zeroed (unread when not ORDERED). Sinks, Shares:
    None, or the learned sinks and the consumers' dsinks terms (:func:`_key_warpgroup`).
    """
    tile = gl.program_id(0)
    if ORDERED:  # the last tile first: every program waits only on programs launched before it
        tile = gl.num_programs(0) - 1 - tile
    h_first = gl.program_id(1) * HEADS
    hkv = h_first // GROUP
    part = (h_first % GROUP) // HEADS
    b = gl.program_id(2)
    key0 = tile * BLOCK_N
    seq_rule = rule(Nq, Nk, 0, right, 0, 0, None, MASK)
    tiles = q_tiles(seq_rule, key0, ROWS, BLOCK_N)
    m_start, full_start, full_end, m_end = tiles.start, tiles.full_start, tiles.full_end, tiles.end
    n_m = m_end - m_start

    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROWS], q_desc.dtype)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_N, ROWS], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dqa_desc.block_type.shape, dqa_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    q_ready, q_empty = ring_barriers(STAGES, 2)  # freed by both consumer warpgroups
    do_ready, do_empty = ring_barriers(STAGES, 2)
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_staged = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for parity in gl.static_range(2):
        mbarrier.init(ds_ready.index(parity), count=2)  # both halves of dS^T written
        mbarrier.init(dq_staged.index(parity), count=1)  # a step's dQ staged in buffer parity
        mbarrier.init(dq_free.index(parity), count=1)  # its add has read it

    shared = BackwardSmem(k=k_smem, v=v_smem, q=q_smem, do=do_smem, ds=ds_smem, dq=dq_smem, kv_ready=kv_ready,
                    q_ready=q_ready, q_empty=q_empty, do_ready=do_ready, do_empty=do_empty, ds_ready=ds_ready,
                    dq_staged=dq_staged, dq_free=dq_free)
    starts = (m_start, full_start, full_end, m_end)
    gl.warp_specialize([
        (_key_warpgroup, (DK, DV, Lse2, Delta, Sinks, Shares, shared, b, hkv, part, h_first, tile, 0, starts, n_m,
                          seq_rule, qk_scale, scale, stride_dk, stride_dv, HEADS, HEAD_DIM)),
        (_key_warpgroup, (DK, DV, Lse2, Delta, Sinks, Shares, shared, b, hkv, part, h_first, tile, 1, starts, n_m,
                          seq_rule, qk_scale, scale, stride_dk, stride_dv, HEADS, HEAD_DIM)),
        (_loader, (q_desc, k_desc, v_desc, do_desc, shared, b, hkv, h_first, key0, m_start, n_m, HEADS)),
        (_dq_writer, (dqa_desc, Counts, shared, b, h_first, tile, m_start, n_m, seq_rule, HEADS, ORDERED,
                      COUNT_LATE)),
    ], [4, 1, 1], [240, 24, 24])


def heads_per_program(batch: int, heads: int, group: int, nq: int, head_dim: int, *, causal: bool, ordered: bool,
                      device: str) -> int:
    """Query heads of a GQA group that one program walks; a split group's parts have their dK, dV summed in
    float32 by :func:`_sum_parts`. Full attention's programs are all alike and walk the whole group. A causal
    call's program of KV tile j runs ``heads x (n_q_tiles - 2 j)`` steps, so fewer heads a program shorten
    the longest but add programs, each with a fixed cost (K and V, the pipeline's fill, dK and dV).

    Ordered adds launch the shortest program first, so the grid ends on its longest, ``h n_q`` steps against
    an SM's share of ``B Hq n_q^2 / 4``: a tail of ``4 h SMs / (B Hq n_q)``. A fixed cost of c steps a program
    over an average walk of ``h n_q / 2`` adds ``2 c / (h n_q)``. Both scale as 1 / n_q, so the divisor of the
    group that minimises ``c / (2 h) + h SMs / (B Hq)`` serves every length (c: ``PROGRAM_STEPS``).
    Unordered adds launch the longest first, and the tail is what is left once the longest no longer fits: the
    largest divisor whose longest program stays under a quarter of an SM's share."""
    if not causal:
        return group
    divisors = [h for h in range(1, group + 1) if group % h == 0]
    sms = card.sm_count(device)
    if ordered:
        return min(divisors, key=lambda h: PROGRAM_STEPS[head_dim] / (2 * h) + h * sms / (batch * heads))
    bound = batch * heads * cdiv(nq, ROWS.value) / (16 * sms)  # 4 x longest <= share
    return max(h for h in divisors if h <= bound or h == 1)


def count_late(pattern: Pattern) -> bool:
    """Whether the writer counts each ordered add once it has issued the next (the wait for completion
    hidden) rather than as soon as it completes: in a causal call with no more keys than queries, where the
    programs that add into a dQ tile reach it in descending order two steps apart. In full attention they
    reach it together, and counting late would hold each program a step behind the one before."""
    return pattern.right == 0 and pattern.nk <= pattern.nq


def backward(q, k, v, dout, dk, dv, dqa, lse2, delta, sinks, pattern: Pattern, scale: float, deterministic: bool):
    """Fill dk, dv (like k, v) and add ``scale * dS K`` into dqa (B, Hq, Nq, D) float32 contiguous, zeroed,
    for a dense call :mod:`gstar.kernels.dispatch` gives this kernel. q, dout: (B, Hq, Nq, D); k, v: (B, Hkv, Nk,
    D); lse2, delta: (B, Hq, Nq) float32 contiguous, the base-2 LSE and ``rowsum(dO * O) - dLSE`` (the dQ
    kernel's statistics, :func:`gstar.kernels.portable.backward.statistics`); sinks: None or (Hq,) float32
    learned sink logits. deterministic: each dQ tile's adds in descending KV-tile order. Returns None, or with
    sinks ``sum_rows exp(sinks - lse) * rowsum(P * dP)``, (Hq,) float32 summed in a fixed order: dsinks is minus
    it plus the LSE gradient's term. It sums P * dP rather than taking delta, whose O is rounded to the input
    dtype."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    n_tiles = cdiv(Nk, BLOCK_N.value)
    parts = group // heads_per_program(B, Hq, group, Nq, D, causal=pattern.right >= 0, ordered=deterministic,
                                       device=str(q.device))
    pk, pv, stride_pk, stride_pv = _partials(dk, dv, parts, n_tiles)
    shape = (B, Hq, cdiv(Nq, ROWS.value)) if deterministic else (0, )
    counts = torch.zeros(shape, dtype=torch.int32, device=q.device)  # (B, Hq, n_q_tiles): adds done per dQ tile
    shares = None if sinks is None else torch.zeros((B, n_tiles, 2, Hq), dtype=torch.float32, device=q.device)
    _backward_sm90[(n_tiles, Hq // (group // parts), B)](
        q_desc=descriptor(q, ROWS.value), k_desc=descriptor(k, BLOCK_N.value), v_desc=descriptor(v, BLOCK_N.value),
        do_desc=descriptor(dout, ROWS.value), dqa_desc=descriptor(dqa, ROWS.value), DK=pk, DV=pv, Lse2=lse2,
        Delta=delta, Sinks=sinks, Shares=shares, Counts=counts, Nq=Nq, Nk=Nk, right=max(pattern.right, 0),
        qk_scale=scale * LOG2E.value, scale=scale, stride_dk=stride_pk, stride_dv=stride_pv, GROUP=group,
        HEADS=group // parts, HEAD_DIM=D, MASK=mask(pattern), ORDERED=deterministic,
        COUNT_LATE=deterministic and count_late(pattern), num_warps=4, maxnreg=168)
    if parts > 1:
        _sum_parts(pk, pv, dk, dv, parts)
    return None if shares is None else shares.sum(dim=(0, 1, 2))  # (Hq,)


def _partials(dk, dv, parts: int, n_tiles: int):
    """Where the kernel's programs store dK, dV: ``(pk, pv, stride_pk, stride_pv)``, the strides (part, batch,
    head, row). One part: dk, dv themselves. Several: float32 partials in :func:`sum_partials`' layout,
    (B, Hkv, parts, n_tiles items of 128 keys, D), one item per KV tile."""
    if parts == 1:
        return dk, dv, (0, *dk.stride()[:3]), (0, *dv.stride()[:3])
    B, Hkv, _, D = dk.shape
    pk, pv = (torch.empty((B, Hkv, parts, n_tiles * BLOCK_N.value, D), dtype=torch.float32, device=dk.device)
              for _ in "kv")
    return pk, pv, *((p.stride(2), p.stride(0), p.stride(1), p.stride(3)) for p in (pk, pv))


@functools.lru_cache(maxsize=64)
def _one_item_per_tile(n_tiles: int, device: str) -> torch.Tensor:
    """:func:`sum_partials`' FIRST for items that are the KV tiles themselves: tile t's one item is t."""
    return torch.arange(n_tiles + 1, dtype=torch.int32, device=device)                      # (n_tiles + 1,)


def _sum_parts(pk, pv, dk, dv, parts: int) -> None:
    """dk, dv = the sums of their parts (:func:`_partials`), part by part in a fixed order, one item per KV tile."""
    B, Hkv, Nk, D = dk.shape
    n_tiles = cdiv(Nk, BLOCK_N.value)
    launch(sum_partials, (n_tiles, Hkv, B),
           dict(PK=pk, PV=pv, DK=dk, DV=dv, FIRST=_one_item_per_tile(n_tiles, str(dk.device)),
                stride_dk=tuple(dk.stride()[:3]), stride_dv=tuple(dv.stride()[:3]), Hkv=Hkv, nk=Nk, head_splits=parts,
                n_items=n_tiles), constexprs(BLOCK_N=BLOCK_N.value, HEAD_DIM=D, VALUE_DIM=D, num_warps=4))
