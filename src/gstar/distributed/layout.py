"""Which tokens of a sequence each rank holds, and the helpers that shard and gather along the sequence.

A sequence of ``N`` tokens is split over the ``P`` ranks of a process group; every rank holds ``n = N / P``
of them, in increasing global order. Drawn for ``P = 2``, ``N = 8`` (each digit is the rank holding that
token)::

    global position     0 1 2 3 4 5 6 7
    contiguous          0 0 0 0 1 1 1 1     rank r holds [r n, (r + 1) n)
    zigzag              0 0 1 1 1 1 0 0     2P chunks of n / 2: rank r holds chunks r and 2P - 1 - r

Under a causal mask the last tokens see the most keys: ``contiguous`` gives the last rank ``2P - 1`` times
the work of the first, ``zigzag`` pairs an early chunk with a late one so every rank does the same work.
``contiguous`` takes any local length; ``zigzag`` an even one (two equal chunks).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")


class Chunk(NamedTuple):
    """A run of consecutive global positions held by one rank."""

    start: int   # first global position
    local: int   # its row in the rank's shard
    length: int


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_local_length(n_local: int, layout: str, what: str = "the local sequence length") -> None:
    if layout == "zigzag" and n_local % 2:
        raise ValueError(f"layout='zigzag' holds two equal chunks per rank: {what} must be even, got {n_local} "
                         f"(use layout='contiguous' for odd lengths)")


def chunks(n_local: int, world: int, rank: int, layout: str) -> tuple[Chunk, ...]:
    """The chunks of ``rank``'s shard, in local (and global) order."""
    if layout == "contiguous":
        return (Chunk(rank * n_local, 0, n_local),)
    half = n_local // 2
    return Chunk(rank * half, 0, half), Chunk((2 * world - 1 - rank) * half, half, half)


def owners(n_local: int, world: int, layout: str) -> list[tuple[Chunk, int]]:
    """Every chunk of the sequence with the rank holding it, sorted by global position."""
    held = [(c, r) for r in range(world) for c in chunks(n_local, world, r, layout)]
    return sorted(held, key=lambda item: item[0].start)


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def shard_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """This rank's shard of ``x``, the whole sequence along ``dim`` (the same tensor on every rank).

    E.g. input ids ``(B, N)`` with ``dim=1`` give ``(B, N / P)``; q ``(B, H, N, D)`` with ``dim=2`` gives
    ``(B, H, N / P, D)``. Inputs, labels and position ids must be sharded alike. A view for ``contiguous``,
    a copy for ``zigzag``.
    """
    world, rank = _world(group)
    check_layout(layout)
    dim %= x.dim()
    n = x.shape[dim]
    parts = world * (2 if layout == "zigzag" else 1)
    if n % parts:
        raise ValueError(f"layout={layout!r} over {world} ranks cuts the sequence into {parts} equal parts: its "
                         f"length (x.shape[{dim}]) must be a multiple of {parts}, got {n}")
    pieces = [x.narrow(dim, c.start, c.length) for c in chunks(n // world, world, rank, layout)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def gather_sequence(x: torch.Tensor, group=None, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's shard ``x`` (the inverse of :func:`shard_sequence`): one
    all-gather; every rank gets the result. Shards must have equal shapes. Not differentiable."""
    world, _ = _world(group)
    check_layout(layout)
    dim %= x.dim()
    n_local = x.shape[dim]
    check_local_length(n_local, layout, f"x.shape[{dim}]")
    shards = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world)]
    dist.all_gather(shards, x.contiguous(), group=group)
    out = x.new_empty(x.shape[:dim] + (n_local * world,) + x.shape[dim + 1:])
    for rank, shard in enumerate(shards):
        for c in chunks(n_local, world, rank, layout):
            out.narrow(dim, c.start, c.length).copy_(shard.narrow(dim, c.local, c.length))
    return out
