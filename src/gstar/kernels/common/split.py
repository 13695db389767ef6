"""Split-KV decoding, shared by both decode kernels: where a program works on its grid (:func:`decode_program`),
where its rows go (:func:`decode_rows`), and :func:`combine`, which merges a row's split partials by their LSEs,
the learned sink counted once; and the host's side of a step (:class:`Plan`, :func:`decode`), whichever kernel
the dispatcher chose."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ...pattern import Pattern, kv_blocks
from .. import card
from ..launch import constexprs, launch
from .fp8 import descale_args
from .rule import sequence_bounds
from .sizes import pad_head_dim
from .softmax import sink_logit, softcap_args



@triton.jit
def decode_program(Seqlens, added, group, nq, BLOCK_R: tl.constexpr):
    """Where a decode program works, on its grid ``(splits, Hkv * row_tiles, B)`` (kv heads fastest, then the
    row tiles of ``BLOCK_R`` of the group's ``group * nq`` stacked rows): ``(split, splits, hkv, tile, b, nk)``,
    ``b`` int64 and ``nk`` its sequence's keys (Seqlens: (B,) int32, before the ``added`` appended ones)."""
    kv_heads = tl.num_programs(1) // tl.cdiv(group * nq, BLOCK_R)
    b = tl.program_id(2).to(tl.int64)
    return (tl.program_id(0), tl.num_programs(0), tl.program_id(1) % kv_heads, tl.program_id(1) // kv_heads, b,
            tl.load(Seqlens + b) + added)


@triton.jit
def decode_rows(b, heads, split, rows, q_start, stride_o, stride_lse, SPLIT: tl.constexpr):
    """Offsets of a decode program's rows (query heads ``heads``, queries ``rows`` of sequence ``b``, whose first
    query is row ``q_start`` of a packed batch, else 0) in its outputs: the finished Out (B, Hq, nq, Dv) and Lse
    (B, Hq, nq), strides (batch, head, row) and (batch, head) (packed: (total_q, Hq, Dv) and (Hq, total_q),
    strides (0, head, row) and (0, head)), or SPLIT the partials (B, Hq, splits, rows, Dv) and (B, Hq, splits,
    rows), strides (batch, head, split, row) and (batch, head, split): ``(out_rows, lse_rows)``."""
    if SPLIT:
        return (b * stride_o[0] + heads * stride_o[1] + split * stride_o[2] + rows * stride_o[3],
                b * stride_lse[0] + heads * stride_lse[1] + split * stride_lse[2] + rows)
    return (b * stride_o[0] + heads * stride_o[1] + (q_start + rows) * stride_o[2],
            b * stride_lse[0] + heads * stride_lse[1] + q_start + rows)


@triton.jit
def combine(Part, PartLse, Sinks, CuQ, Out, Lse, stride_p, stride_pl, stride_o, stride_lse, splits,
            VALUE_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    """Grid (rows, Hq, B): row ``(b, h, i)`` from its ``splits`` partials (Part: (B, Hq, splits, rows,
    VALUE_DIM), PartLse: (B, Hq, splits, rows), float32), the learned sink (Sinks: None or (Hq,) float32) added
    once: ``lse = log(sum_s exp(lse_s) + exp(sink))``, ``out = sum_s exp(lse_s - lse) out_s``. Out and Lse as
    :func:`decode_rows` lays them out; packed (CuQ (B + 1,) int32), only the sequences of at most ``rows``
    queries were split, and only theirs are merged. PDL: launched as a programmatic dependent of the decode
    kernel, its programs wait here for that kernel's writes."""
    if PDL:
        gdc_wait()
    i = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    q_start, seq_q = sequence_bounds(CuQ, b, tl.num_programs(0), CuQ is not None)
    ok = (i < seq_q) & (seq_q <= tl.num_programs(0))  # a row of a split sequence
    live = tl.where(ok, splits, 0)  # the partials to read: none for another row (a vector mask, not a scalar's)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_dv = tl.arange(0, pad_head_dim(VALUE_DIM))
    lse_s = tl.load(PartLse + b * stride_pl[0] + h * stride_pl[1] + offs_s * stride_pl[2] + i,
                    mask=offs_s < live, other=float("-inf"))  # (SPLITS_PAD,)
    m = tl.max(lse_s, 0)
    if Sinks is not None:
        sink = sink_logit(Sinks, h)
        m = tl.maximum(m, sink)
    base = tl.where(m == float("-inf"), 0.0, m)  # a row with no key and no sink: every weight exp(-inf) = 0
    w = tl.exp(lse_s - base)  # (SPLITS_PAD,)
    total = tl.sum(w, 0)
    if Sinks is not None:
        total += tl.exp(sink - base)
    part = tl.load(Part + b * stride_p[0] + h * stride_p[1] + offs_s[:, None] * stride_p[2] + i * stride_p[3]
                   + offs_dv[None, :], mask=(offs_s[:, None] < live) & (offs_dv[None, :] < VALUE_DIM),
                   other=0.0)  # (SPLITS_PAD, DV_PAD)
    out = tl.sum(part * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    row = q_start + i
    tl.store(Out + b * stride_o[0] + h * stride_o[1] + row * stride_o[2] + offs_dv, out.to(Out.dtype.element_ty),
             mask=offs_dv < tl.where(ok, VALUE_DIM, 0))
    tl.store(Lse + b * stride_lse[0] + h * stride_lse[1] + row, tl.where(total == 0.0, float("-inf"),
                                                                        base + tl.log(total)), mask=ok)


class Plan(NamedTuple):
    """One launch of a decode step, as a decode family's plan gives it: ``kernel`` on ``grid`` with its
    constexprs ``options`` and the runtime arguments fixed by the layout (``args``, by name), then, with more
    than one split, :func:`combine` with its constexprs ``merge`` over partials of ``rows`` queries a sequence.
    ``slot_rows`` (a packed step's long launch): the grid's axis 0 grows by one program per ``slot_rows`` of
    the step's ``total_q * group`` stacked rows."""

    kernel: object
    grid: tuple[int, int, int]
    splits: int
    args: dict
    options: tuple
    merge: tuple
    rows: int
    slot_rows: int = 0


def visible_blocks(pattern: Pattern, nq: int, block_n: int) -> int:
    """The blocks of ``block_n`` keys a full cache's queries see (the sink-token blocks and the band); at a
    shorter length a window's band may straddle one block more."""
    sink_end, band_start, _, _, band_end = kv_blocks(pattern, 0, nq, block_n)
    return sink_end + band_end - band_start + pattern.has_left


def early_combine(device: torch.device) -> bool:
    """Whether :func:`combine` launches as a programmatic dependent of the decode kernel (NVIDIA, sm_90 and
    newer): its launch and its programs' start then overlap the decode kernel's last programs."""
    return card.nvidia(device) and card.capability_major(device) >= 9


def merge_options(value_dim: int, splits: int, device: torch.device) -> tuple:
    """:func:`combine`'s constexprs and launch options for ``splits`` partials of rows ``value_dim`` wide."""
    pdl = early_combine(device)
    return constexprs(VALUE_DIM=value_dim, SPLITS_PAD=triton.next_power_of_2(splits), PDL=pdl, num_warps=4,
                      launch_pdl=pdl)


def decode(plans: tuple[Plan, ...], q, cache, cache_seqlens, added: int, sinks, scale: float, descale=None,
           out_dtype=None, softcap: float = 0.0, cu_seqlens_q=None):
    """``(out, lse)`` of a decode step under ``plans`` (shapes as :func:`gstar.kernels.dispatch.decode_forward`
    takes them; ``cache_seqlens`` given, ``scale`` > 0): each launch, then the merge of its splits. Dense q (B,
    Hq, nq, D) gives out (B, Hq, nq, Dv) and lse (B, Hq, nq); packed q (total_q, Hq, D) with ``cu_seqlens_q``
    gives out (total_q, Hq, Dv) and lse (Hq, total_q)."""
    packed = cu_seqlens_q is not None
    Hq, Dv = q.shape[-2 if packed else 1], cache.v.shape[-1]
    if packed:  # a packed row's offset: (q_start + row) * its stride, no batch term
        out = q.new_empty((q.shape[0], Hq, Dv), dtype=out_dtype)                     # (total_q, Hq, Dv)
        lse = torch.empty((Hq, q.shape[0]), dtype=torch.float32, device=q.device)    # (Hq, total_q)
        stride_q, stride_out, stride_lse = (0, q.stride(1), q.stride(0)), (0, out.stride(1), out.stride(0)), (
            0, lse.stride(0))
    else:
        out = q.new_empty((*q.shape[:3], Dv), dtype=out_dtype)                        # (B, Hq, nq, Dv)
        lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)          # (B, Hq, nq)
        stride_q, stride_out, stride_lse = tuple(q.stride()[:3]), tuple(out.stride()[:3]), tuple(lse.stride()[:2])
    B, k, v, table = cache_seqlens.shape[0], cache.k, cache.v, cache.block_table
    group = Hq // (k.shape[2] if cache.paged else k.shape[1])
    common = {"Q": q, "K": k, "V": v, "BlockTable": table, "Seqlens": cache_seqlens, "CuQ": cu_seqlens_q,
              "stride_q": stride_q, "stride_k": tuple(k.stride()[:3]), "stride_v": tuple(v.stride()[:3]),
              "stride_bt": table.stride(0) if cache.paged else 0, "added": added, **softcap_args(scale, softcap),
              **descale_args(descale)}
    for plan in plans:
        grid = plan.grid
        if plan.slot_rows:
            grid = (grid[0] + q.shape[0] * group // plan.slot_rows, *grid[1:])
        if plan.splits == 1:  # the kernel writes the rows, the learned sink included
            launch(plan.kernel, grid, {**plan.args, **common, "Sinks": sinks, "Out": out, "Lse": lse,
                                            "stride_o": stride_out, "stride_lse": stride_lse}, plan.options)
            continue
        # each split its partial rows, merged by combine
        part = torch.empty((B, Hq, plan.splits, plan.rows, Dv), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((B, Hq, plan.splits, plan.rows), dtype=torch.float32, device=q.device)
        stride_p, stride_pl = tuple(part.stride()[:4]), tuple(part_lse.stride()[:3])
        launch(plan.kernel, grid, {**plan.args, **common, "Sinks": None, "Out": part, "Lse": part_lse,
                                        "stride_o": stride_p, "stride_lse": stride_pl}, plan.options)
        launch(combine, (plan.rows, Hq, B), {"Part": part, "PartLse": part_lse, "Sinks": sinks,
                                             "CuQ": cu_seqlens_q, "Out": out, "Lse": lse, "stride_p": stride_p,
                                             "stride_pl": stride_pl, "stride_o": stride_out,
                                             "stride_lse": stride_lse, "splits": plan.splits}, plan.merge)
    return out, lse
