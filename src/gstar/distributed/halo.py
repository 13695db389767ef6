"""Causal sliding-window attention over a sharded sequence: each query chunk fetches only the keys it sees.

A chunk of queries at global positions ``[start, end)`` under ``window=(left, 0)`` sees keys
``[start - left, end)`` (the halo ``[start - left, start)`` and its own) and the sink tokens ``[0, S)``.
One exchange brings every halo and sink key from the ranks holding them (several ranks when the window is
wider than a shard); nothing else moves. Each chunk then runs one call on its keys laid out as::

    [ sink keys 0 .. S-1 | window keys start - left .. end - 1 ]      (one range when they touch)

Bottom-right alignment puts query row ``i`` at ``p(i) = i + Nk - Nq``, which is its global position minus
the global position of the first window key, plus ``S``: the window bounds keep their meaning, and the
first ``S`` keys are the sink tokens (``sink_tokens=S`` of the call exempts exactly them). When the window
reaches the sinks (``start - left <= S``) the keys are the single range ``[0, end)`` and local positions are
global ones.

The backward fetches the same keys again and returns each piece's dK/dV to the rank that holds it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from .. import ops
from ..pattern import Pattern
from .exchange import exchange
from .layout import Chunk, chunks, owners


class Piece(NamedTuple):
    """A run of keys held by one rank."""

    owner: int
    local: int      # first row on the owner
    length: int


class Call(NamedTuple):
    """One query chunk's call: its rows, its pattern, and where its keys come from (in key order)."""

    rows: slice
    pattern: Pattern
    pieces: tuple[Piece, ...]


class Plan(NamedTuple):
    calls: tuple[Call, ...]
    sends: tuple[tuple[int, tuple[Piece, ...]], ...]   # (rank, this rank's pieces it needs, in its order)
    receives: tuple[tuple[int, int], ...]              # (rank, how many keys come from it)


def key_ranges(chunk: Chunk, left: int, sink_tokens: int) -> list[tuple[int, int]]:
    """The global key ranges a query chunk sees under ``window=(left, 0)`` and ``sink_tokens``."""
    lo, end = max(0, chunk.start - left), chunk.start + chunk.length
    if sink_tokens >= lo:
        return [(0, end)]
    return ([(0, sink_tokens)] if sink_tokens else []) + [(lo, end)]


def _pieces(ranges, held) -> tuple[Piece, ...]:
    """The ranges split by the rank holding them; runs that continue on one rank are joined."""
    pieces: list[Piece] = []
    for a, b in ranges:
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


def _calls(n_local: int, world: int, rank: int, layout: str, left: int, sink_tokens: int) -> tuple[Call, ...]:
    held = owners(n_local, world, layout)
    calls = []
    for c in chunks(n_local, world, rank, layout):
        ranges = key_ranges(c, left, sink_tokens)
        nk = sum(b - a for a, b in ranges)
        pattern = Pattern.make(c.length, nk, causal=True, window=(left, 0), sink_tokens=sink_tokens)
        calls.append(Call(slice(c.local, c.local + c.length), pattern, _pieces(ranges, held)))
    return tuple(calls)


@functools.cache
def plan(n_local: int, world: int, rank: int, layout: str, left: int, sink_tokens: int) -> Plan:
    """This rank's calls and transfers (every rank derives every other's needs from the layout: no
    handshake)."""
    mine = _calls(n_local, world, rank, layout, left, sink_tokens)
    sends, receives = [], []
    for other in range(world):
        if other == rank:
            continue
        wanted = tuple(p for call in _calls(n_local, world, other, layout, left, sink_tokens)
                       for p in call.pieces if p.owner == rank)
        if wanted:
            sends.append((other, wanted))
        count = sum(p.length for call in mine for p in call.pieces if p.owner == other)
        if count:
            receives.append((other, count))
    return Plan(mine, tuple(sends), tuple(receives))


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """(B, H, n_i, d) tensors concatenated along n (the one tensor itself, no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _rows(t: torch.Tensor, pieces) -> torch.Tensor:
    """The pieces' rows of t (B, H, n, d), concatenated along n."""
    return _joined([t.narrow(2, p.local, p.length) for p in pieces])


def _fetch(p: Plan, spec, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """For each of ``tensors`` (this rank's K and V shards, (B, Hkv, n, d)), the keys of each call."""
    sends = [(dst, _rows(t, pieces)) for dst, pieces in p.sends for t in tensors]
    buffers = [(src, t.new_empty(t.shape[:2] + (count, t.shape[3]))) for src, count in p.receives for t in tensors]
    received = exchange(spec.peers, sends, buffers).wait()
    per_tensor = []
    for i, t in enumerate(tensors):
        arrived = {src: received[j * len(tensors) + i] for j, (src, _) in enumerate(p.receives)}
        cursor = dict.fromkeys(arrived, 0)
        calls = []
        for call in p.calls:
            parts = []
            for piece in call.pieces:
                if piece.owner == spec.peers.rank:
                    parts.append(t.narrow(2, piece.local, piece.length))
                else:
                    parts.append(arrived[piece.owner].narrow(2, cursor[piece.owner], piece.length))
                    cursor[piece.owner] += piece.length
            calls.append(_joined(parts))
        per_tensor.append(calls)
    return per_tensor


def _plan(spec) -> Plan:
    return plan(spec.n_local, spec.peers.world, spec.peers.rank, spec.layout, spec.left, spec.sink_tokens)


def forward(q, k, v, sinks, spec):
    """As :func:`gstar.distributed.ring.forward`, for ``window=(left, 0)`` with ``left >= 0``."""
    p = _plan(spec)
    keys, values = _fetch(p, spec, [k, v])
    results = [ops.run_forward(ops.Inputs(q[:, :, call.rows], kc, vc, sinks, None, None),
                            ops.Options(call.pattern, spec.scale, spec.backend))
               for call, kc, vc in zip(p.calls, keys, values)]
    return _joined([o for o, _ in results]), _joined([lse for _, lse in results])


def backward(dout, q, k, v, sinks, out, lse, dlse, spec):
    """As :func:`gstar.distributed.ring.backward`: each call's dK/dV pieces go back to their ranks."""
    p, rank = _plan(spec), spec.peers.rank
    keys, values = _fetch(p, spec, [k, v])
    stat = ops.stat_dtype(q.dtype)
    dk = torch.zeros(k.shape, dtype=stat, device=k.device)                  # (B, Hkv, n, D)
    dv = torch.zeros(v.shape, dtype=stat, device=v.device)                  # (B, Hkv, n, Dv)
    dq, dsinks = [], None
    back = {src: ([], []) for src, _ in p.receives}                         # dK, dV pieces of other ranks' keys
    for call, kc, vc in zip(p.calls, keys, values):
        r = call.rows
        g_q, g_k, g_v, g_sinks = ops.run_backward(
            dout[:, :, r], out[:, :, r], lse[:, :, r].contiguous(), None if dlse is None else dlse[:, :, r],
            ops.Inputs(q[:, :, r], kc, vc, sinks, None, None), ops.Options(call.pattern, spec.scale, spec.backend))
        dq.append(g_q)
        dsinks = g_sinks if dsinks is None else dsinks + g_sinks
        row = 0
        for piece in call.pieces:
            for grads, g, dest in ((dk, g_k, 0), (dv, g_v, 1)):
                part = g.narrow(2, row, piece.length)
                if piece.owner == rank:
                    grads.narrow(2, piece.local, piece.length).add_(part)
                else:
                    back[piece.owner][dest].append(part)
            row += piece.length
    sends = [(src, torch.cat(back[src][i], dim=2)) for src, _ in p.receives for i in (0, 1)]
    buffers = [(dst, t.new_empty(t.shape[:2] + (sum(x.length for x in pieces), t.shape[3])))
               for dst, pieces in p.sends for t in (k, v)]
    returned = exchange(spec.peers, sends, buffers).wait()
    for j, (dst, pieces) in enumerate(p.sends):
        for grads, arrived in zip((dk, dv), returned[2 * j: 2 * j + 2]):
            row = 0
            for piece in pieces:
                grads.narrow(2, piece.local, piece.length).add_(arrived.narrow(2, row, piece.length))
                row += piece.length
    return _joined(dq), dk.to(k.dtype), dv.to(v.dtype), dsinks
