"""Point-to-point transfers between the ranks of a group, and the bytes they move.

Every transfer is posted with ``torch.distributed.batch_isend_irecv`` and returns a :class:`Pending` whose
``wait()`` gives the received tensors: the caller computes in between. On NCCL the transfers run on the
communicator's own CUDA stream and ``wait()`` only makes the compute stream wait for them, so a transfer
overlaps the kernels queued before its ``wait()``; on gloo they run in gloo's threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """Bytes this process sent and received through :func:`exchange` since the last :meth:`reset`."""

    sent: int = 0
    received: int = 0
    messages: int = 0

    def reset(self) -> None:
        self.sent = self.received = self.messages = 0


TRAFFIC = Traffic()


def traffic() -> Traffic:
    """A copy of this process's counters (``sent`` and ``received`` bytes, ``messages`` sent)."""
    return Traffic(TRAFFIC.sent, TRAFFIC.received, TRAFFIC.messages)


def reset_traffic() -> None:
    TRAFFIC.reset()


class Peers(NamedTuple):
    """A process group as the transfers see it: this rank, the world size, and group ranks' global ranks."""

    group: object          # a ProcessGroup, or None for the default group
    rank: int
    world: int
    global_ranks: tuple    # global rank of each group rank (P2P ops name global ranks)

    @staticmethod
    def of(group) -> Peers:
        world = dist.get_world_size(group)
        ranks = tuple(range(world)) if group is None else tuple(dist.get_global_rank(group, r) for r in range(world))
        return Peers(group, dist.get_rank(group), world, ranks)


class Pending:
    """Transfers in flight; :meth:`wait` returns the received tensors in the order they were asked for."""

    def __init__(self, works: list, received: list[torch.Tensor], sent: list[torch.Tensor] = ()):
        self.works, self.received = works, received
        self.sent = sent  # kept alive until the transfers finish (a send may be of a contiguous copy)

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def exchange(peers: Peers, sends: list[tuple[int, torch.Tensor]],
             receives: list[tuple[int, torch.Tensor]]) -> Pending:
    """Post ``sends`` (group rank, tensor) and ``receives`` (group rank, buffer to fill); every send needs the
    matching receive posted on its peer, in the same order between each pair of ranks."""
    sent = [t.contiguous() for _, t in sends]
    ops = [dist.P2POp(dist.isend, t, peers.global_ranks[r], peers.group) for (r, _), t in zip(sends, sent)]
    ops += [dist.P2POp(dist.irecv, t, peers.global_ranks[r], peers.group) for r, t in receives]
    for t in sent:
        TRAFFIC.sent += t.numel() * t.element_size()
        TRAFFIC.messages += 1
    for _, t in receives:
        TRAFFIC.received += t.numel() * t.element_size()
    works = dist.batch_isend_irecv(ops) if ops else []
    return Pending(works, [t for _, t in receives], sent)


def pass_along(peers: Peers, tensors: list[torch.Tensor]) -> Pending:
    """One step of the ring: send ``tensors`` to the next rank, receive their likes from the previous one
    (on one rank, the tensors themselves)."""
    if peers.world == 1:
        return Pending([], list(tensors))
    after, before = (peers.rank + 1) % peers.world, (peers.rank - 1) % peers.world
    buffers = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    return exchange(peers, [(after, t) for t in tensors], [(before, b) for b in buffers])
