"""Causal sliding-window attention over a sharded sequence: each query chunk fetches only the keys it sees.

A chunk of queries at global positions ``[start, end)`` under ``window=(left, 0)`` and ``sink_tokens=S`` sees
three disjoint runs of keys, and runs one call on each::

    call    keys                              query rows of the chunk
    own     [start, end)                      all: causal window (left, 0), its own K/V (no copy, no wait)
    halo    [a, start), a = max(S, start - left)   the first L = min(left, length): later rows see past it
    sinks   [0, min(S, start))                all: every key visible (sink tokens are exempt from the window)

The own calls are launched first, and the exchange that brings the halo and sink keys (from the ranks holding
them, several when the window is wider than a shard) is posted while they run; the other calls' results merge
into the own call's rows by their LSEs. A zigzag rank's two chunks share one own call when their patterns agree
and the batch is 1: the chunks are then a batch of two, a view of the shard, so results land in place.
Query row ``i`` of the halo call (global ``start + i``) sees halo key ``j`` (global ``a + j``) when
``j >= i + start - left - a``; bottom-right alignment puts it at ``p(i) = i + (start - a) - L``, so that is
``window=(left - L, unbounded)``. Learned sinks enter the own call only, so each row's denominator gets them once.

The backward keeps the fetched keys (``left`` a chunk, and the sink tokens), runs each call's backward with
the merged out and LSE, adds the halo and sink calls' dQ into their rows, and returns their dK/dV pieces to the
ranks that hold those keys: one exchange each way.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from .. import ops
from ..pattern import Pattern, capped_sinks
from .exchange import Pending, exchange
from .layout import chunks, owners
from .ring import merge


class Piece(NamedTuple):
    """A run of keys held by one rank."""

    owner: int
    local: int      # first row on the owner
    length: int


class Call(NamedTuple):
    """One call: its query rows, its pattern, and where its keys come from (in key order; none: the rows' own
    keys)."""

    rows: slice
    pattern: Pattern
    pieces: tuple[Piece, ...]


class Plan(NamedTuple):
    own: tuple[Call, ...]                              # one per chunk, with the learned sinks
    fetched: tuple[Call, ...]                          # halo and sink-token calls, on keys of the exchange
    sends: tuple[tuple[int, tuple[Piece, ...]], ...]   # (rank, this rank's pieces it needs, in its order)
    receives: tuple[tuple[int, int], ...]              # (rank, how many keys come from it)


def _pieces(a: int, b: int, held) -> tuple[Piece, ...]:
    """Global keys ``[a, b)`` split by the rank holding them; runs that continue on one rank are joined."""
    pieces: list[Piece] = []
    for c, rank in held:
        lo, hi = max(a, c.start), min(b, c.start + c.length)
        if lo >= hi:
            continue
        piece = Piece(rank, c.local + lo - c.start, hi - lo)
        last = pieces[-1] if pieces else None
        if last and last.owner == rank and last.local + last.length == piece.local:
            pieces[-1] = Piece(rank, last.local, last.length + piece.length)
        else:
            pieces.append(piece)
    return tuple(pieces)


def _calls(n_local: int, world: int, rank: int, layout: str, left: int, sink_tokens: int):
    """(own calls, fetched calls) of ``rank``: the table of the module docstring."""
    held = owners(n_local, world, layout)
    own, fetched = [], []
    for c in chunks(n_local, world, rank, layout):
        rows = slice(c.local, c.local + c.length)
        own.append(Call(rows, Pattern.make(c.length, c.length, causal=True, window=(left, 0),
                                           sink_tokens=max(0, sink_tokens - c.start)), ()))
        a, n_rows = max(sink_tokens, c.start - left), min(left, c.length)
        if a < c.start and n_rows:
            fetched.append(Call(slice(c.local, c.local + n_rows),
                                Pattern.make(n_rows, c.start - a, window=(left - n_rows, -1)),
                                _pieces(a, c.start, held)))
        if sink_tokens and c.start:
            sinks_end = min(sink_tokens, c.start)
            fetched.append(Call(rows, Pattern.make(c.length, sinks_end), _pieces(0, sinks_end, held)))
    return tuple(own), tuple(fetched)


@functools.cache
def plan(n_local: int, world: int, rank: int, layout: str, left: int, sink_tokens: int) -> Plan:
    """This rank's calls and transfers (every rank derives every other's needs from the layout: no
    handshake)."""
    own, fetched = _calls(n_local, world, rank, layout, left, sink_tokens)
    sends, receives = [], []
    for other in range(world):
        if other == rank:
            continue
        wanted = tuple(p for call in _calls(n_local, world, other, layout, left, sink_tokens)[1]
                       for p in call.pieces if p.owner == rank)
        if wanted:
            sends.append((other, wanted))
        count = sum(p.length for call in fetched for p in call.pieces if p.owner == other)
        if count:
            receives.append((other, count))
    return Plan(own, fetched, tuple(sends), tuple(receives))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """(B, H, n_i, d) tensors concatenated along n (the one tensor itself, no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    """(1, H, 2m, ...) -> (2, H, m, ...): a zigzag shard's two chunks as a batch of two (a view)."""
    return t[0].unflatten(1, (2, -1)).transpose(0, 1)


def _from_batch(t: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_as_batch`: a view for tensors laid out like its views (kernel outputs follow
    their inputs' layout), a copy otherwise (the LSE)."""
    return t.transpose(0, 1).flatten(1, 2)[None]


class Group(NamedTuple):
    """Calls launched as one: a single call, or one call per chunk of a zigzag shard at batch 1 with one
    pattern, run as a batch of two."""

    pattern: Pattern
    calls: tuple[Call, ...]
    cut: Callable             # cut(t): the group's rows of a (B, H, n, ...) tensor of the shard (a view)

    @property
    def batched(self) -> bool:
        return len(self.calls) > 1


def _groups(calls: tuple[Call, ...], batch: int, n_local: int) -> list[Group]:
    first = calls[0] if calls else None
    if (batch == 1 and len(calls) == 2 and calls[1].pattern == first.pattern
            and calls[1].rows.start - first.rows.start == n_local // 2):
        rows = slice(first.rows.start, first.rows.stop)                    # the rows within each chunk
        return [Group(first.pattern, calls, lambda t: _as_batch(t)[:, :, rows])]
    return [Group(c.pattern, (c,), lambda t, rows=c.rows: t[:, :, rows]) for c in calls]


def _joined_groups(groups: list[Group], results: list[torch.Tensor]) -> torch.Tensor:
    """The own groups' results (B, H, rows, ...) as the shard's (B, H, n, ...)."""
    return _from_batch(results[0]) if groups[0].batched else _joined(results)


def _post(p: Plan, spec, tensors: list[torch.Tensor]) -> Pending:
    """Start fetching the fetched calls' keys of ``tensors`` (this rank's K and V shards, (B, Hkv, n, d))."""
    sends = [(dst, _joined([t.narrow(2, x.local, x.length) for x in pieces])) for dst, pieces in p.sends
             for t in tensors]
    buffers = [(src, t.new_empty(t.shape[:2] + (count, t.shape[3]))) for src, count in p.receives for t in tensors]
    return exchange(spec.peers, sends, buffers)


def _keys(p: Plan, spec, groups: list[Group], tensors: list[torch.Tensor], pending: Pending):
    """For each of ``tensors``, the keys of each fetched group (its calls' keys stacked along the batch), once
    the transfers of :func:`_post` are in."""
    received = pending.wait()
    per_tensor = []
    for i, t in enumerate(tensors):
        arrived = {src: received[j * len(tensors) + i] for j, (src, _) in enumerate(p.receives)}
        cursor = dict.fromkeys(arrived, 0)
        per_call = []
        for call in p.fetched:
            parts = []
            for piece in call.pieces:
                if piece.owner == spec.peers.rank:
                    parts.append(t.narrow(2, piece.local, piece.length))
                else:
                    parts.append(arrived[piece.owner].narrow(2, cursor[piece.owner], piece.length))
                    cursor[piece.owner] += piece.length
            per_call.append(_joined(parts))
        stacked, used = [], 0
        for g in groups:
            stacked.append(torch.cat(per_call[used:used + len(g.calls)]) if g.batched else per_call[used])
            used += len(g.calls)
        per_tensor.append(stacked)
    return per_tensor


def _plan(spec) -> Plan:
    return plan(spec.n_local, spec.peers.world, spec.peers.rank, spec.layout, spec.left, spec.sink_tokens)


def _add(rows: torch.Tensor, part: torch.Tensor) -> None:
    """``rows += part`` in place, summed in the statistics dtype and rounded once."""
    stat = ops.stat_dtype(rows.dtype)
    rows.copy_(rows.to(stat) + part.to(stat))


def forward(q, k, v, sinks, spec):
    """As :func:`gstar.distributed.ring.forward`, for ``window=(left, 0)`` with ``left >= 0``; the saved
    tensors are the fetched groups' keys and values (``left`` keys a chunk, for the backward)."""
    p, batch = _plan(spec), q.shape[0]
    own = _groups(p.own, batch, spec.n_local)
    results = [ops.run_forward(ops.Inputs(g.cut(q), g.cut(k), g.cut(v), sinks, None, None),
                               spec.options(g.pattern)) for g in own]
    pending = _post(p, spec, [k, v])
    out = _joined_groups(own, [o for o, _ in results])                      # (B, Hq, n, Dv)
    lse = _joined_groups(own, [s for _, s in results])                      # (B, Hq, n)
    fetched = _groups(p.fetched, batch, spec.n_local)
    keys, values = _keys(p, spec, fetched, [k, v], pending)
    for g, kc, vc in zip(fetched, keys, values):
        part_out, part_lse = ops.run_forward(ops.Inputs(g.cut(q), kc, vc, None, None, None),
                                             spec.options(g.pattern))
        rows = g.cut(out).to(lse.dtype)                                     # (B, Hq, rows, Dv)
        merge(rows, g.cut(lse), part_out, part_lse)
        g.cut(out).copy_(rows)
    return out, lse, (*keys, *values)


def backward(dout, q, k, v, sinks, out, lse, dlse, fetched_kv, spec):
    """As :func:`gstar.distributed.ring.backward`, with the keys and values the forward fetched: the fetched
    calls' dK/dV pieces go back to their ranks.

    Every call gets the learned sinks, for its rows' share of dsinks, ``-sum exp(sinks - lse) (P dP - dLSE)``
    with ``P dP`` summed over the call's keys: the shares add up to the rows' whole ``P dP``, and the dLSE
    term, counted once per call, is taken back for the fetched calls.
    """
    p, rank, batch = _plan(spec), spec.peers.rank, q.shape[0]

    def run(g: Group, kc, vc):
        return ops.run_backward(g.cut(dout), g.cut(out), g.cut(lse).contiguous(),
                                None if dlse is None else g.cut(dlse), ops.Inputs(g.cut(q), kc, vc, sinks, None, None),
                                spec.options(g.pattern))

    own = _groups(p.own, batch, spec.n_local)
    grads = [run(g, g.cut(k), g.cut(v)) for g in own]
    dq, dk, dv = (_joined_groups(own, [gr[i] for gr in grads]) for i in range(3))  # like q, k, v
    dsinks = None if sinks is None else sum(gr[3] for gr in grads)
    back = {src: ([], []) for src, _ in p.receives}                         # dK, dV pieces of other ranks' keys
    fetched = _groups(p.fetched, batch, spec.n_local)
    keys, values = fetched_kv[:len(fetched)], fetched_kv[len(fetched):]
    for g, kc, vc in zip(fetched, keys, values):
        g_q, g_k, g_v, g_sinks = run(g, kc, vc)
        _add(g.cut(dq), g_q)
        if sinks is not None:
            dsinks = dsinks + g_sinks
            if dlse is not None:  # the own call counted these rows' dLSE term already
                p_sink = torch.exp(capped_sinks(sinks.to(lse.dtype)).view(1, -1, 1) - g.cut(lse))  # (B, Hq, rows)
                dsinks = dsinks - (p_sink * g.cut(dlse).to(lse.dtype)).sum(dim=(0, 2))
        for item, call in enumerate(g.calls):  # batch item of each call (0 unless batched)
            row = 0
            for piece in call.pieces:
                for grads_of, grad, dest in ((dk, g_k, 0), (dv, g_v, 1)):
                    part = grad[item:item + 1] if g.batched else grad
                    part = part.narrow(2, row, piece.length)
                    if piece.owner == rank:
                        _add(grads_of.narrow(2, piece.local, piece.length), part)
                    else:
                        back[piece.owner][dest].append(part)
                row += piece.length
    sends = [(src, torch.cat(back[src][i], dim=2)) for src, _ in p.receives for i in (0, 1)]
    buffers = [(dst, t.new_empty(t.shape[:2] + (sum(x.length for x in pieces), t.shape[3])))
               for dst, pieces in p.sends for t in (k, v)]
    returned = exchange(spec.peers, sends, buffers).wait()
    for j, (dst, pieces) in enumerate(p.sends):
        for grads_of, arrived in zip((dk, dv), returned[2 * j: 2 * j + 2]):
            row = 0
            for piece in pieces:
                _add(grads_of.narrow(2, piece.local, piece.length), arrived.narrow(2, row, piece.length))
                row += piece.length
    return dq, dk, dv, dsinks
