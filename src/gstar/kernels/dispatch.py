"""Which kernel serves a call on this card, for the forward, the backward and a decode step alike, and the
entry points that route each call there (:func:`attention_forward`, :func:`attention_backward`,
:func:`decode_forward`, what :mod:`gstar.ops` and :mod:`gstar.kvcache` call).

Two families exist: the portable Triton kernels (:mod:`.portable`, any Triton GPU and the CPU under the
interpreter) and the sm_90 Gluon kernels (:mod:`.sm90`, H100 / H200). A call is described once (:class:`Call`)
and :func:`family` answers with a family's name from the tables below, every one of them measured: the sm_90
kernels take a call only where they beat the portable ones on an H200 (benchmarks/NOTES.md has each
measurement), on a Triton release they are verified on, with operands their copy engine can read. A new card
is a new folder of kernels plus rows here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton

from .. import buffers
from ..fp8 import FP8
from ..pattern import Pattern, capped_sinks
from .common import descriptors
from .common.fp8 import widen
from .common.split import decode
from . import card
from .portable import backward as portable_backward
from .portable import decode as portable_decode
from .portable import forward as portable_forward
from .portable.tiles import dot_precision
from .sm90 import backward as sm90_backward
from .sm90 import decode as sm90_decode
from .sm90 import forward as sm90_forward

PORTABLE, SM90 = "portable", "sm90"

# Triton releases on which the Gluon kernels passed the GPU tests (Gluon changes from release to release; on
# others they compile but every call takes the portable kernels), and the one their tables and register budgets
# were tuned on.
RELEASES = ("3.6.", "3.9.")
VERIFIED = triton.__version__.startswith(RELEASES)
TUNED = triton.__version__.startswith(RELEASES[0])

# The sm_90 forward: head dims (D, Dv), 16-bit -> the least query length (the longest sequence's, when packed)
# from which its per-item grid beats the portable kernel (dense full attention that walks persistently takes it
# from one tile: sm90.forward.walks). At D = 64 the portable kernel's two resident programs per SM hide its
# softmax as well below 8k queries.
SM90_FORWARD = {(128, 128): sm90_forward.block_m(128), (64, 64): 8192, (192, 128): sm90_forward.block_m(192, 128),
                (256, 256): sm90_forward.block_m(256)}
SM90_FORWARD_FP8 = {(128, 128): sm90_forward.block_m(128)}  # FP8 q, k, v (P V in bfloat16) against portable FP8
# Causal windows the sm_90 forward takes, 16-bit: head dims -> the least window (left + 1 keys). From 1024 keys
# it beats the portable kernel (H200: 0.55-0.63x its time at D 256, 0.73x at D 128); at 256 keys and less the
# portable kernel's narrow tiles lead (GPT-OSS's 128-key windows, D 128 at 256 keys). Backward: portable.
SM90_FORWARD_WINDOW = {(128, 128): 1024, (192, 128): 1024, (256, 256): 1024}
# The sm_90 fused backward: head dim (D = Dv, 16-bit) -> (the least GQA group, full attention too). At D = 64 a
# program's walk over a large group shares its K and V; smaller groups and full attention lose to the portable
# kernels, which fit two programs per SM there.
SM90_BACKWARD = {(128, 128): (1, True), (64, 64): (8, False)}
# The sm_90 decode kernel (FP8 caches, D = Dv): its head dims (at 128 it spills) and the least keys a full cache
# shows the queries, below which the merge of its many splits outweighs the walk.
SM90_DECODE = (64,)
SM90_DECODE_KEYS = 16384


class Call(NamedTuple):
    """What decides which kernel runs a call: the pass (``"forward"``, ``"backward"`` or ``"decode"``), q's and the
    keys' dtypes, the head dims, the normalised pattern (the longest sequence's when packed; a decode step's at its
    cache's capacity), the GQA group, whether the batch is packed or (decoding) the cache paged, whether the
    scores are soft-capped and whether the call has spans."""

    pass_: str
    dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim: int
    value_dim: int
    pattern: Pattern
    group: int
    packed: bool = False
    paged: bool = False
    softcap: bool = False
    spans: bool = False


def _full_or_causal(call: Call, head_dims) -> bool:
    """The calls both sm_90 training kernels are built for: 16-bit, head dims ``(D, Dv)`` in ``head_dims``, full
    or causal attention (no left bound: the window layers stay on the portable kernels, which beat every peer
    there)."""
    return (call.dtype in (torch.bfloat16, torch.float16) and (call.head_dim, call.value_dim) in head_dims
            and call.pattern.left < 0 and call.pattern.right in (-1, 0))


def _wide_window(call: Call) -> bool:
    """A dense 16-bit causal window at least as wide as :data:`SM90_FORWARD_WINDOW` gives the forward at these
    head dims."""
    p, least = call.pattern, SM90_FORWARD_WINDOW.get((call.head_dim, call.value_dim))
    return (least is not None and call.dtype in (torch.bfloat16, torch.float16) and not call.packed
            and p.right == 0 and p.left + 1 >= least)


def serves_sm90(call: Call) -> bool:
    """Whether the sm_90 kernels' tables give them calls of this kind (whatever the card): never soft-capped,
    chunked or spanned ones, nor packed decode steps, which only the portable kernels take."""
    p = call.pattern
    if call.softcap or call.spans or p.chunk:
        return False
    if call.pass_ == "forward":
        fp8 = call.dtype == FP8
        table = SM90_FORWARD_FP8 if fp8 else SM90_FORWARD
        rule = call._replace(dtype=torch.bfloat16) if fp8 else call  # the 16-bit rule, FP8's table
        if not (_full_or_causal(rule, table) or _wide_window(call)):
            return False
        dims = call.head_dim, call.value_dim
        least = sm90_forward.block_m(*dims)  # one full Q tile; a per-item grid the table's length too
        walks = sm90_forward.walks(call.dtype, p, call.packed, *dims)
        return p.nq >= (least if walks else max(least, table[dims]))
    if call.pass_ == "backward":
        least_group, full = SM90_BACKWARD.get((call.head_dim, call.value_dim), (0, False))
        return (not call.packed and _full_or_causal(call, SM90_BACKWARD) and call.group >= least_group
                and (full or p.right == 0))
    return (not call.packed and call.kv_dtype == FP8 and call.dtype != torch.float32
            and call.head_dim == call.value_dim and call.head_dim in SM90_DECODE
            and call.group * p.nq <= sm90_decode.BLOCK_R.value
            and sm90_decode.visible_keys(p, p.nq) >= SM90_DECODE_KEYS)


def family(call: Call, device: torch.device, operands: tuple = ()) -> str:
    """The family that runs this call on ``device``: :data:`SM90` on an sm_90 GPU under a verified Triton for
    the calls :func:`serves_sm90` gives it whose ``operands`` it can read (:func:`_reads`; none given: any),
    else :data:`PORTABLE`. The cheap questions come first: small calls feel every microsecond of host time."""
    if VERIFIED and card.sm90(device) and serves_sm90(call) and (not operands or _reads(call, operands)):
        return SM90
    return PORTABLE


def _reads(call: Call, operands: tuple) -> bool:
    """Whether the sm_90 kernel of ``call``'s pass can read its operands: the copy engine's descriptors for the
    forward (q, k, v; FP8's V widened to bfloat16) and the backward (q, k, v, dO), a cache laid out for the
    decode kernel's word loads (k, v)."""
    if call.pass_ == "decode":
        return sm90_decode.fits(*operands, call.paged)
    if call.pass_ == "forward":
        q, k, v = operands
        if not (q.dtype == k.dtype and v.dtype == (torch.bfloat16 if q.dtype == FP8 else q.dtype)):
            return False
    return descriptors.supported(*operands)


def sitting_out(device: torch.device) -> str | None:
    """Why the sm_90 kernels do not run on this sm_90 GPU (a Triton release outside ``RELEASES``), for the CLI
    to say so; None when they run or the device is no sm_90 GPU."""
    if VERIFIED or not card.sm90(device):
        return None
    verified = ", ".join(r.rstrip(".") for r in RELEASES)
    return (f"triton {triton.__version__} is not a release the Hopper kernels are verified on ({verified}): "
            "the portable kernels run, slower on full and causal layers (docs/hopper.md)")


def _positive(q, scale: float):
    """q and a positive scale: the kernels scale each block's max over raw scores, which needs a positive
    factor, so the sign of the scale, or a zero scale, goes into a copy of q (in the kernels a scaled Q tile
    would leave shared memory for registers and cost every block of every call)."""
    if scale > 0:
        return q, scale
    return (-q, -scale) if scale < 0 else (q * 0.0, 1.0)


def attention_forward(q, k, v, sinks, pattern: Pattern, scale: float, config: dict | None = None, *,
                      softcap: float = 0.0, cu_seqlens: tuple[torch.Tensor, torch.Tensor] | None = None,
                      descale=None, out_dtype=None, spans=None):
    """Attention forward on validated inputs; returns ``(out, lse)``.

    Dense: q: (B, Hq, Nq, D); k: (B, Hkv, Nk, D); v: (B, Hkv, Nk, Dv); pattern: the normalised
    :class:`Pattern` of the batch. Packed (``cu_seqlens=(cu_q, cu_k)``, each (num_seqs + 1,) int32 on q's
    device): q: (1, Hq, total_q, D), k, v: (1, Hkv, total_k, D or Dv) (heads-first views of the packed
    tensors), and ``pattern`` carries the window and the longest lengths (max_seqlen_q, max_seqlen_k); each
    sequence gets its own pattern inside the kernel, with nothing read on the host.
    float16/bfloat16/float32, any strides with unit last stride (never copied). sinks: None or (Hq,)
    float32, unscaled. scale: any finite float; softcap: the scores' soft-cap (0.0: none); spans: None or the
    keys' span bounds (:func:`gstar.pattern.span_bounds`), (B, Nk, 2) int32 contiguous (packed: (total_k, 2)).
    ``config``
    overrides the portable kernel's tiles (:func:`gstar.kernels.portable.tiles.forward_config`), for tests and
    tuning, and keeps the portable kernel
    where sm_90 would take its own.

    FP8 (float8_e4m3fn q, k, v): ``descale`` the descales of q, k and v, each None (1) or a float32 (B or
    num_seqs, Hkv) tensor, any strides (positive values; :func:`gstar.fp8.check`); ``out_dtype`` the output's
    dtype (16 or 32 bits). ``P V`` runs in bfloat16 (P in FP8 misses the accuracy bar, docs/design.md section
    4), so V is widened first, exactly (every e4m3 value is a bfloat16 value), in one streaming pass: faster
    than widening each block in the loop.

    out: (B, Hq, Nq, Dv) in q's dtype (or out_dtype), zero rows where no key is visible; dense: in q's memory
    layout, packed: a heads-first view of a contiguous (total_q, Hq, Dv) tensor.
    lse: (B, Hq, Nq), or (1, Hq, total_q) when packed, float32 contiguous natural-log logsumexp with the
    sink term; ``-inf`` (or ``sinks[h]``) for rows that see no key.
    """
    varlen = cu_seqlens is not None
    out = (buffers.empty_packed_like if varlen else buffers.empty_like)(q, dtype=out_dtype, width=v.shape[3])
    q_in, scale = _positive(q, scale)
    if descale is not None:
        v = widen(v, torch.bfloat16)                                               # (B, Hkv, Nk, Dv)
    lse = buffers.empty(q.shape[:3], dtype=torch.float32, device=q.device)        # (B, Hq, Nq)
    call = Call("forward", q.dtype, k.dtype, q.shape[3], v.shape[3], pattern, q.shape[1] // k.shape[1], varlen,
                softcap=softcap > 0, spans=spans is not None)
    if config is None and family(call, q.device, (q_in, k, v)) == SM90:
        sm90_forward.forward(q_in, k, v, sinks, out, lse, pattern, scale, cu_seqlens, descale)
    else:
        portable_forward.forward(q_in, k, v, sinks, out, lse, pattern, scale, config, cu_seqlens, descale,
                                 softcap=softcap, spans=spans)
    return out, lse


def attention_backward(dout, q, k, v, out, lse, dlse, sinks, pattern: Pattern, scale: float, *, config=None,
                       softcap: float = 0.0, cu_seqlens: tuple[torch.Tensor, torch.Tensor] | None = None,
                       deterministic: bool = True, spans=None):
    """Gradients of attention (docs/design.md section 1) from the forward's output and LSE.

    Args:
        q: ``(B, Hq, Nq, D)``; k: ``(B, Hkv, Nk, D)``; v: ``(B, Hkv, Nk, Dv)``; dout, out: ``(B, Hq, Nq,
            Dv)``; any strides with unit last stride (never copied).
        lse: ``(B, Hq, Nq)`` float32 contiguous, natural log, sink term included (``-inf`` for empty rows).
        dlse: ``None`` or ``(B, Hq, Nq)`` gradient of the returned LSE (any strides and float dtype).
        sinks: ``None`` or ``(Hq,)`` float32 learned sink logits.
        pattern: the normalised :class:`gstar.pattern.Pattern`; scale: multiplies ``q . k``; softcap: the
            scores' soft-cap (0.0: none); spans: the keys' span bounds, as :func:`attention_forward` takes them.
        config: a :class:`gstar.kernels.portable.tiles.BackwardConfig` for the portable kernels (tests use
            other tiles, splits and loop forms; scripts/tune-backward sweeps them); it keeps them where sm_90
            would take its own.
        cu_seqlens: ``(cu_q, cu_k)`` for packed sequences, as in :func:`attention_forward` (B = 1, the
            sequence axis is total_q / total_k, ``pattern`` holds the longest lengths).
        deterministic: the sm_90 fused backward adds into each dQ tile in a fixed order (the default) or in any
            order (dQ's last bits vary from run to run). Elsewhere the flag changes nothing.

    Returns ``(dq, dk, dv, dsinks)``: dq like q, dk like k, dv like v (dtype and memory layout; packed:
    heads-first views of contiguous packed tensors), dsinks ``(Hq,)`` float32 or ``None``. With
    ``deterministic`` (the default) bitwise reproducible on one device: fixed loop and summation order.
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
    call = Call("backward", q.dtype, k.dtype, q.shape[3], v.shape[3], pattern, Hq // k.shape[1], varlen,
                softcap=softcap > 0, spans=spans is not None)
    if config is None and family(call, q.device, (q, k, v, dout)) == SM90:
        # the dQ kernel's row statistics alone, then one kernel for dK, dV and a float32 dQ
        lse2, delta = portable_backward.statistics(dout, q, k, v, out, lse, dlse, pattern, scale)
        dk, dv = like(k), like(v)
        dq_sum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)        # (B, Hq, Nq, D)
        pdp = sm90_backward.backward(q, k, v, dout, dk, dv, dq_sum, lse2, delta, sinks, pattern, scale,
                                     deterministic)
        dsinks = None
        if sinks is not None:  # -sum_rows exp(sinks - lse) * (rowsum(P * dP) - dLSE), fixed-order sums
            dsinks = -pdp
            if dlse is not None:
                dsinks += (torch.exp(capped_sinks(sinks)[None, :, None] - lse) * dlse.float()).sum(dim=(0, 2))
        return like(q).copy_(dq_sum), dk, dv, dsinks
    return portable_backward.backward(dout, q, k, v, out, lse, dlse, sinks, pattern, scale, config=config,
                                      softcap=softcap, cu_seqlens=cu_seqlens, spans=spans)


def decode_forward(q, cache, cache_seqlens, added: int, sinks, pattern: Pattern, scale: float,
                   num_splits: int | None, descale=None, out_dtype=None, softcap: float = 0.0, cu_seqlens_q=None):
    """``(out, lse)`` of :func:`gstar.flash_attention_with_kvcache` on validated inputs (the cache already
    appended to). q: (B, Hq, nq, D), or packed (total_q, Hq, D) with ``cu_seqlens_q`` (B + 1,) int32; ``cache``:
    a :class:`gstar.kvcache.Cache`; ``cache_seqlens``: (B,) int32 or None (every sequence full); ``added``: keys
    appended this call, each sequence's query count (packed: nonzero when the queries were appended, their
    counts read on the device); ``pattern``: nq (packed: the most queries a sequence has) and
    the window at the cache's capacity (each sequence's length is read on the device); ``sinks``: None or (Hq,)
    float32. An FP8 cache: ``descale`` the descales of q, k and v, each None (1) or a float32 (B, Hkv) view
    (:func:`gstar.fp8.check`), and ``out_dtype`` (default q's dtype); ``softcap``: the scores' soft-cap (0.0:
    none)."""
    packed = cu_seqlens_q is not None
    Hq, D = q.shape[-2 if packed else 1], q.shape[-1]
    B = cu_seqlens_q.shape[0] - 1 if packed else q.shape[0]
    k, v = cache.k, cache.v
    Hkv, Dv = (k.shape[2] if cache.paged else k.shape[1]), v.shape[-1]
    if cache_seqlens is None:
        cache_seqlens = torch.full((B,), cache.capacity - added, dtype=torch.int32, device=q.device)
    if packed and added:  # each sequence's keys after its queries were appended: no sync
        cache_seqlens, added = cache_seqlens + cu_seqlens_q.diff(), 0                 # (B,)
    q_in, scale = _positive(q, scale)
    call = Call("decode", q.dtype, k.dtype, D, Dv, pattern, Hq // Hkv, packed=packed, paged=cache.paged,
                softcap=softcap > 0)
    plans = decode_plans(call, q.device, (k, v), B, Hkv, cache.block_size if cache.paged else 0, num_splits)
    return decode(plans, q_in, cache, cache_seqlens, added, sinks, scale, descale, out_dtype, softcap, cu_seqlens_q)


def values_in_keys(k, v) -> bool:
    """Whether a cache's values are a view of its keys' first lanes (multi-head latent attention's one cache read
    as both, as DeepSeek-V3 decodes with absorbed weights): the same storage, offset and strides, fewer lanes."""
    # the pointers first: one compare rejects a cache of its own on the decode path (meta tensors all share 0)
    return (v.data_ptr() == k.data_ptr() and v.dtype == k.dtype and v.shape[-1] <= k.shape[-1]
            and v.stride() == k.stride() and v.storage_offset() == k.storage_offset()
            and v.untyped_storage()._cdata == k.untyped_storage()._cdata)


def decode_plans(call: Call, device: torch.device, cache: tuple, batch: int, kv_heads: int, block_size: int,
                 num_splits: int | None) -> tuple:
    """The launches of a decode step (:class:`gstar.kernels.common.split.Plan`, one or, packed, two) from the
    family that serves it: ``cache`` its (k, v) (or () where any layout goes), ``block_size`` a paged cache's
    (else 0), ``num_splits`` the caller's or None."""
    p = call.pattern
    heads = call.group * kv_heads
    if family(call, device, cache) == SM90:
        return (sm90_decode.plan(batch, heads, kv_heads, p.nq, call.head_dim, call.value_dim, call.paged,
                                 block_size, p, device, num_splits),)
    args = (batch, heads, kv_heads, p.nq, call.head_dim, call.value_dim, call.paged, block_size, p, device,
            dot_precision(call.dtype), num_splits, call.kv_dtype == FP8, call.softcap)
    shared = bool(cache) and cache[0] is not None and values_in_keys(*cache)
    if call.packed:
        return portable_decode.packed_plans(*args, dtype=call.dtype, values_in_keys=shared)
    return (portable_decode.plan(*args, values_in_keys=shared),)
