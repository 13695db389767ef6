"""StreamingLLM decoding in constant memory: a paged key/value cache that keeps a sequence's first ``S`` tokens
(the sink tokens) and its last ``W``, for every layer of a model.

The pattern is causal with ``window=(W - 1, 0)`` and ``sink_tokens=S``: a query sees the S sink tokens, itself
and the W - 1 tokens before it. :func:`gstar.flash_attention_with_kvcache` reads only the pages of the blocks
some query sees (the sink-token blocks and the window's band), so a page whose block has left the band goes
back to a free list and holds a block the band reaches later.

Positions. The kernel places a sequence's keys by its length (``cache_seqlens``) and maps block ``j`` (keys
``[j bs, (j + 1) bs)``) to page ``block_table[b, j]``: a table indexed by absolute block would grow with the
generated length. The cache rebases instead: when the band would run past the table, it moves the band's
entries down to follow the sink-token blocks and lowers the length by the same whole number of blocks. The
rule sees the same keys after the move: the sink tokens keep positions ``[0, S)``, the band's keys keep their
distance to the queries, and the keys in between (the rest of the last sink-token block, the start of the
band's first block) lie outside the window before and after. Drawn for S = 3, W = 40, bs = 16, one sequence
at the token q = 90 (a character: two keys; w: the keys q sees in its window)::

    block      0        1        2        3        4        5
    keys      [SS......|........|........|.wwwwwww|wwwwwwww|wwwwwq..]
    table     [   p0   |   -1   |   -1   |   p2   |   p4   ]            the band, blocks 3..5, passes the end:
    table     [   p0   |   p2   |   p4   |   p1   |   -1   ]            moved 2 blocks down, q at 90 - 32

So the table is as wide as the blocks one step can see, and pages, table and lengths stay the same size
however long the sequences grow. Positions for rotary embeddings are the model's own: :meth:`StreamingCache.step`
returns the absolute position of the step's first token.
"""

from __future__ import annotations

import torch

from .kvcache import PAGE_MULTIPLE, flash_attention_with_kvcache
from .pattern import Pattern, cdiv, kv_blocks


def _count(name: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


class StreamingCache:
    """The key/value pages of ``layers`` layers for ``batch`` sequences that advance together.

    One object serves every layer: the layers of a step append at the same positions, so they share one
    block table, one length per sequence, one free list and one rebase, and each layer has its own pages at
    the same page indices (``k`` is ``(layers, pages, block_size, kv_heads, head_dim)``).

    A decode loop::

        start = cache.step(n)                 # room for n new tokens per sequence, at absolute start..start+n-1
        for layer in range(layers):
            out = cache.attend(layer, q, k, v, sinks=...)   # appends k, v (B, Hkv, n, D); q (B, Hq, n, D)

    Args:
        layers, batch, kv_heads, head_dim: the model's; ``value_dim`` defaults to ``head_dim``.
        sink_tokens: S, the first tokens every query sees (0: a plain sliding window).
        window: W >= 1, the tokens a query sees at the end of its sequence, itself included.
        block_size: keys per page, a multiple of 16.
        max_new: the most tokens one step appends (a prompt chunk); the pages are sized for it.
        dtype, device: of the pages.

    The pages number ``batch * width``, ``width = cdiv(S, bs) + cdiv(W + max_new - 2, bs) + 1`` (the blocks
    one step can see); every tensor is allocated here and updated in place, so a captured CUDA graph of the
    ``attend`` calls replays after each :meth:`step`.
    """

    def __init__(self, *, layers: int, batch: int, kv_heads: int, head_dim: int, value_dim: int | None = None,
                 sink_tokens: int, window: int, block_size: int = 16, max_new: int = 1,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        for name, value, low in (("layers", layers, 1), ("batch", batch, 1), ("kv_heads", kv_heads, 1),
                                 ("head_dim", head_dim, 1), ("sink_tokens", sink_tokens, 0),
                                 ("window", window, 1), ("max_new", max_new, 1)):
            _count(name, value, low)
        value_dim = head_dim if value_dim is None else _count("value_dim", value_dim, 1)
        if _count("block_size", block_size, 1) % PAGE_MULTIPLE:
            raise ValueError(f"block_size must be a multiple of {PAGE_MULTIPLE}, got {block_size}")
        self.rule = dict(causal=True, window=(window - 1, 0), sink_tokens=sink_tokens)
        self.batch, self.block_size, self.max_new = batch, block_size, max_new
        self.sink_blocks = cdiv(sink_tokens, block_size)
        self.width = self.sink_blocks + cdiv(window + max_new - 2, block_size) + 1
        self.pages = batch * self.width
        pool = (layers, self.pages, block_size, kv_heads)
        self.k = torch.zeros(*pool, head_dim, dtype=dtype, device=device)       # (L, pages, bs, Hkv, D)
        self.v = torch.zeros(*pool, value_dim, dtype=dtype, device=device)      # (L, pages, bs, Hkv, Dv)
        self.block_table = torch.full((batch, self.width), -1, dtype=torch.int32, device=device)  # (B, width)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=device)  # (B,) keys before the step's
        self._table = torch.full((batch, self.width), -1, dtype=torch.int32)    # (B, width) the host's copy
        self.free = list(range(self.pages))
        self.length = 0   # tokens per sequence, the current step's included
        self._shift = 0   # absolute position - kernel position of every key past the sink-token blocks
        self._new = 0     # tokens the current step appends

    @property
    def pages_in_use(self) -> int:
        return self.pages - len(self.free)

    def _blocks(self, start: int, n: int) -> tuple[int, int, int]:
        """``(sink_end, band_start, band_end)``: the blocks ``n`` queries from kernel position ``start`` see."""
        sink_end, band_start, _, _, band_end = kv_blocks(Pattern.make(n, start + n, **self.rule), 0, n,
                                                         self.block_size)
        return sink_end, band_start, band_end

    def step(self, n: int = 1) -> int:
        """Make room for ``n`` new tokens per sequence: return to the free list the pages no query of this
        step or a later one sees, rebase when the band would pass the table's end, map the blocks the new
        tokens fill, and set ``cache_seqlens``. Host work and two small copies; no device sync. Returns the
        absolute position of the first new token."""
        if not isinstance(n, int) or not 1 <= n <= self.max_new:
            raise ValueError(f"a step appends 1 to max_new = {self.max_new} tokens, got {n!r}")
        start = self.length - self._shift
        sink_end, band_start, band_end = self._blocks(start, n)
        table, changed = self._table, False
        for j in (table[0] >= 0).nonzero().flatten().tolist():
            if sink_end <= j < band_start:
                self.free.extend(table[:, j].tolist())
                table[:, j] = -1
                changed = True
        if band_end > self.width:  # the band starts past the sink-token blocks here (the width allows it)
            moved = band_start - self.sink_blocks
            kept = table[:, band_start:].clone()                               # (B, width - band_start)
            table[:, self.sink_blocks:] = -1
            table[:, self.sink_blocks:self.sink_blocks + kept.shape[1]] = kept
            self._shift += moved * self.block_size
            start -= moved * self.block_size
            sink_end, band_start, band_end = self._blocks(start, n)
        for j in [*range(sink_end), *range(band_start, band_end)]:
            if table[0, j] < 0:
                table[:, j] = torch.tensor([self.free.pop() for _ in range(self.batch)], dtype=torch.int32)
                changed = True
        if changed:  # pageable host memory: staged by the copy, so the host may edit it again at once
            self.block_table.copy_(table, non_blocking=True)
        self.cache_seqlens.fill_(start)
        absolute = self.length
        self.length += n
        self._new = n
        return absolute

    def attend(self, layer: int, q, k, v, *, sinks=None, scale=None, num_splits=None, backend="auto",
               check_values=False):
        """Append this step's keys and values of ``layer`` and attend: ``q`` ``(B, Hq, n, D)``, ``k``, ``v``
        ``(B, Hkv, n, D)`` / ``(..., Dv)``, the other arguments :func:`gstar.flash_attention_with_kvcache`'s
        (``check_values`` off: the cache keeps its table valid). Returns ``(B, Hq, n, Dv)``."""
        if q.shape[2] != self._new:
            raise ValueError(f"q holds {q.shape[2]} new tokens but the step made room for {self._new} (call "
                             f"step(n) before the layers)")
        return flash_attention_with_kvcache(q, self.k[layer], self.v[layer], k=k, v=v,
                                            cache_seqlens=self.cache_seqlens, block_table=self.block_table,
                                            sinks=sinks, scale=scale, num_splits=num_splits, backend=backend,
                                            check_values=check_values, **self.rule)
