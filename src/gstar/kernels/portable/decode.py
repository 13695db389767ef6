"""The portable decode kernel: new queries against a long contiguous or paged cache, split over programs
(split-KV), and its plans.

``_decode`` runs on a grid ``(splits, Hkv * row_tiles, B)``. A program stacks every query head of one GQA
group and the queries of one tile, query-major (row ``r``: query ``r // group``, head ``hkv * group + r %
group``), so each K/V block is read once for the group and a tile holds consecutive queries. It reads its
sequence's length (and, packed, its query count) on the device, finds the blocks its queries see
(:func:`kv_blocks`: the sink-token blocks, then the window's band), and walks its share of them by step: split
``s`` takes the ``s``-th of ``splits`` equal runs. A paged cache is read block by block through the block table
(``BLOCK_N`` divides the block size, so a tile lies in one page). The softmax is every forward's
(:func:`softmax_step`). From a contiguous cache, and for a packed step's long sequences, it is masked on the
blocks the rule cuts (the sink-token blocks, the band's ends, the last block of the sequence) and unmasked on
the whole blocks between, whose loads carry no masks either; a paged decode's blocks all take the masked loop.
An FP8 cache runs ``P V`` in float16 (:func:`_widen_values`), and ``Q K^T`` in float16 too under 16-bit queries
(bfloat16 ones scaled into its range, :func:`half_queries`). With one split a program finishes its rows, the
learned sink included; with several each stores its partial result and
:func:`gstar.kernels.common.split.combine` merges them. A packed step (:func:`packed_plans`) is two launches of
this kernel over the whole batch: the sequences of a few queries split, the longer ones take one program per tile.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ...pattern import Pattern, cdiv
from ..common.fp8 import half_queries, load_descales
from ..common.rule import bounds, mask, packed_slot, rule, sequence_bounds
from ..common.sizes import head_lanes, head_parts, pad_head_dim
from ..common.softmax import finish_state, softcapped, softmax_step, start_state
from ..common.split import Plan, decode_program, decode_rows, early_combine, merge_options, visible_blocks
from ..common.walk import block_at, kv_blocks, steps
from .. import card
from ..launch import constexprs
from .forward import cache_plan

MAX_TILE_ROWS = 128  # stacked rows (group x queries) a program holds; more take further row tiles
MAX_SPLITS = 64
SHORT_QUERIES = 4  # a packed step's sequences of at most this many queries split their keys (packed_plans)
SPLIT_KEYS = 2048  # keys one split walks at most (while MAX_SPLITS allows): 32 tiles of 64
PAGED_REGISTERS = 64  # per thread: a paged 16-bit cache's kernel on Hopper, 16 rows of narrow heads
# A latent cache (multi-head latent attention: 576-lane keys, the values their first 512, one kv head under 128
# query heads), held as 512 + 64 lanes: 64 stacked rows over two warpgroups, so that warpgroup products serve it
# and 128 heads read the cache twice rather than eight times; 32-key tiles keep the 64 x 512 accumulator and a
# double-buffered key tile on chip.
LATENT_ROWS, LATENT_KEYS, LATENT_WARPS, LATENT_STAGES = 64, 32, 8, 2


@triton.jit
def _block_ptrs(Cache, BlockTable, b, hkv, start_n, offs_n, offs_d, stride_c, stride_bt, page_size,
                PAGED: tl.constexpr):
    """Pointers to keys ``start_n + offs_n`` of sequence ``b``, kv head ``hkv``: (BLOCK_N, D) for ``offs_d``.
    Contiguous caches have (batch, head, row) strides ``stride_c``; paged ones (page, row, head), the page
    of the block read from the block table."""
    if PAGED:
        page = tl.load(BlockTable + b * stride_bt + start_n // page_size).to(tl.int64)
        rows = page * stride_c[0] + (start_n % page_size + offs_n).to(tl.int64) * stride_c[1] + hkv * stride_c[2]
    else:
        rows = b * stride_c[0] + hkv * stride_c[1] + (start_n + offs_n).to(tl.int64) * stride_c[2]
    return Cache + rows[:, None] + offs_d[None, :]


@triton.jit
def _share(part: tl.constexpr, lo, hi, whole, whole_end):
    """``(lo, hi)`` of this split's steps ``[lo, hi)`` in part ``part`` of the walk by step: 0 the masked steps
    before ``whole``, 1 the whole blocks up to ``whole_end``, 2 the masked ones after (:func:`steps`)."""
    if part == 0:
        return lo, tl.minimum(hi, whole)
    elif part == 1:
        return tl.maximum(lo, whole), tl.minimum(hi, whole_end)
    else:
        return tl.maximum(lo, whole_end), hi


@triton.jit
def _widen_values(v, PTX_WIDEN: tl.constexpr):
    """An FP8 value tile (BLOCK_N, DV_PAD) as float16, exactly (every e4m3 value is one). PTX_WIDEN: Ada's and
    Hopper's pair conversion, written as inline PTX that is not pure, so that Triton converts in the layout the
    tile was loaded in and hands the product float16 through shared memory; its own conversion moves into the
    product's operand layout, where an FP8 tile with keys in rows is read from shared memory a byte at a time
    """
    if PTX_WIDEN:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [v], dtype=tl.float16, is_pure=False, pack=4)
    return v.to(tl.float16)


@triton.jit
def _fold_steps(acc, m_i, l_i, q, q_tail, rows, i_lo, i_hi, cache, blocks, rule, scores, HEAD_DIM: tl.constexpr,
                HEAD_TAIL: tl.constexpr, VALUE_DIM: tl.constexpr, VALUES_IN_KEYS: tl.constexpr,
                BLOCK_N: tl.constexpr, PAGED: tl.constexpr, PRECISION: tl.constexpr, PTX_WIDEN: tl.constexpr,
                SOFTCAP: tl.constexpr, MASKED: tl.constexpr):
    """Fold steps ``i_lo .. i_hi`` of the walk by step (:func:`block_at` of ``blocks``) into the rows' state
    ``(acc, m_i, l_i)``; q: (BLOCK_R, D_HEAD) and, with a HEAD_TAIL, q_tail: (BLOCK_R, HEAD_TAIL), the lanes past
    it (else q again, unread); rows: their query indices. VALUES_IN_KEYS: V is K's first lanes (a latent cache),
    the key tile serves as the value tile. ``cache``: (K, V, BlockTable, b, hkv,
    stride_k, stride_v, stride_bt, page_size); ``scores``: (qk_scale, softcap) as :func:`softcapped` takes them.
    MASKED blocks evaluate the rule per key; the others are whole blocks below nk that every row sees, loaded and
    scored without masks."""
    K, V, BlockTable, b, hkv, stride_k, stride_v, stride_bt, page_size = cache
    qk_scale, softcap = scores
    nk = rule.nk
    offs_d = tl.arange(0, head_lanes(HEAD_DIM, HEAD_TAIL))
    offs_t = head_lanes(HEAD_DIM, HEAD_TAIL) + tl.arange(0, max(HEAD_TAIL, 16))  # unused without a tail
    offs_dv = tl.arange(0, pad_head_dim(VALUE_DIM))
    offs_n = tl.arange(0, BLOCK_N)
    for i in range(i_lo, i_hi):
        start_n = block_at(blocks, i) * BLOCK_N
        cols = start_n + offs_n  # (BLOCK_N,)
        key_ok = (cols < nk) | (not MASKED)
        k = tl.load(_block_ptrs(K, BlockTable, b, hkv, start_n, offs_n, offs_d, stride_k, stride_bt, page_size,
                                PAGED),
                    mask=key_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)  # (BLOCK_N, D_PAD)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # (BLOCK_R, BLOCK_N) raw scores
        if HEAD_TAIL:  # the lanes past the head part, into the same scores
            k_tail = tl.load(_block_ptrs(K, BlockTable, b, hkv, start_n, offs_n, offs_t, stride_k, stride_bt,
                                         page_size, PAGED), mask=key_ok[:, None], other=0.0)  # (BLOCK_N, HEAD_TAIL)
            s = tl.dot(q_tail, tl.trans(k_tail), s, input_precision=PRECISION)
        s = softcapped(s, softcap, SOFTCAP)
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, rows, cols, qk_scale, rule, MASKED, True)
        acc = acc * alpha[:, None]
        if VALUES_IN_KEYS:  # (BLOCK_N, DV_PAD): DV_PAD is the head part's width
            v = k
        else:
            v = tl.load(_block_ptrs(V, BlockTable, b, hkv, start_n, offs_n, offs_dv, stride_v, stride_bt, page_size,
                                    PAGED),
                        mask=key_ok[:, None] & (offs_dv[None, :] < VALUE_DIM), other=0.0)  # (BLOCK_N, DV_PAD)
        if v.dtype == tl.float8e4nv:  # an FP8 cache: P V in float16 (P in FP8 would miss the accuracy bar)
            v = _widen_values(v, PTX_WIDEN)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, m_i, l_i


# lengths, bounds and row counts change between calls: specialising on them would recompile a decode loop
@triton.jit(do_not_specialize=["nq", "group", "added", "short_q", "batch", "left", "right", "sink_tokens", "chunk",
                               "page_size"])
def _decode(Q, K, V, BlockTable, Seqlens, CuQ, Sinks, Out, Lse, QDescale, KDescale, VDescale,
            stride_q, stride_k, stride_v, stride_bt, stride_o, stride_lse,
            nq, group, added, short_q, batch, left, right, sink_tokens, chunk, page_size, qk_scale, softcap,
            stride_ds,
            HEAD_DIM: tl.constexpr, HEAD_TAIL: tl.constexpr, VALUE_DIM: tl.constexpr, VALUES_IN_KEYS: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, TILE_QUERIES: tl.constexpr, SERVES: tl.constexpr,
            PAGED: tl.constexpr, SPLIT: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr,
            PTX_WIDEN: tl.constexpr, SOFTCAP: tl.constexpr, PDL: tl.constexpr):
    """Q: (B, Hq, nq, HEAD_DIM), or packed (total_q, Hq, HEAD_DIM) with CuQ (B + 1,) int32 (sequence
    ``b``'s queries are rows ``CuQ[b] .. CuQ[b + 1]``, at most ``nq``); K, V: contiguous (B, Hkv,
    Nmax, HEAD_DIM / VALUE_DIM) or, with PAGED, (pages, page_size, Hkv, ...) read through BlockTable (B,
    max_blocks) int32; Seqlens: (B,) int32, a sequence's keys before the ``added`` appended ones; Sinks: None
    or (Hq,) float32 (used when not SPLIT). SERVES: which sequences this launch takes, ``"all"``, ``"short"``
    (at most ``short_q`` queries) or ``"long"`` (more): a packed step's two launches share its batch.
    Not SPLIT: Out (B, Hq, nq, VALUE_DIM) in Q's dtype and Lse (B, Hq, nq) float32, strides (batch, head, row)
    and (batch, head); packed, Out (total_q, Hq, VALUE_DIM) and Lse (Hq, total_q), strides (0, head, row) and
    (0, head). SPLIT: Out (B, Hq, splits, rows, VALUE_DIM) and Lse (B, Hq, splits, rows) float32 (``rows`` the
    most queries a split sequence holds), strides (batch, head, split, row) and (batch, head, split): this
    program's partial, LSE -inf where it saw no key.
    stride_q: (batch, head, row), packed (0, head, row); stride_k, stride_v: (batch, head, row), or (page, row,
    head) for a paged cache. qk_scale, softcap and SOFTCAP: the score factors of :func:`softcap_args` (qk_scale
    > 0). An FP8 cache (float8_e4m3fn K, V; Q FP8 too, or 16-bit and its keys widened to Q's dtype): QDescale,
    KDescale, VDescale and ``stride_ds`` the descales as :func:`load_descales` takes them, else None; PTX_WIDEN
    as :func:`_widen_values` takes it.
    PDL: :func:`combine` may launch once every program has walked its keys (programmatic dependent launch).
    HEAD_TAIL: a head dim held in two parts (:func:`head_parts`, 16-bit caches), the tail's lanes, else 0 (one
    part, padded). VALUES_IN_KEYS: V is a view of K's first VALUE_DIM lanes, the head part's width (multi-head
    latent attention's cache): the values are read with the keys.
    """
    D_HEAD: tl.constexpr = head_lanes(HEAD_DIM, HEAD_TAIL)
    DV_PAD: tl.constexpr = pad_head_dim(VALUE_DIM)
    if SERVES == "long":  # grid (slots, Hkv): each slot one tile of one sequence
        split, splits, hkv = 0, 1, tl.program_id(1)
        b, tile = packed_slot(CuQ, tl.program_id(0), batch, group, BLOCK_R)
        nk = tl.load(Seqlens + b) + added
    else:
        split, splits, hkv, tile, b, nk = decode_program(Seqlens, added, group, nq, BLOCK_R)
    q_start, seq_q = sequence_bounds(CuQ, b, nq, CuQ is not None)
    if SERVES == "short":
        seq_q = tl.where(seq_q <= short_q, seq_q, 0)
    elif SERVES == "long":
        seq_q = tl.where(seq_q > short_q, seq_q, 0)
    if SOFTCAP:  # the descales scale the raw scores, inside the tanh
        softcap, v_descale = load_descales(QDescale, KDescale, VDescale, b, hkv, stride_ds, softcap)
    else:
        qk_scale, v_descale = load_descales(QDescale, KDescale, VDescale, b, hkv, stride_ds, qk_scale)

    # stacked rows query-major (row r: query r // group, head hkv * group + r % group), so that a tile of a long
    # run of queries holds consecutive ones and walks only the keys they see
    offs_r = tile * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
    real = offs_r < group * seq_q
    heads = (hkv * group + tl.where(real, offs_r, 0) % group).to(tl.int64)
    rows = tl.where(real, offs_r, 0) // group  # query index of each stacked row
    offs_d = tl.arange(0, D_HEAD)
    offs_dv = tl.arange(0, DV_PAD)
    q_rows = b * stride_q[0] + heads * stride_q[1] + (q_start + rows) * stride_q[2]
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=real[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0)  # (BLOCK_R, D_HEAD)
    q_tail = q
    if HEAD_TAIL:
        offs_t = D_HEAD + tl.arange(0, HEAD_TAIL)
        q_tail = tl.load(Q + q_rows[:, None] + offs_t[None, :], mask=real[:, None], other=0.0)  # (BLOCK_R, HEAD_TAIL)
    if K.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:  # an FP8 cache: Q K^T in float16
        if SOFTCAP:
            q, softcap = half_queries(q, softcap)
        else:
            q, qk_scale = half_queries(q, qk_scale)

    # the learned sink joins a row's sum once: here with one split, in the combine with several
    if SPLIT:
        acc, m_i, l_i = start_state(None, heads, VALUE_DIM)
    else:
        acc, m_i, l_i = start_state(Sinks, heads, VALUE_DIM)

    seq_rule = rule(seq_q, nk, left, right, sink_tokens, chunk, None, MASK)
    blocks = kv_blocks(seq_rule, tile * BLOCK_R // group, TILE_QUERIES, BLOCK_N)
    whole, whole_end, count = steps(blocks)  # masked steps, whole ones from ``whole``, masked from ``whole_end``
    count = tl.where(tile * BLOCK_R < group * seq_q, count, 0)  # a tile past its sequence's rows walks nothing
    per = tl.cdiv(count, splits)
    lo, hi = split * per, tl.minimum(split * per + per, count)  # this split's share
    cache = (K, V, BlockTable, b, hkv, stride_k, stride_v, stride_bt, page_size)
    scores = (qk_scale, softcap)
    # a paged cache's decode waits on its block-table lookups, and more loops cost it registers and pipeline
    # fills: one masked loop; a long sequence's tiles are compute-bound, and skip the mask on whole blocks
    ONE_LOOP: tl.constexpr = PAGED and SERVES != "long"
    for part in tl.static_range(1 if ONE_LOOP else 3):  # masked, whole and masked blocks
        part_lo, part_hi = lo, hi
        if not ONE_LOOP:
            part_lo, part_hi = _share(part, lo, hi, whole, whole_end)
        if ONE_LOOP or part_lo < part_hi:  # each loop entered only with blocks to walk (the one loop always)
            acc, m_i, l_i = _fold_steps(
                acc, m_i, l_i, q, q_tail, rows, part_lo, part_hi, cache, blocks, seq_rule, scores, HEAD_DIM=HEAD_DIM,
                HEAD_TAIL=HEAD_TAIL, VALUE_DIM=VALUE_DIM, VALUES_IN_KEYS=VALUES_IN_KEYS, BLOCK_N=BLOCK_N, PAGED=PAGED,
                PRECISION=PRECISION, PTX_WIDEN=PTX_WIDEN, SOFTCAP=SOFTCAP, MASKED=ONE_LOOP or part != 1)

    if PDL:  # the combine may launch now: this program's walk is done
        gdc_launch_dependents()
    if VDescale is not None:  # v's descale: one multiply of the finished rows (a split's partial alike)
        acc = acc * v_descale
    out, lse = finish_state(acc, m_i, l_i)  # (BLOCK_R, DV_PAD), (BLOCK_R,)
    value_ok = real[:, None] & (offs_dv[None, :] < VALUE_DIM)
    o_rows, lse_rows = decode_rows(b, heads, split, rows, q_start, stride_o, stride_lse, SPLIT)
    tl.store(Out + o_rows[:, None] + offs_dv[None, :], out.to(Out.dtype.element_ty), mask=value_ok)
    tl.store(Lse + lse_rows, lse, mask=real)


def block_keys(paged: bool, block_size: int, width: int, fp8: bool) -> int:
    """Keys per tile: 64, fewer for wide heads (``width``: the padded D + Dv; a tile of keys and values stays
    within 64 x 256 elements), twice as many from an FP8 cache (the same bytes, fewer steps); for a paged cache
    a divisor of its block size."""
    most = max(16, 64 * 256 // width) * (2 if fp8 else 1)
    return next(n for n in (128, 64, 32, 16) if n <= min(most, 128 if fp8 else 64)
                and (not paged or block_size % n == 0))


def stacked_rows(stacked: int, width: int) -> int:
    """Rows a program stacks: the group's heads times the queries, padded to a power of two (at least 16,
    tl.dot's minimum), at most 128, and fewer for wide heads (the accumulators hold rows x padded Dv)."""
    most = max(16, min(MAX_TILE_ROWS, triton.next_power_of_2(128 * 256 // width + 1) // 2))  # a power of two
    return min(most, max(16, triton.next_power_of_2(stacked)))


def default_splits(programs: int, visible: int, block_n: int, device: torch.device) -> int:
    """Splits per (sequence, kv head): at most ``SPLIT_KEYS`` keys a split (of ``visible`` tiles of ``block_n``),
    and enough programs for two per SM where every split still gets four tiles. It sees the shapes and the card,
    never the lengths: a ragged batch is split by its capacity, which keeps its longest sequences from setting the
    time."""
    sms = card.sm_count(str(device)) or 1
    fill = min(cdiv(2 * sms, programs), cdiv(visible, 4))
    return max(1, min(max(fill, cdiv(visible * block_n, SPLIT_KEYS)), MAX_SPLITS))


def latent(D: int, Dv: int, fp8: bool, values_in_keys: bool) -> bool:
    """Whether a cache takes the latent tiles (``LATENT_ROWS``): 16-bit, its values its keys' first lanes, and its
    head dim held in two parts whose first is the values' width (576 = 512 + 64)."""
    head, tail = head_parts(D)
    return values_in_keys and not fp8 and tail > 0 and pad_head_dim(Dv) == head


def _rows(stacked: int, D: int, Dv: int, is_latent: bool) -> int:
    """Stacked rows a program holds: :func:`stacked_rows`, or for a latent cache up to ``LATENT_ROWS``."""
    if is_latent:
        return min(LATENT_ROWS, max(16, triton.next_power_of_2(stacked)))
    return stacked_rows(stacked, pad_head_dim(D) + pad_head_dim(Dv))


def _plan(B: int, Hkv: int, group: int, nq: int, D: int, Dv: int, block_r: int, paged: bool, block_size: int,
          pattern: Pattern, device: torch.device, precision: str, num_splits: int | None, fp8: bool, softcap: bool,
          serves: str = "all", short_q: int = 0, is_latent: bool = False) -> Plan:
    """One launch of this kernel over ``B`` sequences of at most ``nq`` queries, ``block_r`` stacked rows a
    program (``serves``, ``short_q``: the sequences it takes, as ``_decode`` reads them; a long launch's grid
    grows with total_q, :class:`Plan`'s ``slot_rows``; ``is_latent``: :func:`latent`)."""
    width = pad_head_dim(D) + pad_head_dim(Dv)
    block_n = block_keys(paged, block_size, width, fp8)
    warps = 4
    if is_latent:
        block_n = next(n for n in (LATENT_KEYS, 16) if not paged or block_size % n == 0)
        warps = LATENT_WARPS
    row_tiles = cdiv(group * nq, block_r)
    visible = visible_blocks(pattern, nq, block_n)
    splits = num_splits or default_splits(B * Hkv * row_tiles, visible, block_n, device)
    major = card.capability_major(device) if device.type == "cuda" else 0
    stages = LATENT_STAGES if is_latent else 3 if major >= 9 else 2  # Hopper: three tiles in flight
    # a paged 16-bit cache, 16 rows of narrow heads, on Hopper: 64 registers (no spills) fit eight programs an SM
    # where the compiler's 80 fit six, more block-table lookups in flight
    capped = major == 9 and paged and not fp8 and block_r <= 16 and width <= 128
    cap = {"maxnreg": PAGED_REGISTERS} if capped else {}
    args = dict(nq=nq, group=group, short_q=short_q, batch=B, **bounds(pattern), page_size=block_size if paged else 1)
    long = serves == "long"
    return Plan(_decode, (B, Hkv, 1) if long else (splits, Hkv * row_tiles, B), splits, args, constexprs(
        HEAD_DIM=D, HEAD_TAIL=head_parts(D)[1] if is_latent else 0, VALUE_DIM=Dv, VALUES_IN_KEYS=is_latent,
        BLOCK_R=block_r, BLOCK_N=block_n, TILE_QUERIES=cdiv(block_r, group) + 1, SERVES=serves, PAGED=paged,
        SPLIT=splits > 1, MASK=mask(pattern), PRECISION=precision, PTX_WIDEN=fp8 and card.nvidia(device),
        SOFTCAP=softcap, PDL=early_combine(device), num_warps=warps,
        num_stages=stages, **cap),
        merge_options(Dv, splits, device), nq, block_r if long else 0)


@functools.lru_cache(maxsize=256)
def plan(B: int, Hq: int, Hkv: int, nq: int, D: int, Dv: int, paged: bool, block_size: int, pattern: Pattern,
         device: torch.device, precision: str, num_splits: int | None, fp8: bool, softcap: bool = False, *,
         values_in_keys: bool = False) -> Plan:
    """The launch of a decode step with this kernel (``block_size``: a paged cache's, else 0; ``pattern``: at the
    cache's capacity; ``precision``: :func:`gstar.kernels.portable.tiles.dot_precision` of q's dtype;
    ``num_splits``: the caller's, or None; ``softcap``: whether the scores are soft-capped; ``values_in_keys``:
    V is a view of K's first lanes, :func:`gstar.kvcache.values_in_keys`)."""
    group = Hq // Hkv
    is_latent = latent(D, Dv, fp8, values_in_keys)
    return _plan(B, Hkv, group, nq, D, Dv, _rows(group * nq, D, Dv, is_latent), paged, block_size, pattern, device,
                 precision, num_splits, fp8, softcap, is_latent=is_latent)


@functools.lru_cache(maxsize=256)
def packed_plans(B: int, Hq: int, Hkv: int, max_q: int, D: int, Dv: int, paged: bool, block_size: int,
                 pattern: Pattern, device: torch.device, precision: str, num_splits: int | None, fp8: bool,
                 softcap: bool = False, *, dtype: torch.dtype, values_in_keys: bool = False) -> tuple[Plan, ...]:
    """The launches of a packed step (``B`` sequences of 0 to ``max_q`` queries each, arguments as :func:`plan`
    takes them, ``pattern`` at ``max_q`` queries, ``dtype`` the queries'): the sequences of at most
    ``SHORT_QUERIES`` queries (as many as one program's rows hold: decode tokens, a few drafts) split their keys
    over programs; the longer ones (prefill chunks) walk them in tiles of consecutive queries, one program per
    tile: the forward kernel's prefill tiles (:func:`gstar.kernels.portable.forward.cache_plan`), or from an FP8
    cache this kernel's (the forward takes FP8 values widened beforehand, a copy of the whole cache). Each launch
    spans the whole batch and skips the other's sequences on the device, so the mix may change from step to step
    without a sync."""
    group = Hq // Hkv
    is_latent = latent(D, Dv, fp8, values_in_keys)
    short_rows = _rows(group * min(max_q, SHORT_QUERIES), D, Dv, is_latent)
    short_q = min(short_rows // group, max_q)
    short = (_plan(B, Hkv, group, short_q, D, Dv, short_rows, paged, block_size, pattern.resized(short_q, pattern.nk),
                   device, precision, num_splits, fp8, softcap, "short", short_q, is_latent),) if short_q else ()
    if max_q <= short_q:
        return short
    if not fp8:
        return short + (cache_plan(B, Hq, Hkv, max_q, D, Dv, dtype, block_size if paged else 0, pattern, device,
                                   precision, softcap, short_q),)
    return short + (_plan(B, Hkv, group, max_q, D, Dv, _rows(group * max_q, D, Dv, False), paged, block_size,
                          pattern, device, precision, 1, fp8, softcap, "long", short_q),)
