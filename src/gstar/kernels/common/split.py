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
def decode_rows(b, heads, split, rows, stride_o, stride_lse, SPLIT: tl.constexpr):
    """Offsets of a decode program's rows (query heads ``heads``, queries ``rows``) in its outputs: the finished
    Out (B, Hq, nq, Dv) and Lse (B, Hq, nq), strides (batch, head, row) and (batch, head), or SPLIT the partials
    (B, Hq, splits, nq, Dv) and (B, Hq, splits, nq), strides (batch, head, split, row) and (batch, head, split):
    ``(out_rows, lse_rows)``."""
    if SPLIT:
        return (b * stride_o[0] + heads * stride_o[1] + split * stride_o[2] + rows * stride_o[3],
                b * stride_lse[0] + heads * stride_lse[1] + split * stride_lse[2] + rows)
    return b * stride_o[0] + heads * stride_o[1] + rows * stride_o[2], b * stride_lse[0] + heads * stride_lse[1] + rows


@triton.jit
def combine(Part, PartLse, Sinks, Out, Lse, stride_p, stride_pl, stride_o, stride_lse, splits,
            VALUE_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr):
    """Grid (nq, Hq, B): row ``(b, h, i)`` from its ``splits`` partials (Part: (B, Hq, splits, nq, VALUE_DIM),
    PartLse: (B, Hq, splits, nq), float32), the learned sink (Sinks: None or (Hq,) float32) added once:
    ``lse = log(sum_s exp(lse_s) + exp(sink))``, ``out = sum_s exp(lse_s - lse) out_s``. PDL: launched as a
    programmatic dependent of the decode kernel, its programs wait here for that kernel's writes."""
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
        sink = sink_logit(Sinks, h)
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


class Plan(NamedTuple):
    """A decode step's launches, as a decode family's plan gives them: ``kernel`` on ``grid`` with its
    constexprs ``options`` and the runtime arguments fixed by the layout (``args``, by name), then, with more
    than one split, :func:`combine` with its constexprs ``merge``."""

    kernel: object
    grid: tuple[int, int, int]
    splits: int
    args: dict
    options: tuple
    merge: tuple


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


def decode(plan: Plan, q, cache, cache_seqlens, added: int, sinks, scale: float, descale=None, out_dtype=None,
           softcap: float = 0.0):
    """``(out, lse)`` of a decode step under ``plan`` (shapes as :func:`gstar.kernels.dispatch.decode_forward`
    takes them; ``cache_seqlens`` given, ``scale`` > 0): the kernel, then the merge of its splits."""
    B, Hq, nq, D = q.shape
    k, v = cache.k, cache.v
    Dv = v.shape[-1]
    out = q.new_empty((B, Hq, nq, Dv), dtype=out_dtype)
    lse = torch.empty((B, Hq, nq), dtype=torch.float32, device=q.device)
    if plan.splits == 1:  # the kernel writes the rows, the learned sink included
        target, target_lse, kernel_sinks = out, lse, sinks
    else:  # each split its partial rows, merged by combine
        target = torch.empty((B, Hq, plan.splits, nq, Dv), dtype=torch.float32, device=q.device)
        target_lse = torch.empty((B, Hq, plan.splits, nq), dtype=torch.float32, device=q.device)
        kernel_sinks = None
    stride_o, stride_lse = tuple(target.stride()[:target.dim() - 1]), tuple(target_lse.stride()[:target_lse.dim() - 1])
    table = cache.block_table
    launch(plan.kernel, plan.grid, {
        **plan.args, "Q": q, "K": k, "V": v, "BlockTable": table, "Seqlens": cache_seqlens, "Sinks": kernel_sinks,
        "Out": target, "Lse": target_lse, "stride_q": tuple(q.stride()[:3]), "stride_k": tuple(k.stride()[:3]),
        "stride_v": tuple(v.stride()[:3]), "stride_bt": table.stride(0) if cache.paged else 0, "stride_o": stride_o,
        "stride_lse": stride_lse, "added": added, **softcap_args(scale, softcap), **descale_args(descale)},
        plan.options)
    if plan.splits > 1:
        launch(combine, (nq, Hq, B), {"Part": target, "PartLse": target_lse, "Sinks": sinks, "Out": out, "Lse": lse,
                                      "stride_p": stride_o, "stride_pl": stride_lse,
                                      "stride_o": tuple(out.stride()[:3]), "stride_lse": tuple(lse.stride()[:2]),
                                      "splits": plan.splits}, plan.merge)
    return out, lse
