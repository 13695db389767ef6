"""The dK/dV work scheduler: how the portable backward's dK/dV kernel divides a dense batch's work over programs.

Each KV tile becomes one or more work items (chunks of the Q tiles that see it), and each GQA group one or
more head splits, so that a small grid (few kv heads, or one KV tile seen by every Q tile) still fills the
SMs; split work writes float32 partials that :func:`gstar.kernels.common.partials.sum_partials` adds in a fixed
order. The plan is a host-built int32 table, derived once per pattern and tile size and cached.
"""

from __future__ import annotations

import functools

import torch

from ...pattern import Q_END, Q_FULL_END, Q_FULL_START, Q_START, Pattern, cdiv, q_block_table
from .. import card

# columns of the dK/dV work table (split_plan): the KV tile, then its Q tile ranges like q_block_table's
W_TILE, W_START, W_FULL_START, W_FULL_END, W_END = range(5)

# dK/dV splitting: programs aim at this many (Q tile, head) steps at least (a K/V load and a partial store
# must pay off), at most this many items per KV tile, and partials at most this many times dK + dV's size
_MIN_STEPS = 4
_MAX_Q_SPLITS = 16
_MAX_PARTIAL_RATIO = 8


def _auto_split(counts: list[int], group: int, programs: int, sms: int) -> tuple[int, int]:
    """``(head_splits, q_chunk)`` for a KV tile list with ``counts[t]`` Q tiles each; ``programs`` kv heads
    times batch. Aims every program at about ``1 / (2 * sms)`` of the steps (two waves), splitting the group
    first by how long a typical KV tile is, then the Q range of tiles far longer than that (a sink-token
    tile, the first tiles of a causal pattern), within a bounded partial buffer. A grid that needs no split
    to fill the card still gets two half-group programs per tile when its tiles are long-tailed (causal)."""
    longest = max(counts)
    busy = sorted(c for c in counts if c)
    steps = sum(busy) * group * programs
    if sms == 0 or steps < 2 * sms * _MIN_STEPS:  # tiny problems: the partial sum's launch would cost more
        return 1, max(1, longest)
    target = max(_MIN_STEPS, cdiv(steps, 2 * sms))
    typical = busy[len(busy) // 2]
    while True:
        heads = max(d for d in range(1, group + 1) if group % d == 0 and (d == 1 or d * typical <= target))
        q_splits = 1
        if heads * longest > 2 * target:
            q_splits = min(_MAX_Q_SPLITS, cdiv(heads * longest, target))
        chunk = cdiv(longest, q_splits)
        if heads == group and q_splits == 1:
            # causal: the longest tiles run twice the mean, and halving their programs shortens the tail; a
            # 128-key window is even and prefers whole-group programs
            if group % 2 == 0 and 2 * longest > 3 * sum(busy) / len(busy):
                return 2, longest
            return 1, longest
        items = sum(max(1, cdiv(c, chunk)) for c in counts)
        if group // heads * items <= _MAX_PARTIAL_RATIO * len(counts):
            return group // heads, chunk
        target *= 2


@functools.lru_cache(maxsize=256)
def _plan(pattern: Pattern, block_m: int, block_n: int, group: int, programs: int, sms: int, head_splits: int,
          q_chunk: int, device: str):
    ranges = q_block_table(pattern, block_m, block_n).tolist()                    # (n tiles, 4)
    counts = [r[Q_END] - r[Q_START] for r in ranges]
    auto_heads, auto_chunk = _auto_split(counts, group, programs, sms)
    head_splits, q_chunk = head_splits or auto_heads, q_chunk or auto_chunk
    if group % head_splits:
        raise ValueError(f"head_splits={head_splits} must divide the GQA group ({group})")
    items, first = [], [0]
    for tile, r in enumerate(ranges):
        start, full_start, full_end, end = r[Q_START], r[Q_FULL_START], r[Q_FULL_END], r[Q_END]
        lo = start
        while True:  # one item per chunk of q_chunk Q tiles, at least one per tile (it zeroes unseen keys)
            hi = min(end, lo + q_chunk)
            items.append((tile, lo, min(max(full_start, lo), hi), min(max(full_end, lo), hi), hi))
            lo = hi
            if lo >= end:
                break
        first.append(len(items))
    work = torch.tensor(items, dtype=torch.int32).to(device)                      # (n items, 5)
    return head_splits, work, torch.tensor(first, dtype=torch.int32).to(device)


def split_plan(pattern: Pattern, block_m: int, block_n: int, group: int, programs: int, device, *,
               head_splits: int = 0, q_chunk: int = 0) -> tuple[int, torch.Tensor, torch.Tensor]:
    """How ``_dkdv`` divides its work: ``(head_splits, work, first)``, cached per arguments.

    Each KV tile of ``block_n`` keys (seen by the Q tiles of :func:`gstar.pattern.q_block_table`) becomes
    one or more work items of at most ``q_chunk`` Q tiles, and each GQA group of ``group`` query heads
    ``head_splits`` slices; ``programs`` is kv heads times batch. ``work``: int32 ``(n items, 5)`` on
    ``device`` (columns ``W_TILE, W_START, W_FULL_START, W_FULL_END, W_END``); ``first``: int32
    ``(n tiles + 1,)``, tile ``t``'s items are ``first[t] .. first[t + 1] - 1``. Zero arguments are chosen
    from the device's SM count (never split on CPU); one item per tile and one split means no partials.
    """
    return _plan(pattern, block_m, block_n, group, programs, card.sm_count(str(device)), head_splits, q_chunk,
                 str(device))


