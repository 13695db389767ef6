"""The Triton decode kernels: a few queries against a long contiguous or paged cache, split over programs.

``_decode`` runs on a grid ``(splits, Hkv * row_tiles, B)``. A program stacks every query head of one GQA
group and every query row in one tile (row ``r``: head ``hkv * group + r // Nq``, query ``r % Nq``), so each
K/V block is read once for the group. It reads its sequence's length on the device, finds the visible blocks
with :func:`gstar.kernels.ranges.kv_range` (the sink-token blocks, then the window's band), and walks its
share of them: split ``s`` takes the ``s``-th of ``splits`` equal runs. A paged cache is read block by block
through the block table (``BLOCK_N`` divides the block size, so a tile lies in one page). The softmax is the
forward kernel's (:func:`gstar.kernels.forward.softmax_step`). From a contiguous cache it is masked on the blocks
the rule cuts (the sink-token blocks, the band's ends, the last block of the sequence) and unmasked on the whole
blocks between, whose loads carry no masks either; a paged cache's blocks all take the masked loop. An FP8 cache
runs ``P V`` in float16 (:func:`_widen_values`), and ``Q K^T`` in float16 too under 16-bit queries (bfloat16 ones
scaled into its range, :func:`gstar.kernels.widen.half_queries`).

On sm_90 a long FP8 cache, contiguous or paged, takes the Gluon kernel of :mod:`gstar.kernels.hopper_decode`
instead (one warp a program, no shared memory); :func:`_decode_plan` picks, and both share ``_combine``.

With one split a program finishes its rows, the learned sink included. With several, each stores its
partial result (normalised output and LSE, float32) and ``_combine`` merges a row's partials by their LSEs,
adding the sink term once.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..pattern import Pattern, cdiv, kv_blocks
from . import hopper_decode
from .configs import capability_major, dot_precision, pad_head_dim
from .forward import descale_args, finish_state, load_descales, softmax_step, start_state
from .launch import constexprs, launch
from .ranges import ALL_ROWS, decode_program, decode_rows, kv_range
from .widen import half_queries

MAX_TILE_ROWS = 128  # stacked rows (group x queries) a program holds; more take further row tiles
MAX_SPLITS = 64
SPLIT_KEYS = 2048  # keys one split walks at most (while MAX_SPLITS allows): 32 tiles of 64 (the Gluon kernel: its own)
PAGED_REGISTERS = 64  # per thread: a paged 16-bit cache's kernel on Hopper, 16 rows of narrow heads


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
def _widen_values(v, PTX_WIDEN: tl.constexpr):
    """An FP8 value tile (BLOCK_N, DV_PAD) as float16, exactly (every e4m3 value is one). PTX_WIDEN: Ada's and
    Hopper's pair conversion, written as inline PTX that is not pure, so that Triton converts in the layout the
    tile was loaded in and hands the product float16 through shared memory; its own conversion moves into the
    product's operand layout, where an FP8 tile with keys in rows is read from shared memory a byte at a time
    (benchmarks/NOTES.md, 'FP8 decode: the values' layout')."""
    if PTX_WIDEN:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [v], dtype=tl.float16, is_pure=False, pack=4)
    return v.to(tl.float16)


@triton.jit
def _attend(acc, m_i, l_i, q, rows, i_lo, i_hi, blocks, rule, qk_scale, HEAD_DIM: tl.constexpr,
            VALUE_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGED: tl.constexpr, HAS_LEFT: tl.constexpr,
            HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr, PRECISION: tl.constexpr,
            PTX_WIDEN: tl.constexpr, MASKED: tl.constexpr):
    """Fold visible blocks ``i_lo .. i_hi`` (the i-th: sink block i below ``sink_end``, then the band from
    ``band_start``) into the rows' state ``(acc, m_i, l_i)``; q: (BLOCK_R, D_PAD), rows: their query indices.
    ``blocks``: (K, V, BlockTable, b, hkv, sink_end, band_start, stride_k, stride_v, stride_bt, page_size);
    ``rule``: (nq, nk, left, right, sink_tokens). MASKED blocks evaluate the rule per key; the others are
    whole blocks below nk that every row sees, loaded and scored without masks."""
    K, V, BlockTable, b, hkv, sink_end, band_start, stride_k, stride_v, stride_bt, page_size = blocks
    nq, nk, left, right, sink_tokens = rule
    offs_d = tl.arange(0, pad_head_dim(HEAD_DIM))
    offs_dv = tl.arange(0, pad_head_dim(VALUE_DIM))
    offs_n = tl.arange(0, BLOCK_N)
    for i in range(i_lo, i_hi):
        start_n = tl.where(i < sink_end, i, band_start + i - sink_end) * BLOCK_N
        cols = start_n + offs_n  # (BLOCK_N,)
        key_ok = (cols < nk) | (not MASKED)
        k = tl.load(_block_ptrs(K, BlockTable, b, hkv, start_n, offs_n, offs_d, stride_k, stride_bt, page_size,
                                PAGED),
                    mask=key_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)  # (BLOCK_N, D_PAD)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # (BLOCK_R, BLOCK_N) raw scores
        p, alpha, m_i, l_i = softmax_step(s, m_i, l_i, rows, cols, qk_scale, nq, nk, left, right, sink_tokens,
                                          HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, MASKED, True)
        acc = acc * alpha[:, None]
        v = tl.load(_block_ptrs(V, BlockTable, b, hkv, start_n, offs_n, offs_dv, stride_v, stride_bt, page_size,
                                PAGED),
                    mask=key_ok[:, None] & (offs_dv[None, :] < VALUE_DIM), other=0.0)  # (BLOCK_N, DV_PAD)
        if v.dtype == tl.float8e4nv:  # an FP8 cache: P V in float16 (P in FP8 would miss the accuracy bar)
            v = _widen_values(v, PTX_WIDEN)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, m_i, l_i


# lengths, bounds and row counts change between calls: specialising on them would recompile a decode loop
@triton.jit(do_not_specialize=["nq", "group", "added", "left", "right", "sink_tokens", "page_size"])
def _decode(Q, K, V, BlockTable, Seqlens, Sinks, Out, Lse, QDescale, KDescale, VDescale,
            stride_q, stride_k, stride_v, stride_bt, stride_o, stride_lse,
            nq, group, added, left, right, sink_tokens, page_size, qk_scale, stride_ds,
            HEAD_DIM: tl.constexpr, VALUE_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
            PAGED: tl.constexpr, SPLIT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
            HAS_SINK_TOKENS: tl.constexpr, PRECISION: tl.constexpr, PTX_WIDEN: tl.constexpr, PDL: tl.constexpr):
    """Q: (B, Hq, nq, HEAD_DIM); K, V: contiguous (B, Hkv, Nmax, HEAD_DIM / VALUE_DIM) or, with PAGED, (pages,
    page_size, Hkv, ...) read through BlockTable (B, max_blocks) int32; Seqlens: (B,) int32, a sequence's keys
    before the ``added`` appended ones; Sinks: None or (Hq,) float32 (used when not SPLIT).
    Not SPLIT: Out (B, Hq, nq, VALUE_DIM) in Q's dtype, Lse (B, Hq, nq) float32, strides (batch, head, row)
    and (batch, head). SPLIT: Out (B, Hq, splits, nq, VALUE_DIM) and Lse (B, Hq, splits, nq) float32, strides
    (batch, head, split, row) and (batch, head, split): this program's partial, LSE -inf where it saw no key.
    stride_q, stride_k, stride_v: (batch, head, row), or (page, row, head) for a paged cache.
    qk_scale = scale * log2(e) > 0. An FP8 cache (float8_e4m3fn K, V; Q FP8 too, or 16-bit and its keys
    widened to Q's dtype): QDescale, KDescale, VDescale and ``stride_ds`` the descales as
    :func:`gstar.kernels.forward.load_descales` takes them, else None; PTX_WIDEN as :func:`_widen_values` takes it.
    PDL: :func:`_combine` may launch once every program has walked its keys (programmatic dependent launch).
    """
    D_PAD: tl.constexpr = pad_head_dim(HEAD_DIM)
    DV_PAD: tl.constexpr = pad_head_dim(VALUE_DIM)
    split, splits, hkv, tile, b, nk = decode_program(Seqlens, added, group, nq, BLOCK_R)
    qk_scale, v_descale = load_descales(QDescale, KDescale, VDescale, b, hkv, stride_ds, qk_scale)

    offs_r = tile * BLOCK_R + tl.arange(0, BLOCK_R)  # (BLOCK_R,) stacked rows of the group
    real = offs_r < group * nq
    heads = (hkv * group + tl.where(real, offs_r, 0) // nq).to(tl.int64)
    rows = tl.where(real, offs_r, 0) % nq  # query index of each stacked row
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    q_rows = b * stride_q[0] + heads * stride_q[1] + rows * stride_q[2]
    q = tl.load(Q + q_rows[:, None] + offs_d[None, :], mask=real[:, None] & (offs_d[None, :] < HEAD_DIM),
                other=0.0)  # (BLOCK_R, D_PAD)
    if K.dtype.element_ty == tl.float8e4nv and q.dtype == tl.bfloat16:  # an FP8 cache: Q K^T in float16
        q, qk_scale = half_queries(q, qk_scale)

    # the learned sink joins a row's sum once: here with one split, in _combine with several
    if SPLIT:
        acc, m_i, l_i = start_state(None, heads, VALUE_DIM)
    else:
        acc, m_i, l_i = start_state(Sinks, heads, VALUE_DIM)

    sink_end, band_start, full_start, full_end, band_end = kv_range(0, nq, nk, left, right, sink_tokens, ALL_ROWS,
                                                                    BLOCK_N, HAS_LEFT, HAS_RIGHT)
    count = sink_end + band_end - band_start  # the i-th visible block: [0, sink_end), then [band_start, band_end)
    per = tl.cdiv(count, splits)
    lo, hi = split * per, tl.minimum(split * per + per, count)  # this split's share
    blocks = (K, V, BlockTable, b, hkv, sink_end, band_start, stride_k, stride_v, stride_bt, page_size)
    rule = (nq, nk, left, right, sink_tokens)
    # a paged cache's kernel waits on its block-table lookups, and more loops cost it registers and pipeline fills:
    # one masked loop (benchmarks/NOTES.md, 'Decoding: loops and registers of the paged kernel')
    if PAGED:
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, rows, lo, hi, blocks, rule, qk_scale, HEAD_DIM, VALUE_DIM,
                                BLOCK_N, PAGED, HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS, PRECISION, PTX_WIDEN, True)
    else:  # masked, whole and masked blocks, each loop entered only with blocks to walk
        whole, whole_end = sink_end + full_start - band_start, sink_end + full_end - band_start  # the whole blocks' i
        if lo < tl.minimum(hi, whole):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, rows, lo, tl.minimum(hi, whole), blocks, rule, qk_scale,
                                    HEAD_DIM, VALUE_DIM, BLOCK_N, PAGED, HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS,
                                    PRECISION, PTX_WIDEN, True)
        if tl.maximum(lo, whole) < tl.minimum(hi, whole_end):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, rows, tl.maximum(lo, whole), tl.minimum(hi, whole_end),
                                    blocks, rule, qk_scale, HEAD_DIM, VALUE_DIM, BLOCK_N, PAGED, HAS_LEFT,
                                    HAS_RIGHT, HAS_SINK_TOKENS, PRECISION, PTX_WIDEN, False)
        if tl.maximum(lo, whole_end) < hi:
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, rows, tl.maximum(lo, whole_end), hi, blocks, rule, qk_scale,
                                    HEAD_DIM, VALUE_DIM, BLOCK_N, PAGED, HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS,
                                    PRECISION, PTX_WIDEN, True)

    if PDL:  # the combine may launch now (_early_combine): this program's walk is done
        gdc_launch_dependents()
    if VDescale is not None:  # v's descale: one multiply of the finished rows (a split's partial alike)
        acc = acc * v_descale
    out, lse = finish_state(acc, m_i, l_i)  # (BLOCK_R, DV_PAD), (BLOCK_R,)
    value_ok = real[:, None] & (offs_dv[None, :] < VALUE_DIM)
    o_rows, lse_rows = decode_rows(b, heads, split, rows, stride_o, stride_lse, SPLIT)
    tl.store(Out + o_rows[:, None] + offs_dv[None, :], out.to(Out.dtype.element_ty), mask=value_ok)
    tl.store(Lse + lse_rows, lse, mask=real)


@triton.jit
def _combine(Part, PartLse, Sinks, Out, Lse, stride_p, stride_pl, stride_o, stride_lse, splits,
             VALUE_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    """Grid (nq, Hq, B): row ``(b, h, i)`` from its ``splits`` partials (Part: (B, Hq, splits, nq, VALUE_DIM),
    PartLse: (B, Hq, splits, nq), float32), the learned sink (Sinks: None or (Hq,) float32) added once:
    ``lse = log(sum_s exp(lse_s) + exp(sink))``, ``out = sum_s exp(lse_s - lse) out_s``. PDL: launched as a programmatic
    dependent of the decode kernel (:func:`_decode_plan`), its programs wait here for that kernel's writes."""
    if PDL:
        gdc_wait()
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_dv = tl.arange(0, pad_head_dim(VALUE_DIM))
    lse_s = tl.load(PartLse + b * stride_pl[0] + h * stride_pl[1] + offs_s * stride_pl[2] + i,
                    mask=offs_s < splits, other=float("-inf"))  # (SPLITS_PAD,)
    m = tl.max(lse_s, 0)
    if Sinks is not None:
        sink = tl.load(Sinks + h)
        m = tl.maximum(m, sink)
    base = tl.where(m == float("-inf"), 0.0, m)  # a row with no key and no sink: every weight exp(-inf) = 0
    w = tl.exp(lse_s - base)  # (SPLITS_PAD,)
    total = tl.sum(w, 0)
    if Sinks is not None:
        total += tl.exp(sink - base)
    part = tl.load(Part + b * stride_p[0] + h * stride_p[1] + offs_s[:, None] * stride_p[2] + i * stride_p[3]
                   + offs_dv[None, :], mask=(offs_s[:, None] < splits) & (offs_dv[None, :] < VALUE_DIM),
                   other=0.0)  # (SPLITS_PAD, DV_PAD)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + b * stride_o[0] + h * stride_o[1] + i * stride_o[2] + offs_dv, out.to(Out.dtype.element_ty),
             mask=offs_dv < VALUE_DIM)
    tl.store(Lse + b * stride_lse[0] + h * stride_lse[1] + i, tl.where(total == 0.0, float("-inf"),
                                                                      base + tl.log(total)))


class _DecodePlan(NamedTuple):
    kernel: object  # _decode, or hopper_decode._decode (registers=True)
    grid: tuple[int, int, int]
    splits: int
    options: tuple
    combine: tuple  # _combine's constexprs (splits > 1)


def block_keys(paged: bool, block_size: int, width: int, fp8: bool) -> int:
    """Keys per tile: 64, fewer for wide heads (``width``: the padded D + Dv; a tile of keys and values stays
    within 64 x 256 elements), twice as many from an FP8 cache (the same bytes; 5-9% faster at long caches,
    benchmarks/NOTES.md, 'FP8 decode tiles'); for a paged cache a divisor of its block size."""
    most = max(16, 64 * 256 // width) * (2 if fp8 else 1)
    return next(n for n in (128, 64, 32, 16) if n <= min(most, 128 if fp8 else 64)
                and (not paged or block_size % n == 0))


def tile_rows(stacked: int, width: int) -> int:
    """Rows a program stacks: the group's heads times the queries, padded to a power of two (at least 16,
    tl.dot's minimum), at most 128, and fewer for wide heads (the accumulators hold rows x padded Dv)."""
    most = max(16, min(MAX_TILE_ROWS, triton.next_power_of_2(128 * 256 // width + 1) // 2))  # a power of two
    return min(most, max(16, triton.next_power_of_2(stacked)))


def default_splits(programs: int, visible_blocks: int, block_n: int, device: torch.device) -> int:
    """Splits per (sequence, kv head): at most ``SPLIT_KEYS`` keys a split (of ``visible_blocks`` tiles of
    ``block_n``), and enough programs for two per SM where every split still gets four tiles. It sees the
    shapes and the card, never the lengths: a ragged batch is split by its capacity, which keeps its longest
    sequences from setting the time (benchmarks/NOTES.md, 'Decoding: splits and pipeline depth')."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    fill = min(cdiv(2 * sms, programs), cdiv(visible_blocks, 4))
    return max(1, min(max(fill, cdiv(visible_blocks * block_n, SPLIT_KEYS)), MAX_SPLITS))


def _visible_blocks(pattern: Pattern, nq: int, block_n: int) -> int:
    """The blocks of ``block_n`` keys a full cache's queries see (the sink-token blocks and the band); at a
    shorter length a window's band may straddle one block more."""
    sink_end, band_start, _, _, band_end = kv_blocks(pattern, 0, nq, block_n)
    return sink_end + band_end - band_start + (pattern.left >= 0)


def _nvidia(device: torch.device) -> bool:
    """An NVIDIA GPU (CUDA, not ROCm): where inline PTX and programmatic dependent launches exist."""
    return device.type == "cuda" and torch.version.hip is None


def _early_combine(device: torch.device) -> bool:
    """Whether :func:`_combine` launches as a programmatic dependent of the decode kernel (CUDA, sm_90 and
    newer): its launch and its programs' start then overlap the decode kernel's last programs instead of
    following them."""
    return _nvidia(device) and capability_major(device) >= 9


@functools.lru_cache(maxsize=256)
def _decode_plan(B: int, Hq: int, Hkv: int, nq: int, D: int, Dv: int, paged: bool, block_size: int,
                 capacity: int, pattern: Pattern, device: torch.device, precision: str,
                 num_splits: int | None, fp8: bool, registers: bool) -> _DecodePlan:
    """The launch of a decode step: Triton's kernel, or the Gluon one (one warp a program) where it serves the
    call (``registers``: :func:`gstar.kernels.hopper_decode.serves`) and the queries see at least
    ``hopper_decode.MIN_KEYS`` keys of a full cache; then, with splits, :func:`_combine`."""
    group = Hq // Hkv
    pdl = _early_combine(device)

    def combine(splits):
        return constexprs(VALUE_DIM=Dv, SPLITS_PAD=triton.next_power_of_2(splits), PDL=pdl, num_warps=4,
                          launch_pdl=pdl)

    if registers:
        block_n = hopper_decode.BLOCK_N.value
        visible_blocks = _visible_blocks(pattern, nq, block_n)
        if visible_blocks * block_n >= hopper_decode.MIN_KEYS:
            splits = num_splits or hopper_decode.splits(B * Hkv, visible_blocks, device)
            return _DecodePlan(
                hopper_decode._decode, (splits, Hkv, B), splits,
                constexprs(HEAD_DIM=D, VALUE_DIM=Dv, SPLIT=splits > 1, HAS_LEFT=pattern.left >= 0,
                           HAS_RIGHT=pattern.right >= 0,
                           HAS_SINK_TOKENS=pattern.left >= 0 and pattern.sink_tokens > 0,
                           KEY_WORDS=(Hkv * D if paged else D) // 4, PAGE=block_size if paged else 0,
                           LINES=hopper_decode.lines(paged, visible_blocks * block_n, splits), num_warps=1,
                           maxnreg=hopper_decode.REGISTERS), combine(splits))
    width = pad_head_dim(D) + pad_head_dim(Dv)
    block_r = tile_rows(group * nq, width)
    block_n = block_keys(paged, block_size, width, fp8)
    row_tiles = cdiv(group * nq, block_r)
    visible_blocks = _visible_blocks(pattern, nq, block_n)
    splits = num_splits or default_splits(B * Hkv * row_tiles, visible_blocks, block_n, device)
    major = capability_major(device) if device.type == "cuda" else 0
    stages = 3 if major >= 9 else 2  # Hopper: three tiles in flight
    # a paged 16-bit cache, 16 rows of narrow heads, on Hopper (where measured): 64 registers (no spills) fit
    # eight programs an SM where the compiler's 80 fit six, more block-table lookups in flight
    # (benchmarks/NOTES.md, 'Decoding: loops and registers of the paged kernel')
    capped = major == 9 and paged and not fp8 and block_r <= 16 and width <= 128
    cap = {"maxnreg": PAGED_REGISTERS} if capped else {}
    return _DecodePlan(
        _decode, (splits, Hkv * row_tiles, B), splits,
        constexprs(HEAD_DIM=D, VALUE_DIM=Dv, BLOCK_R=block_r, BLOCK_N=block_n, PAGED=paged, SPLIT=splits > 1,
                   HAS_LEFT=pattern.left >= 0, HAS_RIGHT=pattern.right >= 0,
                   HAS_SINK_TOKENS=pattern.left >= 0 and pattern.sink_tokens > 0, PRECISION=precision,
                   PTX_WIDEN=fp8 and _nvidia(device), PDL=pdl,
                   num_warps=4, num_stages=stages, **cap), combine(splits))


def decode_forward(q, cache, cache_seqlens, added: int, sinks, pattern: Pattern, scale: float,
                   num_splits: int | None, descale=None, out_dtype=None):
    """``(out, lse)`` of :func:`gstar.flash_attention_with_kvcache` on validated inputs (the cache already
    appended to). ``cache``: a :class:`gstar.kvcache.Cache`; ``cache_seqlens``: (B,) int32 or None (every
    sequence full); ``added``: keys appended this call; ``pattern``: nq and the window (its nk is unused:
    each sequence's is read on the device); ``sinks``: None or (Hq,) float32. An FP8 cache: ``descale`` the
    descales of q, k and v, each None (1) or a float32 (B, Hkv) view (:func:`gstar.fp8.check`), and
    ``out_dtype`` (default q's dtype)."""
    B, Hq, nq, D = q.shape
    k, v = cache.k, cache.v
    Hkv, Dv = (k.shape[2] if cache.paged else k.shape[1]), v.shape[-1]
    if cache_seqlens is None:
        cache_seqlens = torch.full((B,), cache.capacity - added, dtype=torch.int32, device=q.device)
    q_in = q
    if scale <= 0:  # the kernel's softmax takes a positive factor (as the forward kernel's does)
        q_in, scale = (-q, -scale) if scale < 0 else (q * 0.0, 1.0)
    registers = hopper_decode.serves(q, k, v, cache.paged, Hq // Hkv * nq)
    plan = _decode_plan(B, Hq, Hkv, nq, D, Dv, cache.paged, cache.block_size if cache.paged else 0,
                        cache.capacity, pattern, q.device, dot_precision(q.dtype), num_splits,
                        k.dtype == torch.float8_e4m3fn, registers)
    out = q.new_empty((B, Hq, nq, Dv), dtype=out_dtype)
    lse = torch.empty((B, Hq, nq), dtype=torch.float32, device=q.device)
    if plan.splits == 1:  # the kernel writes the rows, the learned sink included
        target, target_lse, kernel_sinks = out, lse, sinks
    else:  # each split its partial rows, merged by _combine
        target = torch.empty((B, Hq, plan.splits, nq, Dv), dtype=torch.float32, device=q.device)
        target_lse = torch.empty((B, Hq, plan.splits, nq), dtype=torch.float32, device=q.device)
        kernel_sinks = None
    descales, descale_strides = descale_args(descale)
    strides = (tuple(q_in.stride()[:3]), tuple(k.stride()[:3]), tuple(v.stride()[:3]))
    outputs = (tuple(target.stride()[:target.dim() - 1]), tuple(target_lse.stride()[:target_lse.dim() - 1]))
    bounds = (nq, Hq // Hkv, added, pattern.left, pattern.right, pattern.sink_tokens)
    qk_scale = scale * math.log2(math.e)
    table = cache.block_table
    # Triton's kernel takes the page size at run time, the Gluon one as a constexpr (in plan.options)
    page = () if plan.kernel is hopper_decode._decode else (cache.block_size if cache.paged else 1,)
    launch(plan.kernel, plan.grid, (q_in, k, v, table, cache_seqlens, kernel_sinks, target, target_lse, *descales),
           (*strides, table.stride(0) if cache.paged else 0, *outputs, *bounds, *page, qk_scale, descale_strides),
           plan.options)
    if plan.splits > 1:
        launch(_combine, (nq, Hq, B), (target, target_lse, sinks, out, lse),
               (outputs[0], outputs[1], tuple(out.stride()[:3]), tuple(lse.stride()[:2]), plan.splits),
               plan.combine)
    return out, lse
