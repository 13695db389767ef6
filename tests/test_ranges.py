"""The rule and the block walk inside the kernels (gstar.kernels.common.rule and .walk) against their
specification in gstar.pattern."""

import itertools
import random

import pytest
import torch
import triton
import triton.language as tl

from gstar.kernels.common.rule import mask, rule, sequence_bounds, visible
from gstar.kernels.common.walk import block_at, kv_blocks, q_tiles, steps
from gstar.pattern import Pattern, kv_block_table, q_block_table

LENGTHS = [(1, 1), (1, 17), (17, 1), (17, 17), (33, 64), (64, 33), (70, 130), (113, 127)]
WINDOWS = [(-1, -1), (-1, 0), (0, 0), (3, 0), (5, 2), (16, 16), (31, 0), (200, 0), (-1, 3), (7, -1)]
SINKS = [0, 1, 4, 20]
CHUNKS = [5, 16, 40]  # with a subset of the windows and sink tokens: chunks narrower and wider than a tile


def _table_patterns():
    """Every combination of the lengths, windows and sink tokens above, then the chunks with fewer of them."""
    for (nq, nk), window, s in itertools.product(LENGTHS, WINDOWS, SINKS):
        yield Pattern.make(nq, nk, window=window, sink_tokens=s)
    for (nq, nk), window, s, c in itertools.product(LENGTHS, WINDOWS[:5], [0, 4], CHUNKS):
        yield Pattern.make(nq, nk, window=window, sink_tokens=s, chunk=c)


@triton.jit
def _mask_kernel(Mask, Spans, nq, nk, left, right, sink_tokens, chunk, ROWS: tl.constexpr, COLS: tl.constexpr,
                 MASK: tl.constexpr):
    """Mask: (ROWS, COLS) int8, written with the Triton rule for every (row, key) pair (Spans: None or (nk, 2))."""
    rows = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, COLS)[None, :]
    ok = visible(rule(nq, nk, left, right, sink_tokens, chunk, Spans, MASK), rows, cols)
    tl.store(Mask + rows * COLS + cols, ok.to(tl.int8))


def _random_patterns(n, seed=0):
    """``n`` patterns as a kernel gets them: odd and unequal lengths, each bound on or off (narrower and
    wider than the lengths), sink tokens inside and beyond the window, or past the keys, chunks or none."""
    rng = random.Random(seed)
    for _ in range(n):
        nq, nk = rng.randint(1, 100), rng.randint(1, 100)
        left = rng.choice([-1, 0, rng.randint(1, 8), rng.randint(1, 120)])
        right = rng.choice([-1, 0, rng.randint(1, 8), rng.randint(1, 120)])
        sink_tokens = rng.choice([0, 1, rng.randint(1, 20), rng.randint(1, 130)])
        chunk = rng.choice([0, 0, 1, rng.randint(2, 12), rng.randint(13, 120)])
        yield Pattern.make(nq, nk, window=(left, right), sink_tokens=sink_tokens, chunk=chunk)


def test_kernel_rule_equals_the_pattern_rule(device):
    """The Triton rule (gstar.kernels.common.rule.visible) against Pattern.visible, pair by pair, for every row
    of the sequence and for keys up to 28 past its end (which must stay hidden), without and with spans."""
    from gstar.pattern import span_bounds
    rows, cols = 128, 128
    rng = random.Random(2)
    for p in _random_patterns(300):
        for spans in (None, span_bounds(_random_span_ids(p.nk, rng))):
            got = torch.full((rows, cols), -1, dtype=torch.int8, device=device)
            _mask_kernel[(1,)](got, None if spans is None else spans.to(device), p.nq, p.nk, p.left, p.right,
                               p.sink_tokens, p.chunk, ROWS=rows, COLS=cols, MASK=mask(p, spans is not None))
            want = p.visible(torch.arange(p.nq)[:, None], torch.arange(cols)[None, :], spans=spans)
            assert torch.equal(got[:p.nq].bool().cpu(), want), (p, spans)


@triton.jit
def _ranges_kernel(KV, QT, Walk, nq, nk, left, right, sink_tokens, chunk, n_q_tiles, n_kv_tiles, max_steps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """KV: (n_q_tiles, 5) and QT: (n_kv_tiles, 4) int32, written with every tile's blocks and Q tiles; Walk:
    (n_q_tiles, 3 + max_steps) int32, each Q tile's walk by step: its step bounds, then the block of each step."""
    r = rule(nq, nk, left, right, sink_tokens, chunk, None, MASK)
    for t in range(0, n_q_tiles):
        b = kv_blocks(r, t * BLOCK_M, BLOCK_M, BLOCK_N)
        tl.store(KV + t * 5, b.sink_end)
        tl.store(KV + t * 5 + 1, b.band_start)
        tl.store(KV + t * 5 + 2, b.full_start)
        tl.store(KV + t * 5 + 3, b.full_end)
        tl.store(KV + t * 5 + 4, b.band_end)
        lead_end, full_end, n = steps(b)
        row = Walk + t * (3 + max_steps)
        tl.store(row, lead_end)
        tl.store(row + 1, full_end)
        tl.store(row + 2, n)
        for i in range(0, n):
            tl.store(row + 3 + i, block_at(b, i))
    for t in range(0, n_kv_tiles):
        q = q_tiles(r, t * BLOCK_N, BLOCK_M, BLOCK_N)
        tl.store(QT + t * 4, q.start)
        tl.store(QT + t * 4 + 1, q.full_start)
        tl.store(QT + t * 4 + 2, q.full_end)
        tl.store(QT + t * 4 + 3, q.end)


@pytest.mark.parametrize("bm,bn", [(16, 16), pytest.param(16, 32, marks=pytest.mark.slow),
                                   pytest.param(32, 16, marks=pytest.mark.slow)])
def test_kernel_ranges_equal_the_pattern_tables(bm, bn, device):
    for p in _table_patterns():
        nq, nk = p.nq, p.nk
        kv = torch.full((triton.cdiv(nq, bm), 5), -7, dtype=torch.int32, device=device)
        qt = torch.full((triton.cdiv(nk, bn), 4), -7, dtype=torch.int32, device=device)
        most = triton.cdiv(nk, bn)
        walk = torch.full((kv.shape[0], 3 + most), -7, dtype=torch.int32, device=device)
        _ranges_kernel[(1,)](kv, qt, walk, nq, nk, p.left, p.right, p.sink_tokens, p.chunk, kv.shape[0], qt.shape[0],
                             most, BLOCK_M=bm, BLOCK_N=bn, MASK=mask(p))
        table = kv_block_table(p, bm, bn).tolist()
        assert kv.tolist() == table, (p, bm, bn)
        assert qt.tolist() == q_block_table(p, bm, bn).tolist(), (p, bm, bn)
        for t, (sink_end, band_start, full_start, full_end, band_end) in enumerate(table):
            # the walk by step: the sink-token blocks, then the band, each once; the interior's steps unmasked
            blocks = list(range(sink_end)) + list(range(band_start, band_end))
            lead = sink_end - band_start
            assert walk[t, :3].tolist() == [lead + full_start, lead + full_end, len(blocks)], (p, t)
            assert walk[t, 3:3 + len(blocks)].tolist() == blocks, (p, t)


@triton.jit
def _bounds_kernel(Cu, Out, n, VARLEN: tl.constexpr):
    seq = tl.program_id(0)
    start, length = sequence_bounds(Cu, seq, n, VARLEN)
    tl.store(Out + seq * 2, start)
    tl.store(Out + seq * 2 + 1, length)


@pytest.mark.parametrize("varlen", [True, False])
def test_sequence_bounds(varlen, device):
    cu = torch.tensor([0, 3, 3, 10], dtype=torch.int32, device=device)
    out = torch.full((3, 2), -1, dtype=torch.int32, device=device)
    _bounds_kernel[(3,)](cu, out, 5, VARLEN=varlen)
    expected = [[0, 3], [3, 0], [3, 7]] if varlen else [[0, 5]] * 3
    assert out.tolist() == expected


@triton.jit
def _span_walk_kernel(Spans, KV, QT, nq, nk, left, right, sink_tokens, chunk, n_q_tiles, n_kv_tiles,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    """KV (n_q_tiles, 5) and QT (n_kv_tiles, 4) int32: the in-kernel walks under the span bounds Spans (nk, 2)."""
    r = rule(nq, nk, left, right, sink_tokens, chunk, Spans, MASK)
    for t in range(0, n_q_tiles):
        b = kv_blocks(r, t * BLOCK_M, BLOCK_M, BLOCK_N)
        tl.store(KV + t * 5, b.sink_end)
        tl.store(KV + t * 5 + 1, b.band_start)
        tl.store(KV + t * 5 + 2, b.full_start)
        tl.store(KV + t * 5 + 3, b.full_end)
        tl.store(KV + t * 5 + 4, b.band_end)
    for t in range(0, n_kv_tiles):
        q = q_tiles(r, t * BLOCK_N, BLOCK_M, BLOCK_N)
        tl.store(QT + t * 4, q.start)
        tl.store(QT + t * 4 + 1, q.full_start)
        tl.store(QT + t * 4 + 2, q.full_end)
        tl.store(QT + t * 4 + 3, q.end)


def _random_span_ids(n, rng):
    """Span ids for ``n`` keys: runs of random lengths, some in no span, neighbouring spans with other ids."""
    ids, pos, next_id = [], 0, 1
    while pos < n:
        run = rng.randint(1, 24)
        inside = rng.random() < 0.5
        ids += [next_id if inside else 0] * run
        next_id += inside
        pos += run
    return torch.tensor(ids[:n])


def test_kernel_walks_cover_spans(device):
    """With spans the kernels' block walks are data: each Q tile visits every block holding a key one of its rows
    sees, none twice, and skips the mask only on blocks every row sees whole; each KV block's Q tiles likewise
    (brute force over the rule with spans, Pattern.visible)."""
    from gstar.pattern import span_bounds
    rng = random.Random(1)
    bm, bn = 16, 16
    for p in _random_patterns(60, seed=3):
        spans = span_bounds(_random_span_ids(p.nk, rng))                                # (nk, 2)
        kv = torch.full((triton.cdiv(p.nq, bm), 5), -7, dtype=torch.int32, device=device)
        qt = torch.full((triton.cdiv(p.nk, bn), 4), -7, dtype=torch.int32, device=device)
        _span_walk_kernel[(1,)](spans.to(device), kv, qt, p.nq, p.nk, p.left, p.right, p.sink_tokens, p.chunk,
                                kv.shape[0], qt.shape[0], BLOCK_M=bm, BLOCK_N=bn, MASK=mask(p, True))
        seen = p.visible(torch.arange(p.nq)[:, None], torch.arange(p.nk)[None, :], spans=spans)  # (nq, nk)
        for t, (sink_end, band_start, full_start, full_end, band_end) in enumerate(kv.tolist()):
            rows = seen[t * bm:(t + 1) * bm]
            needed = {j // bn for j in range(p.nk) if rows[:, j].any()}
            visited = list(range(sink_end)) + list(range(band_start, band_end))
            assert len(set(visited)) == len(visited) and needed <= set(visited), (p, t)
            for b in range(full_start, full_end):
                assert rows[:, b * bn:(b + 1) * bn].all() and (b + 1) * bn <= p.nk, (p, t, b)
        for b, (start, full_start, full_end, end) in enumerate(qt.tolist()):
            cols = seen[:, b * bn:(b + 1) * bn]
            needed = {i // bm for i in range(p.nq) if cols[i].any()}
            assert needed <= set(range(start, end)), (p, b)
            for t in range(full_start, full_end):
                assert cols[t * bm:(t + 1) * bm].all() and cols.shape[1] == bn, (p, b, t)
