"""The Hopper (sm_90) decode kernel for FP8 caches, in Gluon: one warp a program, keys and values loaded
from global memory straight into the registers the tensor cores read, no shared memory.

Triton's decode kernel (:mod:`gstar.kernels.decode`) stages every K and V tile in shared memory, widens V
there to float16 and passes P between its four warps through it: against an FP8 cache its shared-memory pipe
is the busiest unit, not DRAM (benchmarks/NOTES.md, 'FP8 decode: where the time goes'). Here each program is
one warp holding the softmax state of its stacked rows (``BLOCK_R = 16``: a GQA group's heads times the
queries), and each ``mma.sync`` operand is loaded in the layout the instruction reads:

- ``Q K^T`` sums over the head dim, so any order of its components serves, the same for Q and K. Component
  ``d'`` of the product is stored component ``d`` of the row (:func:`_head_dim_order`), which gives each thread
  a quarter of each key's row as one vector load (16 bytes at D = 64).
- ``P V``'s output columns may come out in any order the store undoes: column ``n`` of the product is stored
  column ``(n % 8) * Dv / 8 + n // 8`` of the row (:func:`_value_order`), which gives each thread an eighth of
  each key's values as one vector load.
- P leaves the scores' accumulator in the layout ``P V`` reads (the FlashAttention-2 identity of ``mma.sync``'s
  fragments): no data moves.

Keys and values travel as 32-bit words (four FP8 values each) and widen to float16 in registers, two buffers of 32
keys a program, each loaded again right after its fold; the splits fill one wave of programs, twelve an SM, or whole
waves of shorter splits in large batches (:func:`splits`). The walk over visible blocks, the rule and the softmax
are the Triton kernels' own (:func:`gstar.kernels.ranges.kv_range`, :func:`gstar.kernels.forward.softmax_step`);
:func:`gstar.kernels.decode._combine` merges the split partials. A paged cache's tiles find their rows through the
block table (:func:`_row`), a tile within one page; its long walks fetch whole L2 lines (:func:`lines`).
:func:`serves` says which calls it can take; the plan (:func:`gstar.kernels.decode._decode_plan`) gives it those
whose queries see ``MIN_KEYS`` keys or more, where it measured faster.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import constexpr_function
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.language.extra.cuda import gdc_launch_dependents

from ..fp8 import FP8
from ..pattern import cdiv
from .forward import finish_state, load_descales, softmax_step
from .hopper import LOG2E, _on_hopper
from .ranges import ALL_ROWS, decode_program, decode_rows, kv_range
from .widen import half_queries

BLOCK_R = gl.constexpr(16)  # stacked rows a program holds: mma.sync's M
BLOCK_N = gl.constexpr(32)  # keys a tile
HEAD_DIMS = (64,)  # D = Dv served (at 128 the kernel spills)
# keys a full cache shows the queries, from which this kernel beat Triton's on an H200: 0.86-0.95x its time from
# 16,384 keys, 0.99-1.11x at 4,096 and 8,192, where the split partials' merge outweighs the walk
# (benchmarks/NOTES.md, 'FP8 decode: a register kernel in Gluon')
MIN_KEYS = 16384
REGISTERS = 168  # a thread's, the compiler's own count at D 64: twelve one-warp programs an SM (65,536 each)
MAX_SPLITS = 256
# keys of a full cache a split walks at most (:func:`splits`; Triton's kernel has its own, decode.SPLIT_KEYS, without
# the whole waves): a ragged batch of 64 sequences of up to 32,768 keys
# ran 0.86x its one-wave time in nine splits, its uniform twin 1.02x (benchmarks/NOTES.md, 'Decoding: ragged
# batches and paged rows')
SPLIT_KEYS = 4096
# keys of a full cache a split walks, from which a paged cache's whole tiles fetch whole L2 lines (:func:`lines`):
# 0.78-0.96x the time at 1,365 to 3,641 keys a split, 1.09x at 334 (benchmarks/NOTES.md, 'Decoding: ragged batches
# and paged rows')
LINE_KEYS = 1024


@constexpr_function
def _mma_layout():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])


@constexpr_function
def _rows_layout(width):
    """A (rows, width) tile whose rows (keys or queries) ``mma.sync`` reads as ``Q K^T``'s operands after
    :func:`_head_dim_order`: each thread a contiguous quarter of a row, eight rows a warp. A tile of FP8 words
    (``width`` / 4 of them, :func:`_widen`) takes it at width / 4."""
    return gl.BlockedLayout([1, width // 4], [8, 4], [1, 1], [1, 0])


@constexpr_function
def _values_layout(block_n, words):
    """A (block_n, words) tile of FP8 value words, four values each, as ``P V``'s operand reads them after
    :func:`_widen` and :func:`_value_order`: each thread an eighth of each row of its keys (lane bits: key bits
    1-2, then the word's bits that pick the fragment's column; register bits: the rest of the eighth, key bit 0
    and key bits 3 up)."""
    eighth = words // 8
    regs = [[0, 1 << i] for i in range(eighth.bit_length() - 1)] + [[1, 0]]
    regs += [[1 << i, 0] for i in range(3, block_n.bit_length() - 1)]
    lanes = [[2, 0], [4, 0]] + [[0, eighth << i] for i in range(3)]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[], block_bases=[],
                                      shape=[block_n, words])


@gluon.jit
def _widen(words):
    """FP8 words (R, W) int32, four e4m3 values each (little-endian), as float16 (R, 4 W), exactly, two pair
    conversions a word. The tiles travel as 32-bit words: a loop-carried tile of bytes would be split into a
    register a byte and packed again for each conversion."""
    a, b, c, d = gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 x, lo; "
        "cvt.rn.f16x2.e4m3x2 y, hi; mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
        "=h,=h,=h,=h,r", [words], dtype=(gl.float16, gl.float16, gl.float16, gl.float16), is_pure=True, pack=1)
    R: gl.constexpr = words.shape[0]
    W: gl.constexpr = words.shape[1]
    return gl.join(gl.join(a, c), gl.join(b, d)).reshape([R, 4 * W])  # value 4 w + 2 j + i at [w, j, i]


@gluon.jit
def _head_dim_order(x):
    """x (R, D) as stored, relabelled so that component ``d'`` of the product is stored component
    ``(d' // 2 % 4) * D / 4 + (d' // 16) * 4 + (d' // 8 % 2) * 2 + d' % 2``: in :func:`_rows_layout` this is
    mma.sync's operand layout, no data moved."""
    R: gl.constexpr = x.shape[0]
    D: gl.constexpr = x.shape[1]
    x = x.reshape([R, 4, D // 16, 2, 2]).permute([0, 2, 3, 1, 4])  # (row, c, kk, f1, f0) -> (kk, f1, c, f0)
    return x.reshape([R, D])


@gluon.jit
def _value_order(v):
    """v (BLOCK_N, Dv) as stored, relabelled so that column ``n`` is stored column ``(n % 8) * Dv / 8 + n // 8``."""
    N: gl.constexpr = v.shape[0]
    DV: gl.constexpr = v.shape[1]
    return v.reshape([N, 8, DV // 8]).permute([0, 2, 1]).reshape([N, DV])


@gluon.jit
def _whole_tile(ptrs, VEC: gl.constexpr, LINES: gl.constexpr):
    """The int32 words at ``ptrs``, a thread's ``VEC`` consecutive ones (4 or 2) in one vector load. LINES: its L2
    misses fetch the whole 128-byte line (``L2::128B``). A paged cache's row holds every kv head's key side by side,
    64 bytes each at D = 64, and the line's other half is the next head's, whose program reads it at about the
    same time: long walks gain, short ones lose (:func:`lines`)."""
    gl.static_assert((VEC == 4) | (VEC == 2), "a thread loads 4 or 2 consecutive words of a row")
    if not LINES:
        words = gl.load(ptrs)
    elif VEC == 4:
        words = gl.inline_asm_elementwise("ld.global.L2::128B.v4.b32 {$0, $1, $2, $3}, [$4];",
                                          "=r,=r,=r,=r,l,l,l,l", [ptrs], dtype=gl.int32, is_pure=False, pack=4)
    else:
        words = gl.inline_asm_elementwise("ld.global.L2::128B.v2.b32 {$0, $1}, [$2];", "=r,=r,l,l", [ptrs],
                                          dtype=gl.int32, is_pure=False, pack=2)
    return words


@gluon.jit
def _tile(First, offs, start_n, offs_n, pred, nk, MASKED: gl.constexpr, ZEROS: gl.constexpr, VEC: gl.constexpr,
          LINES: gl.constexpr):
    """The FP8 words of keys ``start_n + offs_n``: ``First`` key ``start_n``'s first word (int32), ``offs`` the
    words' offsets within the tile (keys ``offs_n``; a thread's ``VEC`` consecutive words of a row). MASKED tiles
    load where ``pred`` holds and below ``nk``; ZEROS fills the rest with zeros (values: a masked key's weight is 0,
    and 0 times a stale register could be NaN), else leaves it undefined (keys: the mask hides their scores). Whole
    tiles load without a mask (:func:`_whole_tile`)."""
    ptrs = First + offs
    if not MASKED:
        return _whole_tile(ptrs, VEC, LINES)
    ok = (pred & (start_n + offs_n < nk))[:, None]
    if ZEROS:
        return gl.load(ptrs, mask=ok, other=0)
    return gl.load(ptrs, mask=ok)


@gluon.jit
def _first_key(blocks, j, i_hi, MASKED: gl.constexpr):
    """Visible block ``j``'s first key; whole tiles take ``j`` clamped to the last one, ``i_hi - 1`` (a load
    past it reads the last tile again)."""
    if not MASKED:
        j = gl.minimum(j, i_hi - 1)
    sink_end, band_start = blocks[2], blocks[3]
    return gl.where(j < sink_end, j, band_start + j - sink_end) * BLOCK_N


@gluon.jit
def _row(blocks, j, i_hi, MASKED: gl.constexpr, PAGE: gl.constexpr):
    """The cache row of visible block ``j``'s first key: a paged cache's through the block table (the tile lies
    in one page; masked tiles past ``i_hi`` look nothing up), else the key's index."""
    start = _first_key(blocks, j, i_hi, MASKED)
    if PAGE:
        return gl.load(blocks[4] + start // PAGE, mask=j < i_hi, other=0).to(gl.int64) * PAGE + start % PAGE
    return start.to(gl.int64)


@gluon.jit
def _tiles(blocks, j, row, i_hi, offs, nk, MASKED: gl.constexpr, KEY_WORDS: gl.constexpr, LINES: gl.constexpr):
    """Visible block ``j``'s first key and its K and V words (:func:`_tile`) from cache row ``row``
    (:func:`_row`); masked tiles load nothing past ``i_hi``. ``blocks`` as :func:`_attend` takes it; ``offs``:
    (K's in-tile offsets, their keys, V's, theirs); KEY_WORDS, LINES as :func:`_decode` takes them."""
    k_offs, offs_kn, v_offs, offs_vn = offs
    start = _first_key(blocks, j, i_hi, MASKED)
    K_VEC: gl.constexpr = k_offs.shape[1] // 4  # a quarter of a key's words a thread (_rows_layout)
    V_VEC: gl.constexpr = v_offs.shape[1] // 8  # an eighth of a value row's (_values_layout)
    return (start, _tile(blocks[0] + row * KEY_WORDS, k_offs, start, offs_kn, j < i_hi, nk, MASKED, False, K_VEC,
                         LINES),
            _tile(blocks[1] + row * KEY_WORDS, v_offs, start, offs_vn, j < i_hi, nk, MASKED, MASKED, V_VEC,
                         LINES))


@gluon.jit
def _fold(acc, m_i, l_i, q, k, v, cols, rows, rule, qk_scale, HAS_LEFT: gl.constexpr, HAS_RIGHT: gl.constexpr,
          HAS_SINK_TOKENS: gl.constexpr, MASKED: gl.constexpr):
    """One tile's update of the rows' state: k, v its FP8 words (:func:`_tile`), cols its keys' indices."""
    nq, nk, left, right, sink_tokens = rule
    mma: gl.constexpr = _mma_layout()
    kt = _head_dim_order(_widen(k)).permute([1, 0])  # (D, BLOCK_N)
    kt = gl.convert_layout(kt, gl.DotOperandLayout(1, mma, 2), assert_trivial=True)
    s = mma_v2(q, kt, gl.zeros([BLOCK_R, BLOCK_N], gl.float32, mma))  # (BLOCK_R, BLOCK_N) raw scores
    p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, rows, cols, qk_scale, nq, nk, left, right, sink_tokens,
                                      HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, MASKED, True)
    p = gl.convert_layout(p.to(gl.float16), gl.DotOperandLayout(0, mma, 2), assert_trivial=True)
    v = gl.convert_layout(_value_order(_widen(v)), gl.DotOperandLayout(1, mma, 2))
    return mma_v2(p, v, acc * alpha[:, None]), m_i, l_i


@gluon.jit
def _attend(acc, m_i, l_i, q, rows, i_lo, i_hi, blocks, rule, qk_scale, HAS_LEFT: gl.constexpr,
            HAS_RIGHT: gl.constexpr, HAS_SINK_TOKENS: gl.constexpr, MASKED: gl.constexpr, KEY_WORDS: gl.constexpr,
            PAGE: gl.constexpr, LINES: gl.constexpr):
    """Fold visible blocks ``i_lo .. i_hi`` into the rows' state, as :func:`gstar.kernels.decode._attend`, two
    tiles in flight: buffers a and b take the even and odd tiles, each loaded again (two tiles on) right after
    its fold, so that no register is copied while its load is in flight (a copy would wait for it). Whole tiles
    load without a mask: a load past the last tile reads the last one again. ``blocks``: (K, V, sink_end,
    band_start), K and V as int32 words, this sequence's and head's first key (a contiguous cache) or this
    head's in the first page (paged, then the sequence's block table follows); ``rule``: (nq, nk, left, right,
    sink_tokens); KEY_WORDS, PAGE, LINES: as :func:`_decode` takes them."""
    nk = rule[1]
    D: gl.constexpr = q.shape[1]
    DV: gl.constexpr = acc.shape[1]
    mma: gl.constexpr = _mma_layout()
    k_layout: gl.constexpr = _rows_layout(D // 4)
    v_layout: gl.constexpr = _values_layout(BLOCK_N, DV // 4)
    offs_kn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, k_layout))
    offs_vn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_layout))
    k_offs = offs_kn[:, None] * KEY_WORDS + gl.arange(0, D // 4, layout=gl.SliceLayout(0, k_layout))[None, :]
    v_offs = offs_vn[:, None] * KEY_WORDS + gl.arange(0, DV // 4, layout=gl.SliceLayout(0, v_layout))[None, :]
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma))
    offs = (k_offs, offs_kn, v_offs, offs_vn)
    start_a, k_a, v_a = _tiles(blocks, i_lo, _row(blocks, i_lo, i_hi, MASKED, PAGE), i_hi, offs, nk, MASKED,
                               KEY_WORDS, LINES)  # (BLOCK_N, D / 4), (BLOCK_N, DV / 4) words
    start_b, k_b, v_b = _tiles(blocks, i_lo + 1, _row(blocks, i_lo + 1, i_hi, MASKED, PAGE), i_hi, offs, nk, MASKED,
                               KEY_WORDS, LINES)
    for i in range(i_lo, i_hi, 2):
        acc, m_i, l_i = _fold(acc, m_i, l_i, q, k_a, v_a, start_a + offs_n, rows, rule, qk_scale, HAS_LEFT,
                              HAS_RIGHT, HAS_SINK_TOKENS, MASKED)
        start_a, k_a, v_a = _tiles(blocks, i + 2, _row(blocks, i + 2, i_hi, MASKED, PAGE), i_hi, offs, nk, MASKED,
                                   KEY_WORDS, LINES)
        if i + 1 < i_hi:
            acc, m_i, l_i = _fold(acc, m_i, l_i, q, k_b, v_b, start_b + offs_n, rows, rule, qk_scale, HAS_LEFT,
                                  HAS_RIGHT, HAS_SINK_TOKENS, MASKED)
        start_b, k_b, v_b = _tiles(blocks, i + 3, _row(blocks, i + 3, i_hi, MASKED, PAGE), i_hi, offs, nk, MASKED,
                                   KEY_WORDS, LINES)
    return acc, m_i, l_i


# lengths, bounds and row counts change between calls: specialising on them would recompile a decode loop
@gluon.jit(do_not_specialize=["nq", "group", "added", "left", "right", "sink_tokens"])
def _decode(Q, K, V, BlockTable, Seqlens, Sinks, Out, Lse, QDescale, KDescale, VDescale,
            stride_q, stride_k, stride_v, stride_bt, stride_o, stride_lse,
            nq, group, added, left, right, sink_tokens, qk_scale, stride_ds,
            HEAD_DIM: gl.constexpr, VALUE_DIM: gl.constexpr, SPLIT: gl.constexpr, HAS_LEFT: gl.constexpr,
            HAS_RIGHT: gl.constexpr, HAS_SINK_TOKENS: gl.constexpr, KEY_WORDS: gl.constexpr, PAGE: gl.constexpr,
            LINES: gl.constexpr):
    """Grid ``(splits, Hkv * row_tiles, B)`` as Triton's (the plan gives one row tile: ``group * nq <= BLOCK_R``),
    one warp a program; arguments as :func:`gstar.kernels.decode._decode`'s for an FP8 cache, contiguous (PAGE 0,
    no block table) or paged in pages of PAGE keys (a multiple of ``BLOCK_N``), whose key rows lie KEY_WORDS
    32-bit words apart (D / 4 contiguous, Hkv D / 4 paged), K's and V's alike; tiles of ``BLOCK_N`` keys. LINES:
    whole tiles fetch whole L2 lines (:func:`lines`). After its walk each program lets the combine launch
    (:func:`gstar.kernels.decode._combine`, a programmatic dependent launch)."""
    mma: gl.constexpr = _mma_layout()
    q_layout: gl.constexpr = _rows_layout(HEAD_DIM)
    split, splits, hkv, tile, b, nk = decode_program(Seqlens, added, group, nq, BLOCK_R)
    qk_scale, v_descale = load_descales(QDescale, KDescale, VDescale, b, hkv, stride_ds, qk_scale)

    offs_r = tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, q_layout))
    real = offs_r < group * nq
    heads = (hkv * group + gl.where(real, offs_r, 0) // nq).to(gl.int64)
    q_rows = b * stride_q[0] + heads * stride_q[1] + (gl.where(real, offs_r, 0) % nq) * stride_q[2]
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, q_layout))
    q = gl.load(Q + q_rows[:, None] + offs_d[None, :], mask=real[:, None], other=0.0)  # (BLOCK_R, HEAD_DIM)
    if q.dtype == gl.bfloat16:  # Q K^T in float16, the queries scaled into its range
        q, qk_scale = half_queries(q, qk_scale)
    q = gl.convert_layout(_head_dim_order(q.to(gl.float16)), gl.DotOperandLayout(0, mma, 2))

    offs_r = tile * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, mma))  # the scores' rows
    real = offs_r < group * nq
    heads = (hkv * group + gl.where(real, offs_r, 0) // nq).to(gl.int64)
    rows = gl.where(real, offs_r, 0) % nq  # query index of each stacked row
    acc = gl.zeros([BLOCK_R, VALUE_DIM], gl.float32, mma)
    if SPLIT or Sinks is None:  # the learned sink joins a row's sum once: here with one split, else in _combine
        m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
        l_i = gl.zeros([BLOCK_R], gl.float32, gl.SliceLayout(1, mma))
    else:
        m_i = gl.load(Sinks + heads) * LOG2E
        l_i = gl.full([BLOCK_R], 1.0, gl.float32, gl.SliceLayout(1, mma))

    sink_end, band_start, full_start, full_end, band_end = kv_range(0, nq, nk, left, right, sink_tokens, ALL_ROWS,
                                                                    BLOCK_N, HAS_LEFT, HAS_RIGHT)
    count = sink_end + band_end - band_start  # the i-th visible block: [0, sink_end), then [band_start, band_end)
    per = gl.cdiv(count, splits)
    lo, hi = split * per, gl.minimum(split * per + per, count)  # this split's share
    if PAGE:  # strides (page, row, head): this head's keys in the first page; the sequence's block table
        k_first = K + hkv * stride_k[2]
        v_first = V + hkv * stride_v[2]
    else:  # strides (batch, head, row)
        k_first = K + b * stride_k[0] + hkv * stride_k[1]
        v_first = V + b * stride_v[0] + hkv * stride_v[1]
    blocks = (k_first.to(gl.pointer_type(gl.int32), bitcast=True), v_first.to(gl.pointer_type(gl.int32), bitcast=True),
              sink_end, band_start)
    if PAGE:
        blocks = blocks + (BlockTable + b * stride_bt,)
    rule = (nq, nk, left, right, sink_tokens)
    whole, whole_end = sink_end + full_start - band_start, sink_end + full_end - band_start  # the whole blocks' i
    if lo < gl.minimum(hi, whole):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, rows, lo, gl.minimum(hi, whole), blocks, rule, qk_scale,
                                HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, True, KEY_WORDS, PAGE, LINES)
    if gl.maximum(lo, whole) < gl.minimum(hi, whole_end):
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, rows, gl.maximum(lo, whole), gl.minimum(hi, whole_end), blocks,
                                rule, qk_scale, HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, False, KEY_WORDS, PAGE, LINES)
    if gl.maximum(lo, whole_end) < hi:
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, rows, gl.maximum(lo, whole_end), hi, blocks, rule, qk_scale,
                                HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, True, KEY_WORDS, PAGE, LINES)

    gdc_launch_dependents()  # the combine may launch now (decode._early_combine): this program's walk is done
    if VDescale is not None:  # v's descale: one multiply of the finished rows (a split's partial alike)
        acc = acc * v_descale
    out, lse = finish_state(acc, m_i, l_i)  # (BLOCK_R, VALUE_DIM), (BLOCK_R,)
    offs_n = gl.arange(0, VALUE_DIM, layout=gl.SliceLayout(0, mma))
    column = (offs_n % 8) * (VALUE_DIM // 8) + offs_n // 8  # where P V's column n is stored (_value_order)
    o_rows, lse_rows = decode_rows(b, heads, split, rows, stride_o, stride_lse, SPLIT)
    gl.store(Out + o_rows[:, None] + column[None, :], out.to(Out.dtype.element_ty), mask=real[:, None])
    gl.store(Lse + lse_rows, lse, mask=real)


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, paged: bool, stacked: int) -> bool:
    """Whether a decode call takes this kernel: q (FP8 or 16-bit) on an sm_90 GPU (a verified Triton), an FP8
    cache with D = Dv in ``HEAD_DIMS`` and at most ``BLOCK_R`` stacked rows (group x queries), laid out as the
    word loads need: contiguous (B, Hkv, N, D) with its keys in consecutive rows, or paged (pages, page, Hkv, D)
    in pages of a multiple of ``BLOCK_N`` keys with each page's rows (all heads) consecutive; every row at a
    16-byte boundary."""
    if not (k.dtype == FP8 and v.dtype == FP8 and q.dtype != torch.float32 and _on_hopper(q)
            and q.shape[-1] == k.shape[-1] == v.shape[-1] and k.shape[-1] in HEAD_DIMS and stacked <= BLOCK_R.value):
        return False
    if paged:
        laid_out = all(t.shape[1] % BLOCK_N.value == 0 and t.stride(2) == t.shape[3]
                       and t.stride(1) == t.shape[2] * t.shape[3] and t.stride(0) == t.shape[1] * t.stride(1)
                       for t in (k, v))
    else:
        laid_out = all(t.stride(2) == t.shape[3] for t in (k, v))
    return laid_out and all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0
                            for t in (k, v))


def splits(pairs: int, visible_blocks: int, device: torch.device) -> int:
    """Splits per (sequence, kv head), of ``pairs`` such: as many as one wave of resident programs holds (a
    second, partial wave would cost a whole split's walk), each keeping at least four tiles, at most
    ``MAX_SPLITS``. Where that leaves a split of a full cache more than ``SPLIT_KEYS`` keys (large batches), a
    whole number of such waves: a ragged batch's long sequences then spread over more programs."""
    resident = 65536 // (32 * REGISTERS) * torch.cuda.get_device_properties(device).multi_processor_count
    wave = max(1, min(resident // pairs, cdiv(visible_blocks, 4), MAX_SPLITS))
    return min(wave * cdiv(visible_blocks * BLOCK_N.value, wave * SPLIT_KEYS), MAX_SPLITS)


def lines(paged: bool, keys: int, splits: int) -> bool:
    """Whether a walk's whole tiles fetch whole 128-byte L2 lines (:func:`_whole_tile`): paged caches whose splits
    walk ``LINE_KEYS`` keys or more of a full cache of ``keys``, where the walk streams and the next head's half of
    each line is read while it is in L2; a contiguous cache's lines are the program's own."""
    return paged and keys >= splits * LINE_KEYS
