"""``gstar.flash_attention_with_kvcache``: new queries against a long key/value cache (decoding, serving).

A decode step is memory traffic: one or a few query tokens read every cached key and value they can see.
The cache is either contiguous, ``(B, Hkv, Nmax, D)``, or paged, ``(num_blocks, block_size, Hkv, D)`` with a
``(B, max_blocks)`` block table (block ``j`` of sequence ``b``'s keys ``[j bs, (j + 1) bs)`` lives in page
``block_table[b, j]``). Lengths are device values (``cache_seqlens``), so a decode loop never syncs to read them
and never recompiles as they grow.

The rule is :func:`gstar.flash_attention`'s with the queries as the last ``Nq`` positions of each sequence's
``nk_b`` keys (``nk_b = cache_seqlens[b] (+ Nq when k, v are appended)``): bottom-right alignment per
sequence. Only the keys some query can see are read: the sink-token pages and the window's band, so pages
that no query can see may be recycled by the caller (:class:`gstar.streaming.StreamingCache` does).

Queries come dense, ``(B, Hq, Nq, D)`` (the same count for every sequence), or packed, ``(total_q, Hq, D)``
with ``cu_seqlens_q``: a server's step, where a few sequences bring a prefill chunk and most one decode token.

On CUDA the decode kernels (:mod:`gstar.kernels.dispatch` picks one) split each sequence's visible keys over several
programs (split-KV) and merge their partial results by LSE; a packed step's sequences of more queries than a
program's rows hold walk their keys in tiles of consecutive queries instead (two launches over the whole batch,
each skipping the other's sequences on the device). Elsewhere the PyTorch path runs
:func:`gstar.reference.tiled_forward` per sequence on the keys it gathers.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from . import fp8, ops
from .checks import (MAX_SEQLEN, capturing, check_bool, check_cu_seqlens, check_group, check_int, check_offsets,
                     check_options, check_tensor, type_name)
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


class Queries(NamedTuple):
    """The new queries' layout: ``batch`` sequences, dense (``cu_seqlens_q`` None: q is (B, Hq, Nq, D), ``most``
    = Nq each) or packed (q is (total_q, Hq, D), sequence ``b``'s rows ``cu_seqlens_q[b] .. [b + 1]``, ``most``
    = max_seqlen_q at least the longest)."""

    batch: int
    most: int
    cu_seqlens_q: torch.Tensor | None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q is not None

    def heads_first(self, q):
        """q with heads on dim 1 and the head dim last, as the shared checks take it: packed, (1, Hq, total_q, D)."""
        return q.transpose(0, 1).unsqueeze(0) if self.packed else q

    def sequence(self, q, b: int, offsets: list[int] | None):
        """Sequence ``b``'s queries ``(1, Hq, nq_b, D)`` (``offsets``: cu_seqlens_q's values, when packed)."""
        if not self.packed:
            return q[b:b + 1]
        return q[offsets[b]:offsets[b + 1]].transpose(0, 1).unsqueeze(0)


def _check_queries(q, cu_seqlens_q, max_seqlen_q) -> Queries:
    if cu_seqlens_q is None:
        if max_seqlen_q is not None:
            raise ValueError("max_seqlen_q goes with cu_seqlens_q (packed queries); a dense q (B, Hq, Nq, D) has "
                             "Nq queries a sequence")
        check_tensor("q", q, 4)
        if q.shape[2] == 0:
            raise ValueError("q must hold at least one query (q.shape[2] >= 1)")
        return Queries(q.shape[0], q.shape[2], None)
    check_tensor("q", q, 3)
    check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    if max_seqlen_q is None:
        raise ValueError("packed queries (cu_seqlens_q) need max_seqlen_q: at least the most queries a sequence has "
                         "(it sizes the launch; a CUDA graph captured with it replays any mix up to it)")
    most = check_int("max_seqlen_q", max_seqlen_q, 1 if q.shape[0] else 0)
    if most > MAX_SEQLEN:
        raise ValueError(f"max_seqlen_q must be <= {MAX_SEQLEN} (positions are int32 in the kernels), got {most}")
    return Queries(cu_seqlens_q.shape[0] - 1, most, cu_seqlens_q)


def _check_per_sequence(name: str, t, ndim: int, queries: Queries, device):
    """An int32 tensor on q's device with one entry (or row) per sequence of the batch."""
    check_tensor(name, t, ndim)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on q's device {device}, got {t.device}")
    if t.shape[0] != queries.batch:
        whose = "cu_seqlens_q's sequences" if queries.packed else "q's batch"
        raise ValueError(f"{name} must have one entry per sequence of {whose} ({queries.batch}) on dim 0, got "
                         f"shape {tuple(t.shape)}")


def _check_cache(q, queries: Queries, k_cache, v_cache, block_table) -> Cache:
    B, heads_first = queries.batch, queries.heads_first(q)
    if block_table is None:
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_tensor(name, t, 4)
            if t.shape[0] != B:
                raise ValueError(f"{name} must hold the batch of q ({B} sequences) on dim 0 (a contiguous cache "
                                 f"is (B, Hkv, Nmax, D); pass block_table for a paged one), got {tuple(t.shape)}")
        if k_cache.shape[1:3] != v_cache.shape[1:3]:
            raise ValueError(f"k_cache and v_cache must have the same (Hkv, Nmax): {tuple(k_cache.shape)}, "
                             f"{tuple(v_cache.shape)}")
        check_group(heads_first, k_cache, v_cache, fp8_cache=True, names=_CACHE_NAMES)
        return Cache(k_cache, v_cache, None)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, 4)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"a paged k_cache and v_cache must have the same (num_blocks, block_size, Hkv): "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    check_group(heads_first, k_cache.transpose(1, 2), v_cache.transpose(1, 2), fp8_cache=True, names=_CACHE_NAMES)
    _check_per_sequence("block_table", block_table, 2, queries, q.device)
    block_size = k_cache.shape[1]
    if block_size == 0 or block_size % PAGE_MULTIPLE:
        raise ValueError(f"the paged cache's block size (k_cache.shape[1]) must be a positive multiple of "
                         f"{PAGE_MULTIPLE}, got {block_size}")
    return Cache(k_cache, v_cache, block_table)


def _check_new(q, queries: Queries, cache: Cache, k, v):
    """The appended keys and values: like q's queries, with the cache's kv heads and head dims."""
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: pass both or neither")
    if k is None:
        return
    Hkv = cache.k.shape[2] if cache.paged else cache.k.shape[1]
    for name, t, like in (("k", k, cache.k), ("v", v, cache.v)):
        if queries.packed:
            check_tensor(name, t, 3)
            want, names = (q.shape[0], Hkv, like.shape[-1]), "(total_q, Hkv, head dim of the cache)"
        else:
            check_tensor(name, t, 4)
            want, names = (q.shape[0], Hkv, q.shape[2], like.shape[-1]), "(B, Hkv, Nq, head dim of the cache)"
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must be {want} {names}, got {tuple(t.shape)}")
        if t.dtype != like.dtype or t.device != like.device:
            raise TypeError(f"{name} must match its cache's dtype and device ({like.dtype}, {like.device}), got "
                            f"{t.dtype}, {t.device}")


def _check_seqlens(q, queries: Queries, cache_seqlens, appending: bool):
    if cache_seqlens is None:
        if appending:
            raise ValueError("appending k, v needs cache_seqlens: the position to write them at")
        if queries.packed:
            raise ValueError("packed queries (cu_seqlens_q) need cache_seqlens: each sequence's keys")
        return None
    _check_per_sequence("cache_seqlens", cache_seqlens, 1, queries, q.device)
    return cache_seqlens


def _query_counts(q, queries: Queries) -> tuple[list[int], list[int] | None]:
    """Each sequence's query count and, packed, cu_seqlens_q's values (one device-to-host copy)."""
    if not queries.packed:
        return [queries.most] * queries.batch, None
    offsets = queries.cu_seqlens_q.tolist()
    check_offsets("cu_seqlens_q", offsets, "total_q (q.shape[0])", q.shape[0], "max_seqlen_q", queries.most)
    return [b - a for a, b in zip(offsets, offsets[1:])], offsets


def check_cache_values(cache: Cache, cache_seqlens, counts: list[int], appending: bool, pattern: Pattern) -> None:
    """The values behind the cache: every length within the capacity, every page a query reads inside the
    cache (``counts``: each sequence's queries; ``pattern``: the rule at the cache's capacity). One
    device-to-host copy (a sync on CUDA). ``ValueError`` naming the first offender."""
    lengths = cache_seqlens.tolist() if cache_seqlens is not None else [cache.capacity] * len(counts)
    for b, (n, nq) in enumerate(zip(lengths, counts)):
        added = nq if appending else 0
        if n < 0 or n + added > cache.capacity:
            grown = f" + {added} appended" if added else ""
            raise ValueError(f"cache_seqlens[{b}] = {n}{grown} is outside the cache's capacity of {cache.capacity} "
                             f"keys")
    if not cache.paged:
        return
    table = cache.block_table.tolist()
    for b, (n, nq) in enumerate(zip(lengths, counts)):
        for j in read_blocks(pattern.resized(nq, n + (nq if appending else 0)), cache.block_size) if nq else ():
            page = table[b][j]
            if not 0 <= page < cache.num_blocks:
                raise ValueError(f"block_table[{b}, {j}] = {page} is outside the cache's {cache.num_blocks} blocks "
                                 f"(sequence {b} reads that block)")


def append(cache: Cache, k, v, cache_seqlens, cu_seqlens_q=None) -> None:
    """Write ``k``, ``v`` into the cache in place, query ``i`` of sequence ``b`` at position ``cache_seqlens[b] +
    i``: dense ``(B, Hkv, Nq, D)``, or packed ``(total_q, Hkv, D)`` with ``cu_seqlens_q``. One indexed copy per
    tensor, positions computed on the device (no sync)."""
    if cu_seqlens_q is None:
        B, _, Nq, _ = k.shape
        pos = cache_seqlens.long()[:, None] + torch.arange(Nq, device=k.device)   # (B, Nq)
        batch = torch.arange(B, device=k.device)[:, None].expand(B, Nq)           # (B, Nq)
        k, v = (t.permute(0, 2, 1, 3) for t in (k, v))                            # (B, Nq, Hkv, D)
    else:
        rows = torch.arange(k.shape[0], device=k.device)                          # (total_q,)
        batch = torch.searchsorted(cu_seqlens_q[1:], rows.int(), right=True)      # (total_q,) sequence of each row
        pos = cache_seqlens.long()[batch] + rows - cu_seqlens_q.long()[batch]     # (total_q,)
    for new, store in ((k, cache.k), (v, cache.v)):
        if cache.paged:
            pages = cache.block_table[batch, pos // cache.block_size].long()     # like pos
            store[pages, pos % cache.block_size] = new
        else:
            store.permute(0, 2, 1, 3)[batch, pos] = new


def _torch_path(q, queries: Queries, cache: Cache, keys: list[int], sinks, pattern: Pattern, scale, softcap,
                descale, out_dtype):
    """Per sequence: gather the keys it sees (``keys[b]`` of them) and run the tiled PyTorch forward (an FP8
    cache dequantised)."""
    counts, offsets = _query_counts(q, queries)
    outs, lses = [], []
    for b, (nq, nk) in enumerate(zip(counts, keys)):
        if nq == 0:
            continue
        at = pattern.resized(nq, nk)
        pages = read_blocks(at, cache.block_size) if cache.paged else None
        qkv = (queries.sequence(q, b, offsets), *cache.keys(b, pages, nk))
        if descale is not None:  # the dequantised inputs in the output's dtype (a 16-bit q: no descale)
            qkv = (fp8.dequantize(t, None if d is None else d[b:b + 1], None, out_dtype)
                   for t, d in zip(qkv, descale))
        out, lse = ops.run_forward(ops.Inputs(*qkv, sinks, None, None), ops.Options(at, scale, "torch",
                                                                                     softcap=softcap))
        outs.append(out)                                                          # (1, Hq, nq, Dv)
        lses.append(lse)                                                          # (1, Hq, nq)
    if not queries.packed:
        return torch.cat(outs), torch.cat(lses)
    return torch.cat([o[0].transpose(0, 1) for o in outs]), torch.cat([x[0] for x in lses], dim=1)


def flash_attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, block_table=None,
                                 cu_seqlens_q=None, max_seqlen_q=None, causal=True, window=(-1, -1), sink_tokens=0,
                                 sinks=None, scale=None, softcap=0.0, chunk=0, return_lse=False, num_splits=None,
                                 backend="auto", check_values=True, q_descale=None, k_descale=None, v_descale=None,
                                 out_dtype=None):
    """Attention of new queries against a key/value cache, appending their keys and values first if given.
    Forward only (inference).

    Args:
        q: ``(B, Hq, Nq, D)``, ``Nq >= 1`` (one token, a few speculative drafts, a chunk of prefill); or packed
            ``(total_q, Hq, D)`` with ``cu_seqlens_q``: a serving step's mix, each sequence its own count.
        k_cache, v_cache: contiguous ``(B, Hkv, Nmax, D)`` / ``(B, Hkv, Nmax, Dv)``, or paged
            ``(num_blocks, block_size, Hkv, D)`` / ``(..., Dv)`` with ``block_table``; q's dtype and device,
            unit last stride, ``Hq % Hkv == 0``. A latent cache (multi-head latent attention decoded with
            absorbed weights) passes ``v_cache = k_cache[..., :Dv]``: the kernel then reads each key once for both
            (16-bit caches whose D splits into two powers of two, the first ``Dv``: 576 = 512 + 64).
        k, v: ``(B, Hkv, Nq, D)`` / ``(..., Dv)`` (packed: ``(total_q, Hkv, D)`` / ``(..., Dv)``): written into
            the cache at positions ``cache_seqlens[b]`` .. ``+ Nq - 1`` (in place, one small indexed copy before
            the attention) and attended to.
        cache_seqlens: ``(B,)`` int32 on q's device, the keys each sequence holds before appending; None means
            every sequence fills the cache (only dense, without ``k``, ``v``). Query ``i`` of sequence ``b`` sits
            at position ``cache_seqlens[b] + i`` when appending, else ``cache_seqlens[b] - Nq + i`` (``Nq``:
            that sequence's query count).
        block_table: ``(B, max_blocks)`` int32: page of each block of each sequence (paged cache; block size
            a multiple of 16). Entries of blocks no query sees are never read.
        cu_seqlens_q: ``(B + 1,)`` int32 on q's device, packed queries: sequence ``b``'s are rows
            ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]`` of q (0 first, non-decreasing, ``total_q`` last; a sequence
            may have none). One call serves a step that mixes prefill chunks and decode tokens: sequences of a
            few queries split their keys over programs, longer ones walk them in tiles of consecutive queries;
            which is which is read on the device, so the mix may change between calls (and between replays of a
            captured CUDA graph) without a sync or a recompile.
        max_seqlen_q: with ``cu_seqlens_q``, an int at least the most queries a sequence has: it sizes the launch
            (a graph captured with it replays any mix of at most that many).
        causal, window, sink_tokens, chunk, sinks, scale, softcap: as in :func:`gstar.flash_attention`, on those
            positions.
        return_lse: also return the LSE, ``(B, Hq, Nq)`` float32 (packed: ``(Hq, total_q)``).
        num_splits: programs per (sequence, kv head) sharing its keys (split-KV; packed, for the sequences of a
            few queries); None picks from the card and the shapes (never from the lengths: no sync). The Triton
            backend only.
        backend: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"triton"`` or ``"torch"``.
        check_values: check ``cache_seqlens``, ``cu_seqlens_q`` and the block table on the host (one device sync):
            lengths within the capacity, pages read inside the cache, offsets in order; and an FP8 cache's descales
            (positive, finite). Inside ``torch.compile`` or CUDA graph capture they are trusted; pass False in a
            decode loop whose cache is known good.
        q_descale, k_descale, v_descale, out_dtype: an FP8 cache (``torch.float8_e4m3fn``, half the bytes a
            step reads), as in :func:`gstar.flash_attention`: descales ``(B, Hkv)`` or broadcastable, fixed
            per sequence (appended keys and values are quantised with them). q may be FP8 too (with
            ``q_descale``) or float16 / bfloat16. The kernel widens the values to float16 in registers (``P V``
            runs in float16) and, under 16-bit queries, the keys too (bfloat16 queries scaled by a power of two
            into float16's range, their significant bits kept). ``out_dtype`` defaults to q's dtype (bfloat16
            for FP8 queries).

    Returns ``out`` ``(B, Hq, Nq, Dv)`` (packed: ``(total_q, Hq, Dv)``) in q's dtype (or out_dtype), or
    ``(out, lse)``.
    """
    queries = _check_queries(q, cu_seqlens_q, max_seqlen_q)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k_cache, v_cache, k, v, sinks)):
        raise RuntimeError("flash_attention_with_kvcache is forward only: run it under torch.no_grad() "
                           "(training takes gstar.flash_attention)")
    cache = _check_cache(q, queries, k_cache, v_cache, block_table)
    _check_new(q, queries, cache, k, v)
    appending = k is not None
    cache_seqlens = _check_seqlens(q, queries, cache_seqlens, appending)
    Hq, D, Dv = q.shape[-2 if queries.packed else 1], q.shape[-1], cache.v.shape[-1]
    kw = check_options(q, Hq, D, Dv, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks, scale=scale,
                       backend=backend, return_lse=return_lse, softcap=softcap, chunk=chunk)
    scale, backend = kw.scale, kw.backend
    if num_splits is not None:
        if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool):
            raise TypeError(f"num_splits must be None or an int, got {type_name(num_splits)}")
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    check_bool("check_values", check_values)
    pattern = kw.pattern(queries.most, cache.capacity)
    descale, out_dtype = fp8.check(q, cache.k, cache.v, q_descale=q_descale, k_descale=k_descale,
                                   v_descale=v_descale, out_dtype=out_dtype, sinks=sinks, scale=scale,
                                   batch=queries.batch, kv_heads=cache.v.shape[-2 if cache.paged else 1],
                                   backend=backend, check_values=check_values) or (None, None)
    if check_values and not (torch.compiler.is_compiling() or capturing(q.device)):
        check_cache_values(cache, cache_seqlens, _query_counts(q, queries)[0], appending, pattern)
    if queries.packed and q.shape[0] == 0:  # no query in the step: nothing to append or attend
        out = q.new_empty((0, Hq, Dv), dtype=out_dtype)
        return (out, torch.empty((Hq, 0), dtype=torch.float32, device=q.device)) if return_lse else out
    if appending:
        append(cache, k, v, cache_seqlens, cu_seqlens_q)
    added = (1 if queries.packed else queries.most) if appending else 0
    args = (q, cache.k, cache.v, cache.block_table, cache_seqlens, cu_seqlens_q, sinks, added,
            list(pattern.fields()), scale, kw.softcap, num_splits or 0, backend, descale, out_dtype)
    out, lse = decode_op(*args) if torch.compiler.is_compiling() else _attend(*args)
    return (out, lse) if return_lse else out


def _attend(q, k_cache, v_cache, block_table, cache_seqlens, cu_seqlens_q, sinks, added, pattern, scale, softcap,
            num_splits, backend, descale, out_dtype):
    """``(out, lse)`` on validated inputs, the cache already appended to (``added``: dense, the keys appended to
    each sequence; packed, nonzero when each sequence's queries were); the arguments of the operator below
    (``pattern``: the rule at the cache's capacity and the most queries a sequence has, as
    :meth:`gstar.pattern.Pattern.fields`; ``num_splits`` 0: picked by the rule; ``descale``, ``out_dtype``: an
    FP8 cache's, from :func:`gstar.fp8.check`, else None)."""
    cache, pattern = Cache(k_cache, v_cache, block_table), Pattern.from_fields(pattern)
    descale = None if descale is None else tuple(descale)  # the operator hands the tuple over as a list
    if backend == "torch":
        packed = cu_seqlens_q is not None
        queries = Queries(cu_seqlens_q.shape[0] - 1 if packed else q.shape[0], pattern.nq, cu_seqlens_q)
        if cache_seqlens is None:
            keys = [cache.capacity] * queries.batch
        else:
            grown = cu_seqlens_q.diff() if packed else torch.full_like(cache_seqlens, pattern.nq)
            keys = (cache_seqlens + grown * (added > 0)).tolist()
        return _torch_path(q, queries, cache, keys, sinks, pattern, scale, softcap, descale, out_dtype)
    from .kernels import decode_forward
    return decode_forward(q, cache, cache_seqlens, added, None if sinks is None else sinks.float(),
                          pattern, scale, num_splits or None, descale, out_dtype, softcap, cu_seqlens_q)


# torch.compile traces this operator in place of _attend (eager calls skip the dispatcher's host time): the
# plan, the lengths read by the PyTorch path and the launches stay out of the graph (ops.py says why).
decode_op = torch.library.custom_op(
    "gstar::decode", _attend, mutates_args=(),
    schema="(Tensor q, Tensor k_cache, Tensor v_cache, Tensor? block_table, Tensor? cache_seqlens, "
           "Tensor? cu_seqlens_q, Tensor? sinks, SymInt added, SymInt[] pattern, float scale, float softcap, "
           "SymInt num_splits, str backend, Tensor?[]? descale, ScalarType? out_dtype) -> (Tensor, Tensor)")


@decode_op.register_fake
def _(q, k_cache, v_cache, block_table, cache_seqlens, cu_seqlens_q, *rest):
    out_dtype = rest[-1] or q.dtype
    if cu_seqlens_q is not None:  # packed: (total_q, Hq, Dv), (Hq, total_q)
        total, Hq = q.shape[0], q.shape[1]
        return (q.new_empty((total, Hq, v_cache.shape[-1]), dtype=out_dtype),
                q.new_empty((Hq, total), dtype=ops.stat_dtype(out_dtype)))
    B, Hq, nq, _ = q.shape
    return (q.new_empty((B, Hq, nq, v_cache.shape[-1]), dtype=out_dtype),
            q.new_empty((B, Hq, nq), dtype=ops.stat_dtype(out_dtype)))
