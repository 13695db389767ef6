"""Full attention (causal or unbounded) over a sharded sequence: K/V pass around the ring of ranks.

At step ``s`` rank ``r`` holds the keys and values of rank ``r - s`` (mod P), computes its queries against
them while the next step's K/V are in flight, and merges the partial result into a running (out, LSE) by
the LSEs. Step 0 is the rank's own shard: its local order is the global order, so one causal call with
``Nq = Nk`` covers it, and it is the one block that carries the learned sinks (each row sees itself, so the
sink enters every row once). Between different ranks chunks never overlap: a key chunk is entirely before
a query chunk (fully visible, no mask) or entirely after it (skipped).

The backward passes K/V around again, together with travelling float32 dK/dV accumulators: the one for
rank ``r - s``'s keys is on rank ``r`` at step ``s``, collects that rank's block gradients and moves on, and
after ``P`` hops it is home. Each block's backward gets the merged (global) out and LSE, so its
probabilities ``exp(s - lse)`` are the whole row's. The blocks get no sinks: a block sees only some of a
row's keys, so the rank works out its rows' share of dsinks itself, from the merged output
(``-sum_i exp(sinks - lse_i) (rowsum(dO_i * O_i) - dLSE_i)``, docs/design.md section 1).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from .. import ops
from ..pattern import Pattern, capped_sinks
from .exchange import pass_along
from .layout import chunks


class Block(NamedTuple):
    rows: slice          # local query rows
    keys: slice          # rows of the K/V shard in hand
    pattern: Pattern


@functools.cache
def blocks(n_local: int, world: int, rank: int, src: int, layout: str, causal: bool) -> tuple[Block, ...]:
    """The calls of one ring step: rank ``rank``'s queries against rank ``src``'s keys. Query chunks that
    see the same key chunks share a call (zigzag: one call per step)."""
    if src == rank:
        return (Block(slice(0, n_local), slice(0, n_local), Pattern.make(n_local, n_local, causal=causal)),)
    mine, theirs = chunks(n_local, world, rank, layout), chunks(n_local, world, src, layout)
    groups: list[tuple[list, tuple]] = []
    for qc in mine:
        seen = tuple(kc for kc in theirs if not causal or kc.start + kc.length <= qc.start)
        if groups and groups[-1][1] == seen:
            groups[-1][0].append(qc)
        else:
            groups.append(([qc], seen))
    out = []
    for qcs, kcs in groups:
        if kcs:  # chunks of one rank are in local order: a run of them is a slice
            rows = slice(qcs[0].local, qcs[-1].local + qcs[-1].length)
            keys = slice(kcs[0].local, kcs[-1].local + kcs[-1].length)
            out.append(Block(rows, keys, Pattern(rows.stop - rows.start, keys.stop - keys.start)))
    return tuple(out)


def merge(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a partial result into the running one, in place: out (B, H, n, Dv) and lse (B, H, n) in the
    statistics dtype, part_out and part_lse of the same rows. Rows that no block has reached have LSE
    ``-inf`` and zeros, and stay so (never NaN)."""
    total = torch.logaddexp(lse, part_lse)                                   # (B, H, n)
    base = torch.where(torch.isinf(total), torch.zeros_like(total), total)   # empty rows: exp(-inf - 0) = 0
    out.mul_(torch.exp(lse - base)[..., None]).add_(part_out.to(out.dtype) * torch.exp(part_lse - base)[..., None])
    lse.copy_(total)


def _steps(spec):
    """(step, source rank, blocks) of each ring step."""
    peers = spec.peers
    for step in range(peers.world):
        src = (peers.rank - step) % peers.world
        yield step, blocks(spec.n_local, peers.world, peers.rank, src, spec.layout, spec.causal)


def forward(q, k, v, sinks, spec):
    """``(out, lse, saved)`` of this rank's queries q (B, Hq, n, D) against the whole sequence's keys, k (B,
    Hkv, n, D) and v (B, Hkv, n, Dv) being this rank's shards: out (B, Hq, n, Dv) in q's dtype, lse (B, Hq, n)
    in the statistics dtype, and the tensors its backward needs besides those (none here)."""
    B, Hq, n, _ = q.shape
    stat = ops.stat_dtype(q.dtype)
    out = q.new_zeros((B, Hq, n, v.shape[-1]), dtype=stat)                  # (B, Hq, n, Dv)
    lse = q.new_full((B, Hq, n), -math.inf, dtype=stat)
    kv = [k, v]
    for step, step_blocks in _steps(spec):
        arriving = pass_along(spec.peers, kv) if step + 1 < spec.peers.world else None
        for b in step_blocks:
            inputs = ops.Inputs(q[:, :, b.rows], kv[0][:, :, b.keys], kv[1][:, :, b.keys],
                                sinks if step == 0 else None, None, None)
            part_out, part_lse = ops.run_forward(inputs, spec.options(b.pattern))
            merge(out[:, :, b.rows], lse[:, :, b.rows], part_out, part_lse)
        if arriving is not None:
            kv = arriving.wait()
    return out.to(q.dtype), lse, ()


def backward(dout, q, k, v, sinks, out, lse, dlse, saved, spec):
    """``(dq, dk, dv, dsinks)`` of :func:`forward` for the upstream dout (out's shape, unit last stride) and
    dlse (lse's shape, or None); dsinks is this rank's share (its rows' terms), None without sinks. ``saved``:
    the forward's saved tensors (none: the K/V pass around the ring again)."""
    stat = ops.stat_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=stat, device=q.device)                  # (B, Hq, n, D)
    kv, returning = [k, v], None
    for step, step_blocks in _steps(spec):
        arriving = pass_along(spec.peers, kv) if step + 1 < spec.peers.world else None
        dk = torch.zeros(k.shape, dtype=stat, device=k.device)              # (B, Hkv, n, D), rank src's keys
        dv = torch.zeros(v.shape, dtype=stat, device=v.device)              # (B, Hkv, n, Dv)
        for b in step_blocks:
            r = b.rows
            inputs = ops.Inputs(q[:, :, r], kv[0][:, :, b.keys], kv[1][:, :, b.keys], None, None, None)
            g_q, g_k, g_v, _ = ops.run_backward(
                dout[:, :, r], out[:, :, r], lse[:, :, r].contiguous(), None if dlse is None else dlse[:, :, r],
                inputs, spec.options(b.pattern))
            dq[:, :, r] += g_q
            dk[:, :, b.keys] += g_k
            dv[:, :, b.keys] += g_v
        if returning is not None:  # the accumulator of these keys, from the ranks before
            before_k, before_v = returning.wait()
            dk += before_k
            dv += before_v
        returning = pass_along(spec.peers, [dk, dv])
        if arriving is not None:
            kv = arriving.wait()
    dk, dv = returning.wait()
    dsinks = None
    if sinks is not None:
        delta = (dout.to(stat) * out.to(stat)).sum(dim=-1)                  # (B, Hq, n)
        if dlse is not None:
            delta = delta - dlse.to(stat)
        dsinks = -(torch.exp(capped_sinks(sinks.to(stat)).view(1, -1, 1) - lse.to(stat)) * delta).sum(dim=(0, 2))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks
