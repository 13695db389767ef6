"""``context_parallel_attention``: attention over a sequence sharded along N across a process group.

Validation, the choice of exchange (:mod:`.ring` for unbounded windows, :mod:`.halo` for causal sliding
windows) and the autograd formula. Every rank calls it with its shard; every rule of docs/design.md section 1
applies to global positions, so each rank's results are the whole-sequence results at its tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import api, ops
from ..pattern import Pattern, sink_gradient
from . import halo, ring
from .exchange import Peers
from .layout import LAYOUTS, check_layout, check_local_length


class Spec(NamedTuple):
    """What the exchanges need besides the tensors."""

    peers: Peers
    layout: str
    n_local: int
    causal: bool        # right bound 0, else unbounded (ring only)
    left: int           # -1: unbounded (ring), else the window's left bound (halo)
    sink_tokens: int
    scale: float
    backend: str
    softcap: float = 0.0

    def options(self, pattern: Pattern) -> ops.Options:
        """The options of one block of the exchange, under ``pattern``."""
        return ops.Options(pattern, self.scale, self.backend, softcap=self.softcap)


def _exchange(spec: Spec):
    return ring if spec.left < 0 else halo


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, spec: Spec):
        out, lse, saved = _exchange(spec).forward(q, k, v, sinks, spec)
        ctx.save_for_backward(q, k, v, sinks, out, lse, *saved)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks, out, lse, *saved = ctx.saved_tensors
        if dout is None:  # every rank takes part in the exchanges, with or without a gradient of out
            dout = torch.zeros_like(out)
        elif dout.stride(-1) != 1:
            dout = dout.contiguous()
        dq, dk, dv, dsinks = _exchange(ctx.spec).backward(dout, q, k, v, sinks, out, lse, dlse, saved, ctx.spec)
        return dq, dk, dv, None if sinks is None else sink_gradient(sinks, dsinks).to(sinks.dtype), None


_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_ranks(peers: Peers, q, k, v, sinks, layout: str, pattern: Pattern, scale: float, softcap: float):
    """One all-gather of the shapes and options: every rank raises the same error when ranks disagree."""
    B, Hq, n, D = q.shape
    fields = {"local sequence length": n, "batch size": B, "query heads": Hq, "kv heads": k.shape[1],
              "head dim": D, "value head dim": v.shape[-1], "window left": pattern.left,
              "window right": pattern.right, "sink_tokens": pattern.sink_tokens, "learned sinks": sinks is not None,
              "layout": LAYOUTS.index(layout), "dtype": _DTYPES.index(q.dtype), "scale": scale,
              "softcap": softcap}
    device = q.device if dist.get_backend(peers.group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([float(x) for x in fields.values()], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(peers.world)]
    dist.all_gather(every, mine, group=peers.group)
    table = torch.stack(every).cpu()                                        # (P, fields)
    for i, name in enumerate(fields):
        if bool((table[:, i] != table[0, i]).any()):
            values = table[:, i].tolist()
            if name == "layout":
                values = [LAYOUTS[int(x)] for x in values]
            elif name == "dtype":
                values = [str(_DTYPES[int(x)]) for x in values]
            raise ValueError(f"context_parallel_attention: the ranks of the group disagree on {name}: "
                             f"{values} (rank 0 first)")


def context_parallel_attention(q, k, v, *, group=None, layout="zigzag", causal=False, window=(-1, -1),
                               sink_tokens=0, sinks=None, scale=None, softcap=0.0, return_lse=False,
                               backend="auto", check_ranks=True):
    """Exact attention over one sequence sharded along N over the ranks of ``group``, differentiable.

    Args:
        q: ``(B, Hq, n, D)``, k: ``(B, Hkv, n, D)``, v: ``(B, Hkv, n, Dv)``: this rank's shard of the
            sequence (``n`` tokens of ``N = P n``), as :func:`gstar.distributed.shard_sequence` cuts it.
        group: the process group (default: the default group); every rank of it calls with its shard.
        layout: ``"zigzag"`` (balanced causal work; ``n`` even) or ``"contiguous"``
            (:mod:`gstar.distributed.layout` draws both).
        causal, window, sink_tokens, sinks, scale, softcap, backend: as in :func:`gstar.flash_attention`, on global
            positions. Supported: unbounded windows (causal or not), whose K/V pass around a ring, and causal
            sliding windows ``(left, 0)`` with or without sink tokens, which fetch only the keys within
            ``left`` of each shard (from several ranks when the window is wider than a shard) and the sink
            tokens. Other windows raise ``ValueError``.
        return_lse: also return the LSE of this rank's rows, ``(B, Hq, n)`` float32.
        check_ranks: all-gather the shapes and options once per call (a device sync) so that ranks that
            disagree raise a ``ValueError`` instead of exchanging mismatched tensors.

    Returns ``out`` ``(B, Hq, n, Dv)`` (and ``lse``): the whole sequence's result at this rank's tokens.
    Gradients of q, k, v are this rank's shard's; the gradient of ``sinks`` is this rank's share (its
    rows' terms): summed over the ranks, as data-parallel training sums every gradient, it is the whole
    sequence's.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention needs torch.distributed: call "
                           "torch.distributed.init_process_group first")
    check_layout(layout)
    options = api.normalize(q, k, v, causal=causal, window=window, sink_tokens=sink_tokens, sinks=sinks,
                            scale=scale, backend=backend, return_lse=return_lse, softcap=softcap)
    n = q.shape[2]
    if k.shape[2] != n:
        raise ValueError(f"context parallel attention is self-attention over one sharded sequence: q and k must "
                         f"hold the same tokens, got {n} queries and {k.shape[2]} keys")
    if n == 0:
        raise ValueError("context parallel attention needs at least one token per rank, got an empty shard")
    check_local_length(n, layout, "the local sequence length (q.shape[2])")
    peers = Peers.of(group)
    # the rule over the whole sequence (options.pattern is the shard's, whose shorter length may drop a left bound)
    pattern = Pattern.make(n * peers.world, n * peers.world, causal=causal, window=tuple(window),
                           sink_tokens=int(sink_tokens))
    if not (pattern.right == 0 or pattern.left < 0 and pattern.right < 0):
        raise ValueError(f"context parallel attention supports unbounded windows (causal or not) and causal "
                         f"sliding windows (left, 0); got window ({pattern.left}, {pattern.right})")
    if check_ranks:
        _check_ranks(peers, q, k, v, sinks, layout, pattern, options.scale, options.softcap)
    spec = Spec(peers, layout, n, pattern.right == 0, pattern.left, pattern.sink_tokens, options.scale,
                options.backend, options.softcap)
    out, lse = _ContextParallel.apply(q, k, v, sinks, spec)
    return (out, lse) if return_lse else out
