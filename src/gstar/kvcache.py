"""``gstar.flash_attention_with_kvcache``: a few new queries against a long key/value cache (decoding).

A decode step is memory traffic: one or a few query tokens read every cached key and value they can see.
The cache is either contiguous, ``(B, Hkv, Nmax, D)``, or paged, ``(num_blocks, block_size, Hkv, D)`` with a
``(B, max_blocks)`` block table (block ``j`` of sequence ``b``'s keys ``[j bs, (j + 1) bs)`` lives in page
``block_table[b, j]``). Lengths are device values (``cache_seqlens``), so a decode loop never syncs to read them
and never recompiles as they grow.

The rule is :func:`gstar.flash_attention`'s with the queries as the last ``Nq`` positions of each sequence's
``nk_b`` keys (``nk_b = cache_seqlens[b] (+ Nq when k, v are appended)``): bottom-right alignment per
sequence. Only the keys some query can see are read: the sink-token pages and the window's band, so pages
that no query can see may be recycled by the caller (:class:`gstar.streaming.StreamingCache` does).

On CUDA the decode kernels (:mod:`gstar.kernels.dispatch` picks one) split each sequence's visible keys over several
programs (split-KV) and merge their partial results by LSE; elsewhere the PyTorch path runs
:func:`gstar.reference.tiled_forward` per sequence on the keys it gathers.
"""

from __future__ import annotations

import numbers

import torch

from . import fp8, ops
from .checks import capturing, check_bool, check_group, check_options, check_tensor, type_name
from .pattern import Pattern, read_blocks

PAGE_MULTIPLE = 16  # block sizes the kernel reads in whole tiles of 16, 32 or 64 keys
_CACHE_NAMES = ("q", "k_cache", "v_cache")


class Cache:
    """A validated cache: its tensors, layout and capacity (keys one sequence can hold)."""

    def __init__(self, k_cache, v_cache, block_table):
        self.k, self.v, self.block_table = k_cache, v_cache, block_table
        self.paged = block_table is not None
        if self.paged:
            self.num_blocks, self.block_size = k_cache.shape[0], k_cache.shape[1]
            self.capacity = block_table.shape[1] * self.block_size
        else:
            self.capacity = k_cache.shape[2]

    def keys(self, b: int, pages: list[int] | None, nk: int):
        """Sequence ``b``'s first ``nk`` keys and values, ``(1, Hkv, nk, D)`` / ``(..., Dv)``: contiguous, a
        view; paged, the blocks in ``pages`` (block indices along the sequence) gathered, others zero."""
        if not self.paged:
            return self.k[b:b + 1, :, :nk], self.v[b:b + 1, :, :nk]
        out = []
        for cache in (self.k, self.v):
            dense = cache.new_zeros((max(pages, default=-1) + 1) * self.block_size, *cache.shape[2:])
            for j in pages:
                dense[j * self.block_size:(j + 1) * self.block_size] = cache[self.block_table[b, j]]
            out.append(dense[:nk].permute(1, 0, 2).unsqueeze(0))                 # (1, Hkv, nk, D)
        return tuple(out)


def _check_per_sequence(name: str, t, ndim: int, q):
    """An int32 tensor on q's device with one entry (or row) per sequence of q's batch."""
    check_tensor(name, t, ndim)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    if t.shape[0] != q.shape[0]:
        raise ValueError(f"{name} must have one entry per sequence ({q.shape[0]}) on dim 0, got shape "
                         f"{tuple(t.shape)}")


def _check_cache(q, k_cache, v_cache, block_table) -> Cache:
    B = q.shape[0]
    if block_table is None:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_tensor(name, t, 4)
            if t.shape[0] != B:
                raise ValueError(f"{name} must hold the batch of q ({B} sequences) on dim 0 (a contiguous cache "
                                 f"is (B, Hkv, Nmax, D); pass block_table for a paged one), got {tuple(t.shape)}")
        if k_cache.shape[1:3] != v_cache.shape[1:3]:
            raise ValueError(f"k_cache and v_cache must have the same (Hkv, Nmax): {tuple(k_cache.shape)}, "
                             f"{tuple(v_cache.shape)}")
        check_group(q, k_cache, v_cache, fp8_cache=True, names=_CACHE_NAMES)
        return Cache(k_cache, v_cache, None)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, 4)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"a paged k_cache and v_cache must have the same (num_blocks, block_size, Hkv): "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    check_group(q, k_cache.transpose(1, 2), v_cache.transpose(1, 2), fp8_cache=True, names=_CACHE_NAMES)
    _check_per_sequence("block_table", block_table, 2, q)
    block_size = k_cache.shape[1]
    if block_size == 0 or block_size % PAGE_MULTIPLE:
        raise ValueError(f"the paged cache's block size (k_cache.shape[1]) must be a positive multiple of "
                         f"{PAGE_MULTIPLE}, got {block_size}")
    return Cache(k_cache, v_cache, block_table)


def _check_new(q, cache: Cache, k, v):
    """The appended keys and values: ``(B, Hkv, Nq, D)`` / ``(..., Dv)`` like the cache."""
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: pass both or neither")
    if k is None:
        return
    B, _, Nq, _ = q.shape
    Hkv = cache.k.shape[2] if cache.paged else cache.k.shape[1]
    for name, t, like in (("k", k, cache.k), ("v", v, cache.v)):
        check_tensor(name, t, 4)
        want = (B, Hkv, Nq, like.shape[-1])
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be {want} (B, Hkv, Nq, head dim of the cache), got {tuple(t.shape)}")
        if t.dtype != like.dtype or t.device != like.device:
            raise TypeError(f"{name} must match its cache's dtype and device ({like.dtype}, {like.device}), got "
                            f"{t.dtype}, {t.device}")


def _check_seqlens(q, cache: Cache, cache_seqlens, appending: bool):
    if cache_seqlens is None:
        if appending:
            raise ValueError("appending k, v needs cache_seqlens: the position to write them at")
        return None
    _check_per_sequence("cache_seqlens", cache_seqlens, 1, q)
    return cache_seqlens


def check_cache_values(q, cache: Cache, cache_seqlens, appending: bool, pattern: Pattern) -> None:
    """The values behind the cache: every length within the capacity, every page a query reads inside the
    cache. One device-to-host copy (a sync on CUDA). ``ValueError`` naming the first offender."""
    added = q.shape[2] if appending else 0
    lengths = cache_seqlens.tolist() if cache_seqlens is not None else [cache.capacity] * q.shape[0]
    for b, n in enumerate(lengths):
        if n < 0 or n + added > cache.capacity:
            grown = f" + {added} appended" if added else ""
            raise ValueError(f"cache_seqlens[{b}] = {n}{grown} is outside the cache's capacity of {cache.capacity} "
                             f"keys")
    if not cache.paged:
        return
    table = cache.block_table.tolist()
    for b, n in enumerate(lengths):
        for j in read_blocks(pattern.at(n + added), cache.block_size):
            page = table[b][j]
            if not 0 <= page < cache.num_blocks:
                raise ValueError(f"block_table[{b}, {j}] = {page} is outside the cache's {cache.num_blocks} blocks "
                                 f"(sequence {b} reads that block)")


def append(cache: Cache, k, v, cache_seqlens) -> None:
    """Write ``k``, ``v`` ``(B, Hkv, Nq, D)`` into the cache at positions ``cache_seqlens[b] + i``, in place:
    one indexed copy per tensor, positions computed on the device (no sync)."""
    B, _, Nq, _ = k.shape
    pos = cache_seqlens.long()[:, None] + torch.arange(Nq, device=k.device)   # (B, Nq)
    batch = torch.arange(B, device=k.device)[:, None].expand(B, Nq)           # (B, Nq)
    for new, store in ((k, cache.k), (v, cache.v)):
        rows = new.permute(0, 2, 1, 3)                                          # (B, Nq, Hkv, D)
        if cache.paged:
            pages = cache.block_table[batch, pos // cache.block_size].long()   # (B, Nq)
            store[pages, pos % cache.block_size] = rows
        else:
            store.permute(0, 2, 1, 3)[batch, pos] = rows


def _torch_path(q, cache: Cache, lengths: list[int], sinks, pattern: Pattern, scale, softcap, descale, out_dtype):
    """Per sequence: gather the keys it sees and run the tiled PyTorch forward (an FP8 cache dequantised)."""
    outs, lses = [], []
    for b, nk in enumerate(lengths):
        at = pattern.at(nk)
        pages = read_blocks(at, cache.block_size) if cache.paged else None
        qkv = (q[b:b + 1], *cache.keys(b, pages, nk))
        if descale is not None:  # the dequantised inputs in the output's dtype (a 16-bit q: no descale)
            qkv = (fp8.dequantize(t, None if d is None else d[b:b + 1], None, out_dtype)
                   for t, d in zip(qkv, descale))
        out, lse = ops.run_forward(ops.Inputs(*qkv, sinks, None, None), ops.Options(at, scale, "torch",
                                                                                     softcap=softcap))
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def flash_attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, block_table=None,
                                 causal=True, window=(-1, -1), sink_tokens=0, sinks=None, scale=None, softcap=0.0,
                                 chunk=0, return_lse=False, num_splits=None, backend="auto", check_values=True,
                                 q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """Attention of ``Nq`` new queries against a key/value cache, appending their keys and values first if
    given. Forward only (inference).

    Args:
        q: ``(B, Hq, Nq, D)``, ``Nq >= 1`` (one token, a few speculative drafts, a chunk of prefill).
        k_cache, v_cache: contiguous ``(B, Hkv, Nmax, D)`` / ``(B, Hkv, Nmax, Dv)``, or paged
            ``(num_blocks, block_size, Hkv, D)`` / ``(..., Dv)`` with ``block_table``; q's dtype and device,
            unit last stride, ``Hq % Hkv == 0``.
        k, v: ``(B, Hkv, Nq, D)`` / ``(..., Dv)``: written into the cache at positions ``cache_seqlens[b]``
            .. ``+ Nq - 1`` (in place, one small indexed copy before the attention) and attended to.
        cache_seqlens: ``(B,)`` int32 on q's device, the keys each sequence holds before appending; None means
            every sequence fills the cache (only without ``k``, ``v``). Query ``i`` of sequence ``b`` sits at
            position ``cache_seqlens[b] + i`` when appending, else ``cache_seqlens[b] - Nq + i``.
        block_table: ``(B, max_blocks)`` int32: page of each block of each sequence (paged cache; block size
            a multiple of 16). Entries of blocks no query sees are never read.
        causal, window, sink_tokens, chunk, sinks, scale, softcap: as in :func:`gstar.flash_attention`, on those
            positions.
        return_lse: also return the LSE, ``(B, Hq, Nq)`` float32.
        num_splits: programs per (sequence, kv head) sharing its keys (split-KV); None picks from the card and
            the shapes (never from the lengths: no sync). The Triton backend only.
        backend: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"triton"`` or ``"torch"``.
        check_values: check ``cache_seqlens`` and the block table on the host (one device sync): lengths within
            the capacity, pages read inside the cache; and an FP8 cache's descales (positive, finite). Inside
            ``torch.compile`` or CUDA graph capture they are trusted; pass False in a decode loop whose cache is
            known good.
        q_descale, k_descale, v_descale, out_dtype: an FP8 cache (``torch.float8_e4m3fn``, half the bytes a
            step reads), as in :func:`gstar.flash_attention`: descales ``(B, Hkv)`` or broadcastable, fixed
            per sequence (appended keys and values are quantised with them). q may be FP8 too (with
            ``q_descale``) or float16 / bfloat16. The kernel widens the values to float16 in registers (``P V``
            runs in float16) and, under 16-bit queries, the keys too (bfloat16 queries scaled by a power of two
            into float16's range, their significant bits kept). ``out_dtype`` defaults to q's dtype (bfloat16
            for FP8 queries).

    Returns ``out`` ``(B, Hq, Nq, Dv)`` in q's dtype (or out_dtype), or ``(out, lse)``.
    """
    check_tensor("q", q, 4)
    if q.shape[2] == 0:
        raise ValueError("q must hold at least one query (q.shape[2] >= 1)")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v, sinks)):
        raise RuntimeError("flash_attention_with_kvcache is forward only: run it under torch.no_grad() "
                           "(training takes gstar.flash_attention)")
    cache = _check_cache(q, k_cache, v_cache, block_table)
    _check_new(q, cache, k, v)
    appending = k is not None
    cache_seqlens = _check_seqlens(q, cache, cache_seqlens, appending)
    Hq, D, Dv = q.shape[1], q.shape[3], cache.v.shape[-1]
    kw = check_options(q, Hq, D, Dv, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, scale=scale,
                       backend=backend, return_lse=return_lse, softcap=softcap, chunk=chunk)
    scale, backend = kw.scale, kw.backend
    if num_splits is not None:
        if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool):
            raise TypeError(f"num_splits must be None or an int, got {type_name(num_splits)}")
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    check_bool("check_values", check_values)
    Nq = q.shape[2]
    pattern = kw.pattern(Nq, cache.capacity)
    descale, out_dtype = fp8.check(q, cache.k, cache.v, q_descale=q_descale, k_descale=k_descale,
                                   v_descale=v_descale, out_dtype=out_dtype, sinks=sinks, scale=scale,
                                   batch=q.shape[0], kv_heads=cache.v.shape[-2 if cache.paged else 1],
                                   backend=backend, check_values=check_values) or (None, None)
    if check_values and not (torch.compiler.is_compiling() or capturing(q.device)):
        check_cache_values(q, cache, cache_seqlens, appending, pattern)
    if appending:
        append(cache, k, v, cache_seqlens)
    args = (q, cache.k, cache.v, cache.block_table, cache_seqlens, sinks, Nq if appending else 0,
            list(pattern.fields()), scale, kw.softcap, num_splits or 0, backend, descale, out_dtype)
    out, lse = decode_op(*args) if torch.compiler.is_compiling() else _attend(*args)
    return (out, lse) if return_lse else out


def _attend(q, k_cache, v_cache, block_table, cache_seqlens, sinks, added, pattern, scale, softcap, num_splits,
            backend, descale, out_dtype):
    """``(out, lse)`` on validated inputs, the cache already appended to (``added`` keys this call); the
    arguments of the operator below (``pattern``: the rule at the cache's capacity, as
    :meth:`gstar.pattern.Pattern.fields`; ``num_splits`` 0: picked by the rule; ``descale``, ``out_dtype``: an
    FP8 cache's, from :func:`gstar.fp8.check`, else None)."""
    cache, pattern = Cache(k_cache, v_cache, block_table), Pattern.from_fields(pattern)
    descale = None if descale is None else tuple(descale)  # the operator hands the tuple over as a list
    if backend == "torch":
        lengths = ([n + added for n in cache_seqlens.tolist()] if cache_seqlens is not None
                   else [cache.capacity] * q.shape[0])
        return _torch_path(q, cache, lengths, sinks, pattern, scale, softcap, descale, out_dtype)
    from .kernels import decode_forward
    return decode_forward(q, cache, cache_seqlens, added, None if sinks is None else sinks.float(),
                          pattern, scale, num_splits or None, descale, out_dtype, softcap)


# torch.compile traces this operator in place of _attend (eager calls skip the dispatcher's host time): the
# plan, the lengths read by the PyTorch path and the launches stay out of the graph (ops.py says why).
decode_op = torch.library.custom_op(
    "gstar::decode", _attend, mutates_args=(),
    schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? block_table, Tensor? cache_seqlens, Tensor? sinks, "
           "SymInt added, SymInt[] pattern, float scale, float softcap, SymInt num_splits, str backend, "
           "Tensor?[]? descale, ScalarType? out_dtype) -> (Tensor, Tensor)")


@decode_op.register_fake
def _(q, k_cache, v_cache, *rest):
    B, Hq, nq, _ = q.shape
    out_dtype = rest[-1] or q.dtype
    return (q.new_empty((B, Hq, nq, v_cache.shape[-1]), dtype=out_dtype),
            q.new_empty((B, Hq, nq), dtype=ops.stat_dtype(out_dtype)))
