"""The sm_90 forward kernel, warp-specialised, in Gluon: one producer warp and ``CONSUMERS`` consumer
warpgroups per program (two at head dim 128, three at 64), the schedule of FlashAttention-3 (docs/hopper.md
draws it).

A program owns a Q tile of 64 rows per consumer of one query head (of one sequence, when packed). The producer
warp copies the tile's Q (one 64-row part per consumer), then each visible K and V block, into rings of
``STAGES`` shared-memory slots with the tensor-memory copy engine (TMA), each copy completing on its slot's
``ready`` barrier. Each consumer warpgroup owns one 64-row part; per block it issues Q K^T (``warpgroup_mma``,
both operands in shared memory) and then the previous block's P V (P from registers), waits for the scores
alone and runs the softmax while the tensor cores compute that product; it frees a slot by arriving on its
``empty`` barrier (one arrival per consumer) once the product that read it has completed.

Dense full attention walks its tiles persistently: one program per SM, each taking the items (tile, head, batch)
of :func:`_work_item` in turn, its Q ring of two slots letting the next item's Q land during this one's last
steps; causal and packed calls keep one program per item, as the hardware's dispatch evens out unequal items
better than a fixed walk.

The blocks a tile visits, which of them need the mask, and each block's softmax come from what every other kernel
calls (:mod:`gstar.kernels.common`): sink-token blocks first, then the band, masked at its edges, walked by step.
:mod:`gstar.kernels.dispatch` says which calls take this kernel.

FP8 inputs (float8_e4m3fn q, k, v with descales, :mod:`gstar.fp8`) take the same schedule with ``Q K^T`` on
the FP8 tensor cores (half the instructions of a 16-bit product) and ``P V`` in bfloat16 against V widened
once before the launch: P rounded to FP8's 3 mantissa bits misses the accuracy bar (docs/design.md section 4)
on causal rows with few keys, which bfloat16's 8 bits keep.
"""

from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton import constexpr_function
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.language.core import _aggregate as aggregate  # named bundles of values, as Triton's own Gluon code
from triton.language.core import base_value  # a field that is a tensor in some calls, a constant in others

from ...fp8 import FP8
from ...pattern import Pattern, cdiv
from ..common.fp8 import descale_args, load_descales
from ..common.rule import bounds, mask, rule, sequence_bounds
from ..common.sizes import head_parts
from ..common.softmax import LOG2E, finish_state, sink_max, softmax_step
from ..common.walk import block_at, first_block, kv_blocks, steps, tiles_fastest
from .. import card
from .ring import descriptor, operand, ring_barriers, ring_load, tma_load, tma_store

ROWS = gl.constexpr(64)  # query rows per consumer warpgroup: wgmma's M
STAGES = gl.constexpr(2)  # K and V slots each: 2 x 2 x 32 KB at D = 128, beside 2 x 32 KB of Q
SHARED_BYTES = 232448  # an sm_90 program's shared memory (227 KB)


class Tiles(NamedTuple):
    """A head-dim pair's program: ``consumers`` warpgroups (64 query rows each) and ``block_n`` keys a block."""
    consumers: int
    block_n: int


# (D, Dv) -> tiles. At D = 64 the softmax sets a step's pace, and a third consumer gives each warpgroup's
# softmax two others' products to hide under; at D = 128 three do not fit the registers. At D = 256 a block of
# 64 keys keeps two K and two V slots beside Q in shared memory, and each consumer's (64, 256) float32
# accumulator takes half its registers. D = 192 is held in two parts (:func:`head_parts`), V and the output in 128 lanes.
TILES = {(64, 64): Tiles(3, 128), (128, 128): Tiles(2, 128), (192, 128): Tiles(2, 128), (256, 256): Tiles(2, 64)}


def block_m(head_dim: int, value_dim: int | None = None) -> int:
    """Query rows per program (a Q tile) at these head dims: 64 per consumer warpgroup."""
    return ROWS.value * TILES[head_dim, value_dim or head_dim].consumers


def _registers(consumers: int) -> tuple[int, int]:
    """``(per consumer thread, at launch)``: the register file (64K) shared by the consumer warpgroups and the
    producer's (24 a thread), and spread evenly over all of them at launch; multiples of 8, as setmaxnreg takes."""
    return (65536 - 128 * 24) // (128 * consumers) // 8 * 8, 65536 // (128 * (consumers + 1)) // 8 * 8


@aggregate
class ForwardSmem:
    """A program's shared memory, by name. Tiles: ``q`` (a 64-row part per consumer for each Q slot), ``k``,
    ``v`` (rings of STAGES blocks of BLOCK_N x D or Dv), ``o`` (the output's parts: ``q`` itself, or FP8's one
    set of its own); ``q_tail``, ``k_tail``: the lanes of a head dim held in two parts past the first part's
    (:func:`head_parts`; None for one part), slots beside ``q``'s and ``k``'s. Barriers: ``q_ready``, ``q_empty`` per
    Q slot; ``k_ready``, ``k_empty``, ``v_ready``, ``v_empty`` per ring slot (:func:`ring_barriers`)."""
    q: gl.shared_memory_descriptor
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    o: gl.shared_memory_descriptor
    q_tail: base_value
    k_tail: base_value
    q_ready: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    k_empty: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    v_empty: gl.shared_memory_descriptor

    @constexpr_function
    def __init__(self, q, k, v, o, q_tail, k_tail, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty):
        self.q, self.k, self.v, self.o = q, k, v, o
        self.q_tail, self.k_tail = (gl.constexpr(None) if t is None else t for t in (q_tail, k_tail))
        self.q_ready, self.q_empty = q_ready, q_empty
        self.k_ready, self.k_empty, self.v_ready, self.v_empty = k_ready, k_empty, v_ready, v_empty


@aggregate
class WorkItem:
    """One (Q tile, head, sequence) of a program's items (:func:`_work_item`). ``valid``: false past the last
    item and on tiles past a packed sequence's end; ``b``: the sequence; ``batch``: the descriptors' first
    coordinate (0 when packed); ``h``: the query head; ``row0``: the tile's first row in the sequence; ``Nq``,
    ``Nk``: the sequence's lengths; ``q_start``, ``k_start``: its first rows (0 unless packed)."""
    valid: base_value
    batch: base_value
    b: base_value
    h: base_value
    row0: base_value
    q_start: base_value
    Nq: base_value
    k_start: base_value
    Nk: base_value

    @constexpr_function
    def __init__(self, valid, batch, b, h, row0, q_start, Nq, k_start, Nk):
        self.valid, self.batch, self.b, self.h, self.row0 = valid, batch, b, h, row0
        self.q_start, self.Nq, self.k_start, self.Nk = q_start, Nq, k_start, Nk


@aggregate
class Items:
    """The work items a grid covers: ``n_tiles`` Q tiles of ``BLOCK_M`` rows (the longest sequence's, when packed)
    x ``Hq`` heads x ``seqs`` sequences. Dense: ``CuQ``, ``CuK`` None, every sequence ``Nq`` queries and ``Nk``
    keys; packed: ``CuQ``, ``CuK`` (seqs + 1,) int32, the sequences' bounds (:func:`sequence_bounds`)."""
    CuQ: base_value
    CuK: base_value
    Nq: base_value
    Nk: base_value
    Hq: base_value
    n_tiles: base_value
    seqs: base_value
    BLOCK_M: gl.constexpr

    @constexpr_function
    def __init__(self, CuQ, CuK, Nq, Nk, Hq, n_tiles, seqs, BLOCK_M):
        self.BLOCK_M = gl.constexpr(BLOCK_M)
        self.CuQ, self.CuK = (gl.constexpr(None) if cu is None else cu for cu in (CuQ, CuK))  # None: a constant
        self.Nq, self.Nk = Nq, Nk
        self.Hq, self.n_tiles, self.seqs = Hq, n_tiles, seqs


@aggregate
class Flags:
    """The constants a warp's work items take: the pattern's :class:`Mask` ``MASK``, and a consumer's ``part``
    (which 64 rows of each tile it owns; the producer's default). Fields of an aggregate stay constants, where a
    tuple of values would make them runtime values."""
    MASK: gl.constexpr
    part: gl.constexpr

    @constexpr_function
    def __init__(self, MASK, part=0):
        self.MASK, self.part = gl.constexpr(MASK), gl.constexpr(part)


@gluon.jit
def _work_item(r, items, TILES_FASTEST: gl.constexpr, PERSISTENT: gl.constexpr):
    """This program's :class:`WorkItem` of round ``r`` of the :class:`Items` ``items``. The items, (tile, head,
    sequence) triples, run sequence by sequence, longest tile first, tiles or heads fastest as
    :func:`tiles_fastest` says (a sequence's K/V stays in L2 while its items run). PERSISTENT: round ``r`` hands
    items ``r * P .. r * P + P - 1`` to the ``P`` programs, in reverse on odd rounds (a program that took a long
    item takes a short one next); else the program's own item of the grid."""
    Hq, n_tiles, seqs = items.Hq, items.n_tiles, items.seqs
    VARLEN: gl.constexpr = items.CuQ is not None
    if PERSISTENT:
        P = gl.num_programs(0)
        w = r * P + gl.where(r % 2 == 0, gl.program_id(0), P - 1 - gl.program_id(0))
        if TILES_FASTEST:
            tile = n_tiles - 1 - w % n_tiles
            h = (w // n_tiles) % Hq
            b = w // (n_tiles * Hq)
        else:
            h = w % Hq
            tile = n_tiles - 1 - (w // Hq) % n_tiles
            b = w // (Hq * n_tiles)
        valid = w < seqs * Hq * n_tiles
        b = gl.minimum(b, seqs - 1)  # past the last item: any sequence, never used
    else:  # the item of a (heads, tiles, sequences) grid, its first two axes swapped where tiles run fastest
        # (the same order; a 1-D grid decoded as above is slower on the causal layers)
        HEAD_AXIS: gl.constexpr = 1 if TILES_FASTEST else 0
        h = gl.program_id(HEAD_AXIS)
        tile = gl.num_programs(1 - HEAD_AXIS) - 1 - gl.program_id(1 - HEAD_AXIS)
        b = gl.program_id(2)
        valid = True
    q_start, Nq = sequence_bounds(items.CuQ, b, items.Nq, VARLEN)
    k_start, Nk = sequence_bounds(items.CuK, b, items.Nk, VARLEN)
    row0 = tile * items.BLOCK_M
    batch = b
    if VARLEN:
        batch = 0  # one packed batch row; the sequence is found through CuQ and CuK
        valid = valid & (row0 < Nq)  # (a dense batch's tiles all hold rows)
    return WorkItem(valid=valid, batch=batch, b=b, h=h, row0=row0, q_start=q_start, Nq=Nq, k_start=k_start, Nk=Nk)


@gluon.jit
def _rounds(items):
    """How many rounds of :func:`_work_item` cover every item of the :class:`Items` ``items``."""
    return gl.cdiv(items.seqs * items.Hq * items.n_tiles, gl.num_programs(0))


@gluon.jit
def _produce_item(item, c, t, args, flags):
    """Work item t (a :class:`WorkItem`) whose step 0 is the program's step ``c``: its Q into
    slot ``t % slots`` of the Q ring once free, then K and V of its every step into slot ``step % STAGES`` of
    theirs; returns its step count. args, flags: as :func:`_load_warp` passes them."""
    q_desc, k_desc, v_desc, q_tail_desc, k_tail_desc, shared, group, pattern_bounds = args
    left, right, sink_tokens = pattern_bounds
    batch, h, row0 = item.batch, item.h, item.row0
    slot = t % shared.q_ready.shape[0]
    PARTS: gl.constexpr = shared.q.shape[0] // shared.q_ready.shape[0]
    BLOCK_N: gl.constexpr = shared.k.shape[3]
    HEAD: gl.constexpr = shared.q.shape[4]  # the first part's lanes; a tail's start from there
    mbarrier.wait(shared.q_empty.index(slot), ((t // shared.q_ready.shape[0]) & 1) ^ 1)
    q_bytes: gl.constexpr = q_desc.block_type.nbytes + (0 if q_tail_desc is None else q_tail_desc.block_type.nbytes)
    mbarrier.expect(shared.q_ready.index(slot), PARTS * q_bytes)
    q_row = item.q_start + row0
    for part in gl.static_range(PARTS):
        tma_load(q_desc, [batch, h, q_row + part * ROWS, 0], shared.q_ready.index(slot),
                 shared.q.index(PARTS * slot + part))
        if q_tail_desc is not None:
            tma_load(q_tail_desc, [batch, h, q_row + part * ROWS, HEAD], shared.q_ready.index(slot),
                     shared.q_tail.index(PARTS * slot + part))
    seq_rule = rule(item.Nq, item.Nk, left, right, sink_tokens, 0, None, flags.MASK)
    blocks = kv_blocks(seq_rule, row0, PARTS * ROWS, BLOCK_N)
    n = steps(blocks)[2]
    for i in range(n):
        start = item.k_start + block_at(blocks, i) * BLOCK_N
        ring_load(k_desc, [batch, h // group, start, 0], shared.k, shared.k_ready, shared.k_empty, c + i,
                  k_tail_desc, [batch, h // group, start, HEAD], shared.k_tail)
        ring_load(v_desc, [batch, h // group, start, 0], shared.v, shared.v_ready, shared.v_empty, c + i)
    return n


@gluon.jit
def _each_item(item_fn: gl.constexpr, args, flags, items, PERSISTENT: gl.constexpr):
    """``item_fn(item, c, t, args, flags)`` on each work item of the program (:func:`_work_item`), which
    returns the item's step count: PERSISTENT, ``c`` and ``t`` count the steps and items before it over the
    program's walk (the rings' running indices); else the program's one item, both constant (0). flags: the
    warp's :class:`Flags`, kept apart from ``args`` (a tuple of values, which Gluon would make runtime values)."""
    TILES_FASTEST: gl.constexpr = tiles_fastest(flags.MASK.has_left, flags.MASK.has_right)
    if PERSISTENT:
        c = 0
        t = 0
        for r in range(_rounds(items)):
            item = _work_item(r, items, TILES_FASTEST, True)
            if item.valid:
                c += item_fn(item, c, t, args, flags)
                t += 1
    else:
        item = _work_item(0, items, TILES_FASTEST, False)
        if item.valid:
            item_fn(item, 0, 0, args, flags)


@gluon.jit
def _load_warp(q_desc, k_desc, v_desc, q_tail_desc, k_tail_desc, shared, items, group, pattern_bounds,
               MASK: gl.constexpr, PERSISTENT: gl.constexpr):
    """One warp: every work item of the program (:func:`_produce_item`). pattern_bounds: ``(left, right,
    sink_tokens)``; q_tail_desc, k_tail_desc: the second parts of Q and K tiles, or None."""
    _each_item(_produce_item, (q_desc, k_desc, v_desc, q_tail_desc, k_tail_desc, shared, group, pattern_bounds),
               Flags(MASK=MASK), items, PERSISTENT)


@gluon.jit
def _issue_scores(q, shared, i, s_zero):
    """Start step i's ``Q K^T`` (64, BLOCK_N) once its K has landed; returns the product in flight. ``q``: the
    consumer's Q part, a pair (head, tail) of tiles when the head dim is held in two (:func:`_q_tiles`): two
    products into one score tile."""
    mbarrier.wait(shared.k_ready.index(i % STAGES), (i // STAGES) & 1)
    k = shared.k.index(i % STAGES).reshape([shared.k.shape[3], shared.k.shape[4]])  # (BLOCK_N, D or head)
    if shared.q_tail is None:
        s = warpgroup_mma(q, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    else:
        k_tail = shared.k_tail.index(i % STAGES).reshape([shared.k_tail.shape[3], shared.k_tail.shape[4]])
        s = warpgroup_mma(q[0], k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(q[1], k_tail.permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _q_tiles(shared, index):
    """Q part ``index`` of ``shared.q`` as the (64, D) tile Q K^T reads, or (head dim held in two) the pair of
    its (64, head) and (64, tail) tiles."""
    q = shared.q.index(index).reshape([ROWS, shared.q.shape[4]])
    if shared.q_tail is not None:
        q = (q, shared.q_tail.index(index).reshape([ROWS, shared.q_tail.shape[4]]))
    return q


@gluon.jit
def _issue_values(p, acc, shared, i):
    """Start ``acc += P V`` of step i once its V has landed; returns the accumulator in flight."""
    mbarrier.wait(shared.v_ready.index(i % STAGES), (i // STAGES) & 1)
    v = shared.v.index(i % STAGES).reshape([shared.v.shape[3], shared.v.shape[4]])  # (BLOCK_N, D)
    return warpgroup_mma(p, v, acc, is_async=True)


@gluon.jit
def _carry(p, shared):
    """Step i's weights P (64, BLOCK_N) float32 in the form they wait in for step i+1's ``P V``: rounded to V's
    dtype (16 bits) as (64, BLOCK_N // 2) int32, each two neighbouring columns in one word, the very registers
    ``P V`` reads. Made inside the softmax, they let the next step issue ``P V`` right after its scores, and take
    half of float32's registers while they wait, which lets three consumers fit at D = 64. (A 16-bit tensor
    across the loop cost two byte permutes a pair each step.) FP8 scores keep P in float32, rounded at the issue:
    their shorter ``Q K^T`` leaves the softmax setting the pace, and rounding there costs more than the
    registers save."""
    if shared.q.dtype.primitive_bitwidth > 8:
        lo, hi = p.reshape([p.shape[0], p.shape[1] // 2, 2]).split()  # (64, BLOCK_N // 2): even, odd columns
        CVT: gl.constexpr = "cvt.rn.f16x2.f32" if shared.v.dtype == gl.float16 else "cvt.rn.bf16x2.f32"
        p = gl.inline_asm_elementwise(CVT + " $0, $2, $1;", "=r,f,f", [lo, hi], dtype=gl.int32, is_pure=True,
                                      pack=1)
    return p


@gluon.jit
def _step_run(q, shared, seq_rule, blocks, c, lo, hi, acc, m_i, l_i, p, rows, s_zero, qk_scale, MASKED: gl.constexpr,
              MAY_BE_EMPTY: gl.constexpr):
    """Steps ``[lo, hi)`` of a work item's walk by step (``blocks``, under ``seq_rule``) whose step 0 is the
    program's step ``c`` (the rings' index), each ``i`` entered with step i-1's
    weights ``p`` (as :func:`_carry` left them, not yet multiplied): issue ``Q K_i^T``, then ``P_{i-1} V_{i-1}``;
    wait for the scores alone (one group may stay in flight), free K_i, run the softmax while the product
    runs, wait for it, free V_{i-1}, rescale the accumulator."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_zero.type.layout)
    acc_rows: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    BLOCK_N: gl.constexpr = shared.k.shape[3]
    for i in range(lo, hi):
        s = _issue_scores(q, shared, c + i, s_zero)
        acc = _issue_values(operand(p, acc, shared.v.dtype), acc, shared, c + i - 1)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
        mbarrier.arrive(shared.k_empty.index((c + i) % STAGES), count=1)
        cols = block_at(blocks, i) * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, rows, cols, qk_scale, seq_rule, MASKED, MAY_BE_EMPTY)
        p = _carry(p, shared)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(shared.v_empty.index((c + i - 1) % STAGES), count=1)
        acc = acc * gl.convert_layout(alpha, acc_rows)[:, None]
    return acc, m_i, l_i, p


@gluon.jit
def _free_last_output(t, shared):
    """Item t-1's output has left its Q slot (the TMA store read it): the producer may refill the slot."""
    if t > 0:
        tma.store_wait(0)
        mbarrier.arrive(shared.q_empty.index((t - 1) % shared.q_empty.shape[0]), count=1)


@gluon.jit
def _consume_item(item, c, t, args, flags):
    """One warpgroup's share of work item t (a :class:`WorkItem`), its step 0 the program's
    step ``c``: rows ``row0 + part * 64 ...`` of the tile, from Q in slot ``t % slots`` to the output and the
    natural-log LSE; returns the item's step count. Dense (Out None): the output leaves through the
    warpgroup's part of the Q slot (FP8: a slot of its own) and a TMA store, which clips rows past Nq and is
    waited for one item later. Packed: masked stores to Out, since the rows past this sequence's end are the
    next sequence's. args, flags: as :func:`_consumer_warpgroup` passes them (the descales and stride_ds as
    :func:`_forward_sm90` takes them; q's and k's descales join qk_scale here)."""
    (o_desc, Out, Lse, Sinks, QDescale, KDescale, VDescale, shared, group, pattern_bounds, qk_scale, stride_ds,
     stride_o, stride_lse) = args
    left, right, sink_tokens = pattern_bounds
    VALUE_DIM: gl.constexpr = shared.v.shape[4]
    part: gl.constexpr = flags.part
    batch, b, h, row0, q_start, Nq, Nk = item.batch, item.b, item.h, item.row0, item.q_start, item.Nq, item.Nk
    BLOCK_N: gl.constexpr = shared.k.shape[3]
    K_STEP: gl.constexpr = 256 // shared.q.dtype.primitive_bitwidth  # what one wgmma reduces: 32 bytes
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, K_STEP])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, VALUE_DIM, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    MAY_BE_EMPTY: gl.constexpr = Sinks is None

    qk_scale, _ = load_descales(QDescale, KDescale, None, b, h // group, stride_ds, qk_scale)  # FP8: into the scale
    Q_SLOTS: gl.constexpr = shared.q_ready.shape[0]
    PARTS: gl.constexpr = shared.q.shape[0] // Q_SLOTS
    seq_rule = rule(Nq, Nk, left, right, sink_tokens, 0, None, flags.MASK)
    blocks = kv_blocks(seq_rule, row0, PARTS * ROWS, BLOCK_N)
    lead_end, full_end, n = steps(blocks)
    q = _q_tiles(shared, PARTS * (t % Q_SLOTS) + part)
    rows = row0 + part * ROWS + gl.arange(0, ROWS, layout=row_layout)  # (64,) query positions
    if Sinks is not None:  # exp2(m) * l = exp(sink): the sink starts the sum, with no value to carry
        m_i = sink_max(Sinks, h + rows * 0)
        l_i = gl.full([ROWS], 1.0, gl.float32, layout=row_layout)
    else:
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=row_layout)
        l_i = gl.full([ROWS], 0.0, gl.float32, layout=row_layout)
    acc = gl.zeros([ROWS, VALUE_DIM], gl.float32, layout=o_layout)  # (64, Dv)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)  # (64, BLOCK_N)
    mbarrier.wait(shared.q_ready.index(t % Q_SLOTS), (t // Q_SLOTS) & 1)
    if n > 0:
        # step 0 alone (masked): every later step issues its scores ahead of the last step's P V
        s = _issue_scores(q, shared, c, s_zero)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        mbarrier.arrive(shared.k_empty.index(c % STAGES), count=1)
        _free_last_output(t, shared)  # here, under nothing in flight, and long after that store began
        cols = first_block(blocks) * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, rows, cols, qk_scale, seq_rule, True, MAY_BE_EMPTY)
        p = _carry(p, shared)
        # the sink-token blocks and the band's leading edge, its interior, its trailing edge
        bounds = (1, lead_end, full_end, n)
        for segment in gl.static_range(3):
            acc, m_i, l_i, p = _step_run(q, shared, seq_rule, blocks, c, gl.maximum(bounds[segment], 1),
                                         bounds[segment + 1], acc, m_i, l_i, p, rows, s_zero, qk_scale, segment != 1,
                                         MAY_BE_EMPTY)
        acc = _issue_values(operand(p, acc, shared.v.dtype), acc, shared, c + n - 1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(shared.v_empty.index((c + n - 1) % STAGES), count=1)
    else:
        _free_last_output(t, shared)
    acc_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    out, lse = finish_state(acc, gl.convert_layout(m_i, acc_rows), gl.convert_layout(l_i, acc_rows))
    if VDescale is not None:  # FP8: v's descale, read here rather than held in a register through the loop
        _, v_descale = load_descales(None, None, VDescale, b, h // group, stride_ds, qk_scale)
        out = out * v_descale
    rows = gl.convert_layout(rows, acc_rows)
    gl.store(Lse + batch * stride_lse[0] + h * stride_lse[1] + q_start + rows, lse, mask=rows < Nq)
    if Out is None:
        O_SLOTS: gl.constexpr = shared.o.shape[0] // PARTS  # output parts: Q's ring, or FP8's one set
        o_slot = shared.o.index(PARTS * (t % O_SLOTS) + part)
        o_slot.reshape([ROWS, VALUE_DIM]).store(out.to(o_desc.dtype))
        fence_async_shared()
        tma_store(o_desc, [batch, h, q_start + row0 + part * ROWS, 0], o_slot)
    else:
        cols = gl.arange(0, VALUE_DIM, layout=gl.SliceLayout(0, o_layout))  # (Dv,)
        offsets = h * stride_o[0] + (q_start + rows).to(gl.int64) * stride_o[1]  # (64,)
        gl.store(Out + offsets[:, None] + cols[None, :], out.to(Out.dtype.element_ty), mask=(rows < Nq)[:, None])
    return n


@gluon.jit
def _consumer_warpgroup(args, items, flags, part: gl.constexpr, PERSISTENT: gl.constexpr):
    """One warpgroup (``part``: which 64 rows of each tile it owns): every work item of the program
    (:func:`_consume_item`, which takes ``args``; flags: a :class:`Flags` without its ``part``)."""
    _each_item(_consume_item, args, Flags(MASK=flags.MASK, part=part), items, PERSISTENT)
    tma.store_wait(0)  # the last output read out of shared memory before the program ends


# lengths and window bounds change from call to call and only enter loop bounds and masks (as in the
# portable kernel): no recompilation for new lengths
@gluon.jit(do_not_specialize=["Nq", "Nk", "Hq", "n_tiles", "seqs", "left", "right", "sink_tokens"])
def _forward_sm90(q_desc, k_desc, v_desc, q_tail_desc, k_tail_desc, o_desc, Out, Lse, Sinks, QDescale, KDescale,
                  VDescale, CuQ, CuK, Nq, Nk, Hq, group, n_tiles, seqs, left, right, sink_tokens, qk_scale, stride_ds,
                  stride_o, stride_lse, MASK: gl.constexpr, PERSISTENT: gl.constexpr, CONSUMERS: gl.constexpr,
                  REGS: gl.constexpr):
    """Grid ``(P,)``, each program walking the work items ``(tile, head, sequence)`` of :func:`_work_item`
    (``n_tiles`` tiles of 64 query rows per consumer, ``Hq`` heads, ``seqs`` sequences): PERSISTENT, one program
    per SM; else one per item (P = their count). CONSUMERS: the consumer warpgroups, REGS the registers of each
    of their threads.

    Dense (CuQ, CuK, Out None): q_desc, o_desc: descriptors over (B, Hq, Nq, D or Dv) moving (1, 1, 64, D or Dv)
    tiles; k_desc, v_desc: over (B, Hkv, Nk, D or Dv) moving (1, 1, BLOCK_N, D or Dv) (BLOCK_N: :data:`TILES`);
    a head dim held in two parts (:func:`head_parts`): q_desc and k_desc move the first part's lanes, q_tail_desc and
    k_tail_desc the rest (else None); Lse: (B, Hq, Nq) float32, unit row stride;
    n_tiles = cdiv(Nq, 64 * CONSUMERS). Packed (CuQ, CuK: (B + 1,) int32): sequence s has rows
    ``CuQ[s] .. CuQ[s + 1]`` of the (1, Hq, total_q, D) view under q_desc and keys ``CuK[s] .. CuK[s + 1]``
    of k_desc's and v_desc's (1, Hkv, total_k, D) views; Out: that (1, Hq, total_q, D) view (o_desc
    unused), ``stride_o`` its (head, row) strides; Lse: (1, Hq, total_q); n_tiles covers the longest
    sequence (a shorter one's extra tiles are skipped); Nq, Nk unused. ``stride_lse``: Lse's (batch, head)
    strides. Sinks: None or (Hq,) float32; Hkv = Hq // group; qk_scale = scale * log2(e) > 0; ``left``,
    ``right``, ``sink_tokens`` and MASK: the pattern (:mod:`gstar.kernels.common.rule`).

    FP8 (q_desc, k_desc over float8_e4m3fn; v_desc over V widened to bfloat16, exactly): QDescale, KDescale,
    VDescale and ``stride_ds`` the descales as :func:`load_descales` takes them; q's and
    k's join qk_scale, v's multiplies the output. Else the three are None.
    """
    # Q slots (a 64-row part per consumer): a persistent program's next item lands while this one's last steps run
    Q_SLOTS: gl.constexpr = 2 if PERSISTENT else 1
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS * Q_SLOTS] + q_desc.block_type.shape, q_desc.layout)
    o_smem = q_smem  # the output leaves through Q's (first part's) slots, or (FP8 queries) slots of its own
    if q_desc.dtype != o_desc.dtype or q_desc.block_type.shape[3] != o_desc.block_type.shape[3]:
        o_smem = gl.allocate_shared_memory(o_desc.dtype, [CONSUMERS] + o_desc.block_type.shape, o_desc.layout)
    q_tail_smem = None
    k_tail_smem = None
    if q_tail_desc is not None:
        q_tail_smem = gl.allocate_shared_memory(q_tail_desc.dtype, [CONSUMERS * Q_SLOTS] + q_tail_desc.block_type.shape,
                                                q_tail_desc.layout)
        k_tail_smem = gl.allocate_shared_memory(k_tail_desc.dtype, [STAGES] + k_tail_desc.block_type.shape,
                                                k_tail_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready, q_empty = ring_barriers(Q_SLOTS, CONSUMERS)
    k_ready, k_empty = ring_barriers(STAGES, CONSUMERS)
    v_ready, v_empty = ring_barriers(STAGES, CONSUMERS)

    shared = ForwardSmem(q=q_smem, k=k_smem, v=v_smem, o=o_smem, q_tail=q_tail_smem, k_tail=k_tail_smem,
                         q_ready=q_ready, q_empty=q_empty, k_ready=k_ready, k_empty=k_empty, v_ready=v_ready,
                         v_empty=v_empty)
    items = Items(CuQ=CuQ, CuK=CuK, Nq=Nq, Nk=Nk, Hq=Hq, n_tiles=n_tiles, seqs=seqs, BLOCK_M=CONSUMERS * ROWS)
    pattern_bounds = (left, right, sink_tokens)
    args = (o_desc, Out, Lse, Sinks, QDescale, KDescale, VDescale, shared, group, pattern_bounds, qk_scale, stride_ds,
            stride_o, stride_lse)
    flags = Flags(MASK=MASK)
    # the default partition (this program's 4 warps) and one or two more of 4 warps consume; a 1-warp partition
    # produces, with 24 registers a thread; REGS for each consumer (:func:`_registers`)
    if CONSUMERS == 3:
        gl.warp_specialize([(_consumer_warpgroup, (args, items, flags, 0, PERSISTENT)),
                            (_consumer_warpgroup, (args, items, flags, 1, PERSISTENT)),
                            (_consumer_warpgroup, (args, items, flags, 2, PERSISTENT)),
                            (_load_warp, (q_desc, k_desc, v_desc, q_tail_desc, k_tail_desc, shared, items, group,
                                          pattern_bounds, MASK, PERSISTENT))], [4, 4, 1], [REGS, REGS, 24])
    else:
        gl.warp_specialize([(_consumer_warpgroup, (args, items, flags, 0, PERSISTENT)),
                            (_consumer_warpgroup, (args, items, flags, 1, PERSISTENT)),
                            (_load_warp, (q_desc, k_desc, v_desc, q_tail_desc, k_tail_desc, shared, items, group,
                                          pattern_bounds, MASK, PERSISTENT))], [4, 1], [REGS, 24])


def shared_bytes(head_dim: int, value_dim: int, q_slots: int) -> int:
    """A 16-bit program's shared memory at these head dims with ``q_slots`` Q slots: Q's parts, the K and V
    rings (the output leaves through Q's slots; the barriers' few bytes aside)."""
    tiles = TILES[head_dim, value_dim]
    q = tiles.consumers * q_slots * ROWS.value * head_dim
    return 2 * (q + STAGES.value * tiles.block_n * (head_dim + value_dim))


def walks(dtype: torch.dtype, pattern: Pattern, packed: bool, head_dim: int, value_dim: int) -> bool:
    """Whether a call's programs walk their items persistently: dense 16-bit full attention, whose items are
    equal, where a second Q slot fits in shared memory (FP8's walk, its output in a slot of its own, is slower
    than its per-item grid)."""
    return (tiles_fastest(pattern.left >= 0, pattern.right >= 0) and not packed and dtype != FP8
            and shared_bytes(head_dim, value_dim, 2) <= SHARED_BYTES)


def forward(q, k, v, sinks, out, lse, pattern: Pattern, scale: float, cu_seqlens=None, descale=None) -> None:
    """Fill ``out`` and ``lse`` for a call :mod:`gstar.kernels.dispatch` gives this kernel. Dense: q, out: (B, Hq,
    Nq, D), k, v: (B, Hkv, Nk, D), lse: (B, Hq, Nq) float32. Packed (``cu_seqlens = (cu_q, cu_k)``, (B + 1,)
    int32): the heads-first views q, out: (1, Hq, total_q, D), k, v: (1, Hkv, total_k, D), lse: (1, Hq, total_q),
    and ``pattern`` carries the longest lengths. sinks: None or (Hq,) float32; scale > 0. FP8 (q, k
    float8_e4m3fn, v widened to bfloat16): ``descale`` the descales of q, k and v, ``out`` 16 or 32 bits."""
    B, Hq, _, D = q.shape
    Dv = v.shape[3]
    cu_q, cu_k = cu_seqlens or (None, None)
    seqs = B if cu_q is None else cu_q.shape[0] - 1
    consumers, block_n = TILES[D, Dv]
    head, tail = head_parts(D)
    tiles = cdiv(pattern.nq, block_m(D, Dv))
    items = tiles * Hq * seqs
    # dense full attention: one program per SM (one fits: registers) walking items of equal work, each item's
    # Q and first blocks landing under the last one's steps; causal or packed: a program per item
    persistent = walks(q.dtype, pattern, cu_q is not None, D, Dv)
    if persistent:
        grid = (min(items, card.sm_count(str(q.device))), )
    else:
        grid = (tiles, Hq, seqs) if tiles_fastest(pattern.left >= 0, pattern.right >= 0) else (Hq, tiles, seqs)
    regs, launch_regs = _registers(consumers)
    window = bounds(pattern)
    _forward_sm90[grid](
        q_desc=descriptor(q, ROWS.value, head), k_desc=descriptor(k, block_n, head), v_desc=descriptor(v, block_n),
        q_tail_desc=descriptor(q, ROWS.value, tail) if tail else None,
        k_tail_desc=descriptor(k, block_n, tail) if tail else None, o_desc=descriptor(out, ROWS.value), Out=None if cu_q is None else out, Lse=lse, Sinks=sinks,
        **descale_args(descale), CuQ=cu_q, CuK=cu_k, Nq=q.shape[2], Nk=k.shape[2], Hq=Hq, group=Hq // k.shape[1],
        n_tiles=tiles, seqs=seqs, left=max(window["left"], 0), right=max(window["right"], 0),
        sink_tokens=window["sink_tokens"], qk_scale=scale * LOG2E.value, stride_o=(out.stride(1), out.stride(2)),
        stride_lse=(lse.stride(0), lse.stride(1)), MASK=mask(pattern), PERSISTENT=persistent,
        CONSUMERS=consumers, REGS=regs, num_warps=4, maxnreg=launch_regs)
