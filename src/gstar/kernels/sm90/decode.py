"""The sm_90 decode kernel for FP8 caches, in Gluon: one warp a program, keys and values loaded from global memory
straight into the registers the tensor cores read, no shared memory.

The portable decode kernel (:mod:`gstar.kernels.portable.decode`) stages every K and V tile in shared memory,
widens V there to float16 and passes P between its four warps through it: against an FP8 cache its shared-memory
pipe is the busiest unit, not DRAM. Here each program is one warp holding the softmax state of its stacked rows
(``BLOCK_R = 16``: a GQA group's heads times the queries), and each ``mma.sync`` operand is loaded in the layout
the instruction reads:

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
are every kernel's own (:mod:`gstar.kernels.common`); :func:`gstar.kernels.common.split.combine` merges the split
partials. A paged cache's tiles find their rows through the block table (:func:`_row`), a tile within one page;
its long walks fetch whole L2 lines (:func:`lines`). :mod:`gstar.kernels.dispatch` says which calls take it.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton import constexpr_function
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.language.extra.cuda import gdc_launch_dependents

from ...pattern import Pattern, cdiv
from ..common.fp8 import half_queries, load_descales
from ..common.rule import bounds, mask, rule
from ..common.softmax import finish_state, sink_max, softmax_step
from ..common.split import Plan, decode_program, decode_rows, merge_options, visible_blocks
from ..common.walk import ALL_ROWS, block_at, kv_blocks, steps
from .. import card
from ..launch import constexprs

BLOCK_R = gl.constexpr(16)  # stacked rows a program holds: mma.sync's M
BLOCK_N = gl.constexpr(32)  # keys a tile
REGISTERS = 168  # a thread's, the compiler's own count at D 64: twelve one-warp programs an SM (65,536 each)
MAX_SPLITS = 256
# keys of a full cache a split walks at most (:func:`splits`; the portable kernel has its own, without the whole
# waves): a ragged batch's long sequences spread over more programs
SPLIT_KEYS = 4096
# keys of a full cache a split walks, from which a paged cache's whole tiles fetch whole L2 lines (:func:`lines`):
# shorter walks lose more to the wider fetches than they gain
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
def _word_tile(First, offs, start_n, offs_n, pred, nk, MASKED: gl.constexpr, ZEROS: gl.constexpr, VEC: gl.constexpr,
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
def _first_key(walk, j, i_hi, MASKED: gl.constexpr):
    """Step ``j``'s first key (``walk``: the program's :class:`Blocks`); whole tiles take ``j`` clamped to the last
    one, ``i_hi - 1`` (a load past it reads the last tile again)."""
    if not MASKED:
        j = gl.minimum(j, i_hi - 1)
    return block_at(walk, j) * BLOCK_N


@gluon.jit
def _row(cache, walk, j, i_hi, MASKED: gl.constexpr, PAGE: gl.constexpr):
    """The cache row of step ``j``'s first key: a paged cache's through the block table (the tile lies in one page;
    masked tiles past ``i_hi`` look nothing up), else the key's index."""
    start = _first_key(walk, j, i_hi, MASKED)
    if PAGE:
        return gl.load(cache[2] + start // PAGE, mask=j < i_hi, other=0).to(gl.int64) * PAGE + start % PAGE
    return start.to(gl.int64)


@gluon.jit
def _tiles(cache, walk, j, row, i_hi, offs, nk, MASKED: gl.constexpr, KEY_WORDS: gl.constexpr,
           LINES: gl.constexpr):
    """Step ``j``'s first key and its K and V words (:func:`_word_tile`) from cache row ``row`` (:func:`_row`);
    masked tiles load nothing past ``i_hi``. ``cache``, ``walk`` as :func:`_fold_pairs` takes them; ``offs``:
    (K's in-tile offsets, their keys, V's, theirs); KEY_WORDS, LINES as :func:`_decode` takes them."""
    k_offs, offs_kn, v_offs, offs_vn = offs
    start = _first_key(walk, j, i_hi, MASKED)
    K_VEC: gl.constexpr = k_offs.shape[1] // 4  # a quarter of a key's words a thread (_rows_layout)
    V_VEC: gl.constexpr = v_offs.shape[1] // 8  # an eighth of a value row's (_values_layout)
    return (start, _word_tile(cache[0] + row * KEY_WORDS, k_offs, start, offs_kn, j < i_hi, nk, MASKED, False,
                              K_VEC, LINES),
            _word_tile(cache[1] + row * KEY_WORDS, v_offs, start, offs_vn, j < i_hi, nk, MASKED, MASKED, V_VEC,
                       LINES))


@gluon.jit
def _fold(acc, m_i, l_i, q, k, v, cols, rows, seq_rule, qk_scale, MASKED: gl.constexpr):
    """One tile's update of the rows' state: k, v its FP8 words (:func:`_word_tile`), cols its keys' indices."""
    mma: gl.constexpr = _mma_layout()
    kt = _head_dim_order(_widen(k)).permute([1, 0])  # (D, BLOCK_N)
    kt = gl.convert_layout(kt, gl.DotOperandLayout(1, mma, 2), assert_trivial=True)
    s = mma_v2(q, kt, gl.zeros([BLOCK_R, BLOCK_N], gl.float32, mma))  # (BLOCK_R, BLOCK_N) raw scores
    p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, rows, cols, qk_scale, seq_rule, MASKED, True)
    p = gl.convert_layout(p.to(gl.float16), gl.DotOperandLayout(0, mma, 2), assert_trivial=True)
    v = gl.convert_layout(_value_order(_widen(v)), gl.DotOperandLayout(1, mma, 2))
    return mma_v2(p, v, acc * alpha[:, None]), m_i, l_i


@gluon.jit
def _fold_pairs(acc, m_i, l_i, q, rows, i_lo, i_hi, cache, walk, seq_rule, qk_scale, MASKED: gl.constexpr,
                KEY_WORDS: gl.constexpr, PAGE: gl.constexpr, LINES: gl.constexpr):
    """Fold steps ``i_lo .. i_hi`` of the walk ``walk`` into the rows' state, as the portable decode kernel, two
    tiles in flight: buffers a and b take the even and odd tiles, each loaded again (two tiles on) right after
    its fold, so that no register is copied while its load is in flight (a copy would wait for it). Whole tiles
    load without a mask: a load past the last tile reads the last one again. ``cache``: (K, V), K and V as int32
    words, this sequence's and head's first key (a contiguous cache) or this head's in the first page (paged, then
    the sequence's block table follows); ``seq_rule``: the sequence's rule; KEY_WORDS, PAGE, LINES: as
    :func:`_decode_sm90` takes them."""
    nk = seq_rule.nk
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
    start_a, k_a, v_a = _tiles(cache, walk, i_lo, _row(cache, walk, i_lo, i_hi, MASKED, PAGE), i_hi, offs, nk, MASKED,
                               KEY_WORDS, LINES)  # (BLOCK_N, D / 4), (BLOCK_N, DV / 4) words
    start_b, k_b, v_b = _tiles(cache, walk, i_lo + 1, _row(cache, walk, i_lo + 1, i_hi, MASKED, PAGE), i_hi, offs,
                               nk, MASKED, KEY_WORDS, LINES)
    for i in range(i_lo, i_hi, 2):
        acc, m_i, l_i = _fold(acc, m_i, l_i, q, k_a, v_a, start_a + offs_n, rows, seq_rule, qk_scale, MASKED)
        start_a, k_a, v_a = _tiles(cache, walk, i + 2, _row(cache, walk, i + 2, i_hi, MASKED, PAGE), i_hi, offs, nk,
                                   MASKED, KEY_WORDS, LINES)
        if i + 1 < i_hi:
            acc, m_i, l_i = _fold(acc, m_i, l_i, q, k_b, v_b, start_b + offs_n, rows, seq_rule, qk_scale, MASKED)
        start_b, k_b, v_b = _tiles(cache, walk, i + 3, _row(cache, walk, i + 3, i_hi, MASKED, PAGE), i_hi, offs, nk,
                                   MASKED, KEY_WORDS, LINES)
    return acc, m_i, l_i


# lengths, bounds and row counts change between calls: specialising on them would recompile a decode loop
@gluon.jit(do_not_specialize=["nq", "group", "added", "left", "right", "sink_tokens"])
def _decode_sm90(Q, K, V, BlockTable, Seqlens, Sinks, Out, Lse, QDescale, KDescale, VDescale,
            stride_q, stride_k, stride_v, stride_bt, stride_o, stride_lse,
            nq, group, added, left, right, sink_tokens, qk_scale, stride_ds,
                 HEAD_DIM: gl.constexpr, VALUE_DIM: gl.constexpr, SPLIT: gl.constexpr, MASK: gl.constexpr,
                 KEY_WORDS: gl.constexpr, PAGE: gl.constexpr, LINES: gl.constexpr):
    """Grid ``(splits, Hkv * row_tiles, B)`` as the portable kernel's (the plan gives one row tile:
    ``group * nq <= BLOCK_R``), one warp a program; arguments as its (``gstar.kernels.portable.decode``) for an
    FP8 cache, contiguous (PAGE 0,
    no block table) or paged in pages of PAGE keys (a multiple of ``BLOCK_N``), whose key rows lie KEY_WORDS
    32-bit words apart (D / 4 contiguous, Hkv D / 4 paged), K's and V's alike; tiles of ``BLOCK_N`` keys. LINES:
    whole tiles fetch whole L2 lines (:func:`lines`). After its walk each program lets the combine launch
    (:func:`gstar.kernels.common.split.combine`, a programmatic dependent launch)."""
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
    if SPLIT or Sinks is None:  # the learned sink joins a row's sum once: here with one split, else in the combine
        m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, gl.SliceLayout(1, mma))
        l_i = gl.zeros([BLOCK_R], gl.float32, gl.SliceLayout(1, mma))
    else:
        m_i = sink_max(Sinks, heads)
        l_i = gl.full([BLOCK_R], 1.0, gl.float32, gl.SliceLayout(1, mma))

    seq_rule = rule(nq, nk, left, right, sink_tokens, 0, None, MASK)
    walk = kv_blocks(seq_rule, 0, ALL_ROWS, BLOCK_N)
    whole, whole_end, count = steps(walk)  # masked steps, whole ones from ``whole``, masked from ``whole_end``
    per = gl.cdiv(count, splits)
    lo, hi = split * per, gl.minimum(split * per + per, count)  # this split's share
    if PAGE:  # strides (page, row, head): this head's keys in the first page; the sequence's block table
        k_first = K + hkv * stride_k[2]
        v_first = V + hkv * stride_v[2]
    else:  # strides (batch, head, row)
        k_first = K + b * stride_k[0] + hkv * stride_k[1]
        v_first = V + b * stride_v[0] + hkv * stride_v[1]
    cache = (k_first.to(gl.pointer_type(gl.int32), bitcast=True), v_first.to(gl.pointer_type(gl.int32), bitcast=True))
    if PAGE:
        cache = cache + (BlockTable + b * stride_bt,)
    if lo < gl.minimum(hi, whole):
        acc, m_i, l_i = _fold_pairs(acc, m_i, l_i, q, rows, lo, gl.minimum(hi, whole), cache, walk, seq_rule, qk_scale,
                                    True, KEY_WORDS, PAGE, LINES)
    if gl.maximum(lo, whole) < gl.minimum(hi, whole_end):
        acc, m_i, l_i = _fold_pairs(acc, m_i, l_i, q, rows, gl.maximum(lo, whole), gl.minimum(hi, whole_end), cache,
                                    walk, seq_rule, qk_scale, False, KEY_WORDS, PAGE, LINES)
    if gl.maximum(lo, whole_end) < hi:
        acc, m_i, l_i = _fold_pairs(acc, m_i, l_i, q, rows, gl.maximum(lo, whole_end), hi, cache, walk, seq_rule,
                                    qk_scale, True, KEY_WORDS, PAGE, LINES)

    gdc_launch_dependents()  # the combine may launch now: this program's walk is done
    if VDescale is not None:  # v's descale: one multiply of the finished rows (a split's partial alike)
        acc = acc * v_descale
    out, lse = finish_state(acc, m_i, l_i)  # (BLOCK_R, VALUE_DIM), (BLOCK_R,)
    offs_n = gl.arange(0, VALUE_DIM, layout=gl.SliceLayout(0, mma))
    column = (offs_n % 8) * (VALUE_DIM // 8) + offs_n // 8  # where P V's column n is stored (_value_order)
    o_rows, lse_rows = decode_rows(b, heads, split, rows, 0, stride_o, stride_lse, SPLIT)
    gl.store(Out + o_rows[:, None] + column[None, :], out.to(Out.dtype.element_ty), mask=real[:, None])
    gl.store(Lse + lse_rows, lse, mask=real)


def fits(k: torch.Tensor, v: torch.Tensor, paged: bool) -> bool:
    """Whether a cache is laid out as the word loads need: contiguous (B, Hkv, N, D) with its keys in consecutive
    rows, or paged (pages, page, Hkv, D) in pages of a multiple of ``BLOCK_N`` keys with each page's rows (all
    heads) consecutive; every row at a 16-byte boundary."""
    if paged:
        laid_out = all(t.shape[1] % BLOCK_N.value == 0 and t.stride(2) == t.shape[3]
                       and t.stride(1) == t.shape[2] * t.shape[3] and t.stride(0) == t.shape[1] * t.stride(1)
                       for t in (k, v))
    else:
        laid_out = all(t.stride(2) == t.shape[3] for t in (k, v))
    return laid_out and all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 and t.stride(1) % 16 == 0
                            for t in (k, v))


def splits(pairs: int, visible: int, device: torch.device) -> int:
    """Splits per (sequence, kv head), of ``pairs`` such: as many as one wave of resident programs holds (a
    second, partial wave would cost a whole split's walk), each keeping at least four tiles, at most
    ``MAX_SPLITS``. Where that leaves a split of a full cache (``visible`` tiles) more than ``SPLIT_KEYS`` keys
    (large batches), a whole number of such waves: a ragged batch's long sequences then spread over more
    programs."""
    resident = 65536 // (32 * REGISTERS) * card.sm_count(str(device))
    wave = max(1, min(resident // pairs, cdiv(visible, 4), MAX_SPLITS))
    return min(wave * cdiv(visible * BLOCK_N.value, wave * SPLIT_KEYS), MAX_SPLITS)


def lines(paged: bool, keys: int, splits: int) -> bool:
    """Whether a walk's whole tiles fetch whole 128-byte L2 lines (:func:`_whole_tile`): paged caches whose splits
    walk ``LINE_KEYS`` keys or more of a full cache of ``keys``, where the walk streams and the next head's half of
    each line is read while it is in L2; a contiguous cache's lines are the program's own."""
    return paged and keys >= splits * LINE_KEYS


def visible_keys(pattern: Pattern, nq: int) -> int:
    """The keys of a full cache this kernel's walk covers, in its tiles (what the dispatcher's least length
    counts)."""
    return visible_blocks(pattern, nq, BLOCK_N.value) * BLOCK_N.value


@functools.lru_cache(maxsize=256)
def plan(B: int, Hq: int, Hkv: int, nq: int, D: int, Dv: int, paged: bool, block_size: int, pattern: Pattern,
         device: torch.device, num_splits: int | None) -> Plan:
    """The launch of a decode step with this kernel (arguments as the portable plan's; one row tile)."""
    visible = visible_blocks(pattern, nq, BLOCK_N.value)
    n = num_splits or splits(B * Hkv, visible, device)
    return Plan(_decode_sm90, (n, Hkv, B), n, dict(nq=nq, group=Hq // Hkv, **bounds(pattern)), constexprs(
        HEAD_DIM=D, VALUE_DIM=Dv, SPLIT=n > 1, MASK=mask(pattern), KEY_WORDS=(Hkv * D if paged else D) // 4,
        PAGE=block_size if paged else 0, LINES=lines(paged, visible * BLOCK_N.value, n), num_warps=1,
        maxnreg=REGISTERS), merge_options(Dv, n, device), nq)
