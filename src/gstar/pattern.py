"""The visibility rule of docs/design.md section 1, and the tile ranges it implies.

Every implementation in gstar (the naive oracle, the tiled PyTorch path, the Triton kernels) asks this
module which keys a query sees. The rule, with ``p(i) = i + (Nk - Nq)`` (bottom-right alignment)::

    visible(i, j) =  [right < 0  or  j <= p(i) + right]
                 and [left  < 0  or  j >= p(i) - left  or  j < sink_tokens]
                 and [chunk = 0  or  p(i) >= 0  and  j < end(p(i))  and  (j >= start(p(i))  or  j < sink_tokens)]

with ``start(p) = p // chunk * chunk`` and ``end(p) = start(p) + chunk``: the query's own chunk of keys. Spans
(bidirectional runs of positions, :func:`span_bounds`) lift the right bound: its condition becomes
``j <= p(i) + right  or  span(p(i)) contains j``. They are data of each sequence, not fields of the pattern, so
the block walks of the kernels widen their bands by them on the device.

``causal=True`` is ``right = 0``. Drawn for Nq = 4, Nk = 6 (offset 2), window (2, 0), one sink token::

         keys j ->  0 1 2 3 4 5
    i=0 (p=2)       1 1 1 . . .
    i=1 (p=3)       1 1 1 1 . .
    i=2 (p=4)       1 . 1 1 1 .
    i=3 (p=5)       1 . . 1 1 1

The kernels never evaluate this rule over whole tiles they do not need: the host asks
:func:`kv_block_table` which KV blocks each Q tile visits (and :func:`q_block_table`, for the backward,
which Q tiles each KV block is seen by). Each table splits the visited range into masked boundary
blocks and an unmasked interior, so masks are applied only where the rule cuts through a tile.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch


# Learned sink logits count as clamped to [-SINK_LIMIT, SINK_LIMIT] (docs/design.md section 1): +inf takes every
# row's whole weight (output 0, LSE SINK_LIMIT), -inf adds nothing, and no gradient reaches a clamped sink. No score
# a float type holds competes with exp(+-2^64), so the clamp changes no finite sink's result.
SINK_LIMIT = 2.0 ** 64


def capped_sinks(sinks: torch.Tensor) -> torch.Tensor:
    """The learned sinks as every implementation takes them: clamped to [-SINK_LIMIT, SINK_LIMIT]."""
    return sinks.clamp(-SINK_LIMIT, SINK_LIMIT)


def sink_gradient(sinks: torch.Tensor, dsinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the given sinks from one taken at the clamped sinks: none reaches a clamped sink."""
    return torch.where(sinks.abs() > SINK_LIMIT, 0.0, dsinks)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for b > 0, in plain Python (``triton.cdiv`` is a constexpr function, ~1.5 us a host call)."""
    return -(-a // b)


@dataclass(frozen=True)
class Pattern:
    """A normalised attention pattern: lengths plus the window bounds (``-1`` = unbounded) and the chunk
    (Llama 4's chunked attention, ``0`` = none: a query sees only keys of its own chunk of ``chunk``
    positions, both bounds of which are left and right bounds like the window's).

    Build it with :meth:`Pattern.make`, which applies the normalisations of docs/design.md section 1
    (``causal`` forces ``right = 0``; a left bound of ``Nk - 1`` or more hides no key and is dropped, so a window as
    wide as the keys runs as causal attention; sink tokens only matter under a left bound).
    """

    nq: int
    nk: int
    left: int = -1
    right: int = -1
    sink_tokens: int = 0
    chunk: int = 0

    @staticmethod
    def make(nq: int, nk: int, *, causal: bool = False, window: tuple[int, int] = (-1, -1),
             sink_tokens: int = 0, chunk: int = 0) -> "Pattern":
        left, right = window
        if causal:
            right = 0
        if left >= nk - 1:  # the latest query, p = Nk - 1, sees key 0: the bound hides no key of any row
            left = -1
        if left < 0 and chunk == 0:
            sink_tokens = 0  # without a left bound every key below p(i) + right is visible anyway
        return Pattern(nq, nk, left, right, min(sink_tokens, nk), chunk)

    def fields(self) -> tuple[int, ...]:
        """The pattern as plain ints, in field order: how operator schemas carry it (:meth:`from_fields`)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self))  # (astuple would copy SymInts)

    @staticmethod
    def from_fields(fields) -> "Pattern":
        """The pattern whose :meth:`fields` these are."""
        return Pattern(*fields)

    def resized(self, nq: int, nk: int) -> "Pattern":
        """The same rule over ``nq`` queries and ``nk`` keys (one packed sequence of a batch's longest)."""
        return Pattern.make(nq, nk, window=(self.left, self.right), sink_tokens=self.sink_tokens, chunk=self.chunk)

    def at(self, nk: int) -> "Pattern":
        """The same rule over ``nk`` keys (a decode step's sequences share every field but their length)."""
        return self.resized(self.nq, nk)

    @property
    def offset(self) -> int:
        """p(i) - i: how far query row i sits after the start of the keys."""
        return self.nk - self.nq

    def visible(self, rows, cols, nk=None, spans=None):
        """The rule itself; ``rows`` and ``cols`` are ints or broadcastable integer tensors. ``nk`` (default
        ``self.nk``) may be a tensor too: the key counts of sequences that share every other field (a decode
        batch whose caches hold different lengths). ``spans``: the :func:`span_bounds` of the keys, ``(..., Nk,
        2)``, with ``rows`` an ``(R, 1)`` and ``cols`` a ``(1, C)`` tensor: the result is ``(..., R, C)``, each
        position's span lifting the right bound (the left bounds still apply)."""
        nk = self.nk if nk is None else nk
        pos = rows + nk - self.nq
        ok = (rows >= 0) & (rows < self.nq) & (cols >= 0) & (cols < nk)
        if self.right >= 0 or spans is not None:
            near = cols <= pos + self.right if self.right >= 0 else cols >= 0
            if spans is not None:  # the span of p(i) escapes the right bound
                near = near | in_span(spans, pos, cols)
            ok = ok & near
        if self.left >= 0:
            ok = ok & ((cols >= pos - self.left) | (cols < self.sink_tokens))
        if self.chunk > 0:  # the query's own chunk (a row before the keys, p(i) < 0, has none)
            start = pos // self.chunk * self.chunk
            ok = ok & (pos >= 0) & (cols < start + self.chunk) & ((cols >= start) | (cols < self.sink_tokens))
        return ok

    def mask(self, device=None, nk=None, spans=None) -> torch.Tensor:
        """The full ``(Nq, Nk)`` boolean mask (for oracles and tests only: it is quadratic); ``nk`` as in
        :meth:`visible` (a ``(B, 1, 1, 1)`` tensor of key counts gives ``(B, 1, Nq, Nk)``); ``spans`` (B, Nk, 2)
        gives ``(B, Nq, Nk)``."""
        rows = torch.arange(self.nq, device=device)[:, None]
        cols = torch.arange(self.nk, device=device)[None, :]
        return self.visible(rows, cols, nk, spans)

    def visible_pairs(self) -> int:
        """The number of visible (i, j) pairs, counted per row in O(Nq) (for FLOP counts)."""
        total = 0
        for i in range(self.nq):
            lo, hi = self.key_range(i, i + 1)
            total += max(0, hi - lo) + max(0, min(self.sink_tokens, lo, hi))
        return total

    def visible_keys(self) -> int:
        """The number of keys some query sees: the band of all rows and the sink tokens below it (the keys a
        decode step must read; ``nk`` when ``nq == nk``)."""
        lo, hi = self.key_range(0, self.nq)
        return max(0, hi - lo) + max(0, min(self.sink_tokens, lo, hi))

    def key_range(self, row_start: int, row_end: int) -> tuple[int, int]:
        """Keys ``[lo, hi)`` that the window band of rows ``[row_start, row_end)`` reaches (sinks excluded)."""
        pmin, pmax = row_start + self.offset, row_end - 1 + self.offset
        lo = max(0, pmin - self.left) if self.left >= 0 else 0
        hi = min(self.nk, pmax + self.right + 1) if self.right >= 0 else self.nk
        if self.chunk > 0:  # the chunks of the first and the last row
            lo, hi = max(lo, self.chunk_start(pmin)), min(hi, self.chunk_start(pmax) + self.chunk)
        return min(lo, self.nk), max(hi, 0)

    def chunk_start(self, pos: int) -> int:
        """The first position of the chunk holding position ``pos`` (floored: a negative position's chunk lies
        before the keys)."""
        return pos // self.chunk * self.chunk

    @property
    def has_left(self) -> bool:
        """Whether some bound hides keys on the left (a window's, or the chunk's start): sink tokens escape it."""
        return self.left >= 0 or self.chunk > 0


def span_bounds(span_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Each position's span as ``[start, end)``, int32 ``(..., N, 2)``, from span ids per position ``(..., N)``
    (``(total,)`` packed with ``cu_seqlens``: positions count from each sequence's start, no span crosses a
    sequence's end). A span is a maximal run of consecutive positions holding one nonzero id; a position of id 0
    is in none and gets the empty ``[p, p)``. On the device, nothing read on the host."""
    ids = span_ids.long()
    n = ids.shape[-1]
    pos = torch.arange(n, device=ids.device).expand_as(ids)                          # (..., N)
    first = torch.ones((*ids.shape[:-1], n + 1), dtype=torch.bool, device=ids.device)  # a run starts here
    first[..., 1:n] = ids[..., 1:] != ids[..., :-1]
    seq_start = torch.zeros_like(ids)
    if cu_seqlens is not None:  # runs also start with each sequence (the extra slot takes empty ones at the end)
        first[cu_seqlens[:-1].long()] = True
        seq_start = cu_seqlens.long()[torch.searchsorted(cu_seqlens.long(), pos, right=True) - 1]
    last = first[..., 1:]                                                          # a run ends here
    first = first[..., :n]
    start = torch.where(first, pos, 0).cummax(dim=-1).values
    end = torch.where(last, pos + 1, n).flip(-1).cummin(dim=-1).values.flip(-1)
    inside = ids != 0
    bounds = torch.stack((torch.where(inside, start, pos), torch.where(inside, end, pos)), dim=-1)  # (..., N, 2)
    return (bounds - seq_start[..., None]).to(torch.int32)


def in_span(spans: torch.Tensor, pos: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Whether key ``cols`` (1, C) lies in the span of position ``pos`` (R, 1), under the span bounds ``spans``
    (..., Nk, 2) of the keys: ``(..., R, C)``; a position outside ``[0, Nk)`` has no span."""
    nk = spans.shape[-2]
    at = spans[..., pos[:, 0].clamp(0, max(nk - 1, 0)), :]                           # (..., R, 2)
    inside = ((pos >= 0) & (pos < nk))
    return inside & (cols >= at[..., :, :1]) & (cols < at[..., :, 1:])


# Column meaning of the tables below; the kernels index them by these positions.
KV_SINK_END, KV_BAND_START, KV_FULL_START, KV_FULL_END, KV_BAND_END = range(5)
Q_START, Q_FULL_START, Q_FULL_END, Q_END = range(4)


def kv_blocks(pattern: Pattern, row_start: int, block_m: int, block_n: int) -> tuple[int, int, int, int, int]:
    """KV blocks (of ``block_n`` keys) that the Q tile starting at ``row_start`` must visit.

    Returns ``(sink_end, band_start, full_start, full_end, band_end)``: blocks ``[0, sink_end)`` hold sink
    tokens outside the band (masked), ``[band_start, band_end)`` is the window band, of which
    ``[full_start, full_end)`` is fully visible to every row of the tile (no mask needed) and the rest are
    boundary blocks (masked). ``sink_end <= band_start`` so that no block is visited twice.
    """
    p = pattern
    row_end = min(row_start + block_m, p.nq)
    lo, hi = p.key_range(row_start, row_end)
    sink_hi = min(p.sink_tokens, hi)  # sink keys still obey the right bound
    if hi <= lo:
        end = cdiv(max(sink_hi, 0), block_n)
        return end, end, end, end, end
    band_start, band_end = lo // block_n, cdiv(hi, block_n)
    sink_end = min(cdiv(max(sink_hi, 0), block_n), band_start)
    pmin, pmax = row_start + p.offset, row_end - 1 + p.offset
    full_start = max(band_start, cdiv(pmax - p.left, block_n) if p.left >= 0 else 0)
    full_end = min(band_end, p.nk // block_n)
    if p.right >= 0:
        full_end = min(full_end, (pmin + p.right + 1) // block_n)
    if p.chunk > 0:  # keys every row's chunk holds: from the last row's chunk start to the first row's chunk end
        full_start = max(full_start, cdiv(p.chunk_start(pmax), block_n))
        full_end = min(full_end, (p.chunk_start(pmin) + p.chunk) // block_n)
    if full_end <= full_start:
        full_start = full_end = band_end
    return sink_end, band_start, full_start, full_end, band_end


def q_blocks(pattern: Pattern, key_start: int, block_m: int, block_n: int) -> tuple[int, int, int, int]:
    """Q tiles (of ``block_m`` rows) that see some key of the KV block starting at ``key_start``.

    Returns ``(start, full_start, full_end, end)``: tiles ``[start, end)`` are visited, and in
    ``[full_start, full_end)`` every row sees every key of the block (no mask needed).
    """
    p = pattern
    key_end = min(key_start + block_n, p.nk)
    off = p.offset
    rmin = max(0, key_start - p.right - off) if p.right >= 0 else 0  # first row whose right bound reaches
    rmax = p.nq
    if key_start >= p.sink_tokens:  # a sink key escapes every left bound: every later row sees it
        if p.left >= 0:
            rmax = min(rmax, key_end - 1 + p.left - off + 1)
        if p.chunk > 0:  # rows past the chunk of the block's last key
            rmax = min(rmax, p.chunk_start(key_end - 1) + p.chunk - off)
    if p.chunk > 0:  # rows before the chunk of the block's first key
        rmin = max(rmin, p.chunk_start(key_start) - off)
    if rmax <= rmin:
        return 0, 0, 0, 0
    start, end = rmin // block_m, cdiv(rmax, block_m)
    full_start = start
    if p.right >= 0:
        full_start = max(start, cdiv(key_end - 1 - p.right - off, block_m))
    full_end = min(end, p.nq // block_m)
    if p.chunk > 0:  # rows whose chunk ends past the block
        full_start = max(full_start, cdiv(p.chunk_start(key_end - 1) - off, block_m))
    if p.has_left and key_end > p.sink_tokens:
        first_plain_key = max(key_start, p.sink_tokens)  # smallest key that needs the left bounds
        if p.left >= 0:
            full_end = min(full_end, (first_plain_key + p.left - off + 1) // block_m)
        if p.chunk > 0:  # rows whose chunk starts at or before it
            full_end = min(full_end, max(p.chunk_start(first_plain_key) + p.chunk - off, 0) // block_m)
    if key_end - key_start < block_n or full_end <= full_start:
        full_start = full_end = end
    return start, full_start, full_end, end


def read_blocks(pattern: Pattern, block_size: int) -> list[int]:
    """Blocks of ``block_size`` keys (indices along the sequence) holding keys some query of ``pattern`` sees:
    the sink-token blocks and the window's band (the pages a decode step reads)."""
    sink_end, band_start, _, _, band_end = kv_blocks(pattern, 0, max(pattern.nq, 1), block_size)
    return list(range(sink_end)) + list(range(band_start, band_end))


@functools.lru_cache(maxsize=256)
def _tables(pattern: Pattern, block_m: int, block_n: int, device: str, kind: str) -> torch.Tensor:
    if kind == "kv":
        rows = [kv_blocks(pattern, s, block_m, block_n) for s in range(0, pattern.nq, block_m)]
    else:
        rows = [q_blocks(pattern, s, block_m, block_n) for s in range(0, pattern.nk, block_n)]
    width = 5 if kind == "kv" else 4
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, width).to(device)


def kv_block_table(pattern: Pattern, block_m: int, block_n: int, device="cpu") -> torch.Tensor:
    """:func:`kv_blocks` for every Q tile: int32 ``(cdiv(Nq, block_m), 5)``, cached per pattern and tiles."""
    return _tables(pattern, block_m, block_n, str(device), "kv")


def q_block_table(pattern: Pattern, block_m: int, block_n: int, device="cpu") -> torch.Tensor:
    """:func:`q_blocks` for every KV block: int32 ``(cdiv(Nk, block_n), 4)``, cached per pattern and tiles."""
    return _tables(pattern, block_m, block_n, str(device), "q")
