"""The host side of the attention kernels: :func:`attention_forward` and :func:`attention_backward` (what
``gstar.ops`` calls), each deriving its launches once per layout (a cached plan: grid, strides, constexprs,
the dK/dV work table) so that a call costs a cache lookup, its output allocations and the launches.

Nothing here reads a tensor's values or synchronises with the device, so every call can be captured in a
CUDA graph; the kernels are in :mod:`.forward` (with :mod:`.hopper`, the forward that sm_90 takes where it
is faster) and :mod:`.backward`, their tile tables in :mod:`.configs`,
the dK/dV work split in :mod:`.schedule`, the launches themselves in :mod:`.launch`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from ..pattern import Pattern, cdiv, kv_block_table
from .. import buffers
from . import descriptors, hopper, hopper_backward
from .backward import _dkdv, _dq, _sum_partials
from .configs import BackwardConfig, backward_config, dot_precision, forward_config, pad_head_dim
from .forward import _forward_kernel, descale_args, tiles_fastest
from .launch import constexprs, launch
from .schedule import split_plan
from .widen import widen

LOG2E = math.log2(math.e)


def batch_strides(stride: tuple, varlen: bool) -> tuple:
    """The (batch, head, row) strides a kernel takes, as one argument, from a tensor's ``stride()``: packed
    sequences are found through cu_seqlens, not a batch stride."""
    return (0, *stride[1:3]) if varlen else tuple(stride[:3])


class _ForwardPlan(NamedTuple):
    """What a forward launch needs besides the data, derived once per layout by :func:`_forward_plan`."""

    grid: tuple[int, int, int]
    lse_shape: tuple[int, int, int]
    head: tuple   # scalars before Out's strides: the strides of q, k, v
    tail: tuple   # scalars after them: Lse's strides, group, Nq, Nk, left, right, sink_tokens, qk_scale (the
                  # descales' strides follow at each call: views the caller made)
    options: tuple  # constexprs and launch options


@functools.lru_cache(maxsize=256)
def _forward_plan(q_shape: tuple, q_stride: tuple, k_shape: tuple, k_stride: tuple, v_shape: tuple,
                  v_stride: tuple, dtype: torch.dtype, device: torch.device, pattern: Pattern, scale: float,
                  seqs: int | None, config: tuple | None, precision: str) -> _ForwardPlan:
    """The launch of one layout (shapes, strides, dtype, pattern; ``seqs``: the number of packed sequences,
    None for a dense batch; ``config``: the caller's overrides as sorted items). A cache hit costs a few
    us, where deriving the launch costs tens at every call, more than a small layer's GPU time."""
    B, Hq, Nq, D = q_shape
    Hkv, Nk, Dv = k_shape[1], k_shape[2], v_shape[3]
    varlen = seqs is not None
    cfg = forward_config(D, dtype, pattern, device, group=Hq // Hkv, value_dim=Dv)
    cfg.update(config or ())
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    pack = math.gcd(cfg["PACK_GQA"], Hq // Hkv, block_m)
    rows = block_m // pack  # positions per tile and head
    has_left, has_right = pattern.left >= 0, pattern.right >= 0
    grid = (Hq // pack, cdiv(pattern.nq, rows), seqs if varlen else B)
    if tiles_fastest(has_left, has_right):  # the kernel reads its grid axes by the same rule
        grid = (grid[1], grid[0], grid[2])
    return _ForwardPlan(
        grid, (B, Hq, Nq), tuple(batch_strides(s, varlen) for s in (q_stride, k_stride, v_stride)),
        ((0 if varlen else Hq * Nq, Nq), Hq // Hkv, Nq, Nk, pattern.left, pattern.right, pattern.sink_tokens,
         scale * LOG2E),
        constexprs(
            HEAD_DIM=D, VALUE_DIM=Dv, BLOCK_M=block_m, BLOCK_N=block_n, PACK=pack, HAS_LEFT=has_left, HAS_RIGHT=has_right,
            HAS_SINK_TOKENS=pattern.sink_tokens > 0, FLAT=bool(cfg["FLAT"]), HALVES=bool(cfg["HALVES"]),
            PRECISION=precision, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"]))


def attention_forward(q, k, v, sinks, pattern: Pattern, scale: float, config: dict | None = None, *,
                      cu_seqlens: tuple[torch.Tensor, torch.Tensor] | None = None, descale=None, out_dtype=None):
    """Attention forward on validated inputs; returns ``(out, lse)``.

    Dense: q: (B, Hq, Nq, D); k: (B, Hkv, Nk, D); v: (B, Hkv, Nk, Dv); pattern: the normalised
    :class:`Pattern` of the batch. Packed (``cu_seqlens=(cu_q, cu_k)``, each (num_seqs + 1,) int32 on q's
    device): q: (1, Hq, total_q, D), k, v: (1, Hkv, total_k, D or Dv) (heads-first views of the packed
    tensors), and ``pattern``
    carries the window and the longest lengths (max_seqlen_q, max_seqlen_k); each sequence gets its own
    pattern inside the kernel, with nothing read on the host.
    float16/bfloat16/float32, any strides with unit last stride (never copied). sinks: None or (Hq,)
    float32, unscaled. scale: any finite float. ``config`` overrides :func:`forward_config` (same keys;
    missing switches take its defaults), for tests and tuning, and keeps the portable kernel where sm_90 would
    take :mod:`.hopper`'s; ``PACK_GQA`` is a request that shrinks to the
    largest power of two dividing the GQA group.

    FP8 (float8_e4m3fn q, k, v): ``descale`` the descales of q, k and v, each None (1) or a float32 (B or
    num_seqs, Hkv) tensor, any strides (positive values; :func:`gstar.fp8.check`); ``out_dtype`` the output's
    dtype (16 or 32 bits). ``P V`` runs in bfloat16 (P in FP8 misses the accuracy bar, docs/design.md section
    4), so V is widened first, exactly (every e4m3 value is a bfloat16 value), in one streaming pass: faster
    than widening each block in the loop (benchmarks/NOTES.md, 'FP8: V widened before both forward kernels').

    out: (B, Hq, Nq, Dv) in q's dtype (or out_dtype), zero rows where no key is visible; dense: in q's memory layout,
    packed: a heads-first view of a contiguous (total_q, Hq, Dv) tensor.
    lse: (B, Hq, Nq), or (1, Hq, total_q) when packed, float32 contiguous natural-log logsumexp with the
    sink term; ``-inf`` (or ``sinks[h]``) for rows that see no key.
    """
    varlen = cu_seqlens is not None
    out = (buffers.empty_packed_like if varlen else buffers.empty_like)(q, dtype=out_dtype, width=v.shape[3])
    q_in = q
    if scale <= 0:
        # the kernel scales each block's max over raw scores, which needs a positive factor: the sign of the
        # scale, or a zero scale, goes into a copy of q (in the kernel, a scaled Q tile would leave shared
        # memory for registers and cost every block of every call)
        q_in, scale = (-q, -scale) if scale < 0 else (q * 0.0, 1.0)
    if descale is not None:
        v = widen(v, torch.bfloat16)                                               # (B, Hkv, Nk, Dv)
    if config is None and hopper.supported(q_in, k, v, pattern, varlen):
        lse = buffers.empty(q.shape[:3], dtype=torch.float32, device=q.device)    # (B, Hq, Nq)
        hopper.forward(q_in, k, v, sinks, out, lse, pattern, scale, cu_seqlens, descale)
        return out, lse
    plan = _forward_plan(q_in.shape, q_in.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, pattern,
                         scale, cu_seqlens[0].shape[0] - 1 if varlen else None,
                         tuple(sorted(config.items())) if config else None, dot_precision(q.dtype))
    lse = buffers.empty(plan.lse_shape, dtype=torch.float32, device=q.device)      # (B, Hq, Nq)
    cu_q, cu_k = cu_seqlens if varlen else (None, None)
    descales, descale_strides = descale_args(descale)
    launch(_forward_kernel, plan.grid, (q_in, k, v, sinks, out, lse, cu_q, cu_k, *descales),
           (*plan.head, batch_strides(out.stride(), varlen), *plan.tail, descale_strides), plan.options)
    return out, lse


class _BackwardPlan(NamedTuple):
    """What the backward's launches need besides the data, derived once per layout by :func:`_backward_plan`.
    Scalar tuples are split around the strides of the gradients, which are read from them at each call."""

    stats_shape: tuple          # delta and lse2: (2, B, Hq, Nq) float32
    shares_shape: tuple | None  # dsinks shares: (seqs, n_q_tiles, Hq) float32, None without sinks
    partials_shapes: tuple | None  # dK, dV partials: (B, Hkv, head_splits, n_items, dkdv_n, D_PAD or DV_PAD)
    dq_grid: tuple
    dq_head: tuple              # strides of q, k, v, out, dout
    dq_tail: tuple              # strides of dLSE and LSE, Nq, Nk, left, right, sink_tokens, scale, qk_scale
    dq_options: tuple           # constexprs, without and with descriptors
    stats_options: tuple        # the dQ kernel's row statistics alone (for hopper_backward)
    dq_tma: bool
    kv_table: torch.Tensor | None
    dkdv_grid: tuple
    dkdv_head: tuple            # strides of q, k, v, dout
    dkdv_tail: tuple            # strides of LSE, Nq, Nk, head_splits, n_items, n_shares, left, ..., qk_scale
    dkdv_options: tuple
    dkdv_tma: bool
    work: torch.Tensor | None
    sum_grid: tuple | None      # _sum_partials, when the dK/dV work is split
    sum_tail: tuple
    sum_options: tuple
    first: torch.Tensor | None
    dq_tiles: tuple             # descriptor blocks of K and V: (1, 1, dq_n, D_PAD or DV_PAD)
    dkdv_tiles: tuple           # of Q and dO: (1, 1, dkdv_m, D_PAD or DV_PAD)


@functools.lru_cache(maxsize=256)
def _backward_plan(q_shape: tuple, q_stride: tuple, k_shape: tuple, k_stride: tuple, v_shape: tuple,
                   v_stride: tuple, o_stride: tuple, do_stride: tuple, dlse_stride: tuple | None, dtype: torch.dtype,
                   device: torch.device, has_sinks: bool, pattern: Pattern, scale: float, seqs: int | None,
                   config: BackwardConfig | None, precision: str) -> _BackwardPlan:
    """The launches of one layout (as :func:`_forward_plan`; ``dlse_stride`` None without an LSE gradient)."""
    B, Hq, Nq, D = q_shape
    Hkv, Nk, Dv = k_shape[1], k_shape[2], v_shape[3]
    group = Hq // Hkv
    varlen = seqs is not None
    cfg = config or backward_config(D, dtype, pattern, device, batch_heads=B * Hq, group=group, value_dim=Dv)
    d_pad, dv_pad = pad_head_dim(D), pad_head_dim(Dv)
    shared = dict(
        HAS_LEFT=pattern.left >= 0, HAS_RIGHT=pattern.right >= 0, HAS_SINK_TOKENS=pattern.sink_tokens > 0,
        PRECISION=precision, GROUP=group, HEAD_DIM=D, VALUE_DIM=Dv, FLAT=cfg.flat,
    )
    runtime = (pattern.left, pattern.right, pattern.sink_tokens, float(scale), scale * LOG2E)
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

    if varlen:
        head_splits, work, first = 1, None, None
        n_items = n_tiles = cdiv(pattern.nk, cfg.dkdv_n)
    else:
        head_splits, work, first = split_plan(pattern, cfg.dkdv_m, cfg.dkdv_n, group, Hkv * B, device,
                                              head_splits=cfg.head_splits, q_chunk=cfg.q_chunk)
        n_tiles, n_items = first.shape[0] - 1, work.shape[0]
    split = head_splits > 1 or n_items > n_tiles
    dkdv_options = [constexprs(SPLIT=split, BLOCK_M=cfg.dkdv_m, BLOCK_N=cfg.dkdv_n, num_warps=cfg.dkdv_warps,
                               num_stages=cfg.dkdv_stages, TMA=tma, **shared) for tma in (False, True)]
    return _BackwardPlan(
        stats_shape=(2, B, Hq, Nq),
        shares_shape=(programs, n_q_tiles, Hq) if has_sinks else None,
        partials_shapes=tuple((B, Hkv, head_splits, n_items, cfg.dkdv_n, pad) for pad in (d_pad, dv_pad))
        if split else None,
        dq_grid=(n_q_tiles, Hq // pack, programs),
        dq_head=(q_s, k_s, v_s, o_s, do_s),
        dq_tail=(dl_s, lse_strides, Nq, Nk, *runtime),
        dq_options=tuple(dq_options), dq_tma=cfg.dq_tma and not varlen,
        stats_options=dq_options[0] + (("STATS_ONLY", True),),
        kv_table=None if varlen else kv_block_table(pattern, rows, cfg.dq_n, device),  # (n_q_tiles, 5)
        dkdv_grid=(n_items, Hkv * head_splits, programs),
        dkdv_head=(q_s, k_s, v_s, do_s),
        dkdv_tail=(lse_strides, Nq, Nk, head_splits, n_items, programs * n_q_tiles, *runtime),
        dkdv_options=tuple(dkdv_options), dkdv_tma=cfg.dkdv_tma and not varlen, work=work,
        sum_grid=(n_tiles, Hkv, B) if split else None,
        sum_tail=(Hkv, Nk, head_splits, n_items),
        sum_options=constexprs(BLOCK_N=cfg.dkdv_n, HEAD_DIM=D, VALUE_DIM=Dv, num_warps=4),
        first=first, dq_tiles=tuple((1, 1, cfg.dq_n, pad) for pad in (d_pad, dv_pad)),
        dkdv_tiles=tuple((1, 1, cfg.dkdv_m, pad) for pad in (d_pad, dv_pad)),
    )


def attention_backward(dout, q, k, v, out, lse, dlse, sinks, pattern: Pattern, scale: float, *,
                       config: BackwardConfig | None = None,
                       cu_seqlens: tuple[torch.Tensor, torch.Tensor] | None = None, deterministic: bool = True):
    """Gradients of attention (docs/design.md section 1) from the forward's output and LSE.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``; dout, out: ``(B, Hq, Nq,
            Dv)``; any strides with unit last stride (never copied).
        lse: ``(B, Hq, Nq)`` float32 contiguous, natural log, sink term included (``-inf`` for empty rows).
        dlse: ``None`` or ``(B, Hq, Nq)`` gradient of the returned LSE (any strides and float dtype).
        sinks: ``None`` or ``(Hq,)`` float32 learned sink logits.
        pattern: the normalised :class:`gstar.pattern.Pattern`; scale: multiplies ``q . k``.
        config: a :class:`BackwardConfig` overriding :func:`backward_config` (tests use other tiles, splits
            and loop forms; scripts/tune-backward sweeps them).
        cu_seqlens: ``(cu_q, cu_k)`` for packed sequences, as in
            :func:`attention_forward` (B = 1, the sequence axis is total_q / total_k,
            ``pattern`` holds the longest lengths). The dK/dV work is never split then.
        deterministic: sm_90 takes :mod:`.hopper_backward` (five products per tile pair instead of seven)
            for the calls it serves (``hopper_backward.serves``): with the flag (the default) each dQ tile's adds in a
            fixed order; without it in any order (dQ's last bits vary from run to run). Elsewhere the flag
            changes nothing.

    Returns ``(dq, dk, dv, dsinks)``: dq like q, dk like k, dv like v (dtype and memory layout; packed:
    heads-first views of contiguous packed tensors), dsinks
    ``(Hq,)`` float32 or ``None``. With ``deterministic`` (the default) bitwise reproducible on one device
    (the split depends on its SM count): fixed loop and summation order.
    """
    B, Hq, Nq, _ = q.shape
    varlen = cu_seqlens is not None
    like = buffers.empty_packed_like if varlen else buffers.empty_like
    if B * Hq * Nq == 0 or k.shape[2] == 0:
        grads = [like(t).zero_() for t in (q, k, v)]
        dsinks = None
        if sinks is not None:  # no keys: out = 0 and lse = sinks[h], so only the LSE's gradient reaches them
            dsinks = torch.zeros(Hq, dtype=torch.float32, device=q.device)
            if dlse is not None:
                dsinks += dlse.float().sum(dim=(0, 2))
        return (*grads, dsinks)
    plan = _backward_plan(q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), out.stride(), dout.stride(),
                          None if dlse is None else dlse.stride(), q.dtype, q.device, sinks is not None, pattern,
                          scale, cu_seqlens[0].shape[0] - 1 if varlen else None, config, dot_precision(q.dtype))
    stats = buffers.empty(plan.stats_shape, dtype=torch.float32, device=q.device)
    delta, lse2 = stats[0], stats[1]                                                # (B, Hq, Nq) each
    cu_q, cu_k = cu_seqlens if varlen else (None, None)
    if (config is None and not varlen
            and hopper_backward.supported(q, k, v, dout, pattern)):
        # the dQ kernel's row statistics alone, then one kernel for dK, dV and a float32 dQ
        launch(_dq, plan.dq_grid, (q, k, v, out, dout, dlse, lse, None, lse2, delta, q, None, plan.kv_table,
                                   None, None),  # (DQ: unused)
               (*plan.dq_head, batch_strides(q.stride(), False), *plan.dq_tail), plan.stats_options)
        dk, dv = like(k), like(v)
        dq_sum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)        # (B, Hq, Nq, D)
        pdp = hopper_backward.backward(q, k, v, dout, dk, dv, dq_sum, lse2, delta, sinks, pattern, scale,
                                       deterministic)
        dsinks = None
        if sinks is not None:  # -sum_rows exp(sinks - lse) * (rowsum(P * dP) - dLSE), fixed-order sums
            dsinks = -pdp
            if dlse is not None:
                dsinks += (torch.exp(sinks[None, :, None] - lse) * dlse.float()).sum(dim=(0, 2))
        return like(q).copy_(dq_sum), dk, dv, dsinks
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
    launch(_dq, plan.dq_grid, (q, k_in, v_in, out, dout, dlse, lse, sinks, lse2, delta, dq, shares,
                               plan.kv_table, cu_q, cu_k),
           (*plan.dq_head, batch_strides(dq.stride(), varlen), *plan.dq_tail), plan.dq_options[dq_tma])

    dk, dv = like(k), like(v)
    pk, pv = dk, dv
    if plan.partials_shapes is not None:
        pk, pv = (buffers.empty(shape, dtype=torch.float32, device=q.device) for shape in plan.partials_shapes)
    launch(_dkdv, plan.dkdv_grid, (q_in, k, v, do_in, lse2, delta, pk, pv, plan.work, shares, dsinks, cu_q, cu_k),
           (*plan.dkdv_head, batch_strides(dk.stride(), varlen), batch_strides(dv.stride(), varlen),
            *plan.dkdv_tail), plan.dkdv_options[dkdv_tma])
    if plan.sum_grid is not None:
        launch(_sum_partials, plan.sum_grid, (pk, pv, dk, dv, plan.first),
               (batch_strides(dk.stride(), False), batch_strides(dv.stride(), False), *plan.sum_tail),
               plan.sum_options)
    return dq, dk, dv, dsinks
