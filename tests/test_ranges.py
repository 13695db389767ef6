"""The rule and the tile ranges inside the kernels (gstar.kernels.ranges) against their specification in
gstar.pattern."""

import itertools
import random

import pytest
import torch
import triton
import triton.language as tl

from gstar.kernels.ranges import kv_range, q_range, sequence_bounds, visible
from gstar.pattern import Pattern, kv_block_table, q_block_table

LENGTHS = [(1, 1), (1, 17), (17, 1), (17, 17), (33, 64), (64, 33), (70, 130), (113, 127)]
WINDOWS = [(-1, -1), (-1, 0), (0, 0), (3, 0), (5, 2), (16, 16), (31, 0), (200, 0), (-1, 3), (7, -1)]
SINKS = [0, 1, 4, 20]


@triton.jit
def _mask_kernel(Mask, nq, nk, left, right, sink_tokens, ROWS: tl.constexpr, COLS: tl.constexpr,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SINK_TOKENS: tl.constexpr):
    """Mask: (ROWS, COLS) int8, written with the Triton rule for every (row, key) pair."""
    rows = tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, COLS)[None, :]
    ok = visible(rows, cols, nq, nk, left, right, sink_tokens, HAS_LEFT, HAS_RIGHT, HAS_SINK_TOKENS)
    tl.store(Mask + rows * COLS + cols, ok.to(tl.int8))


def _random_patterns(n, seed=0):
    """``n`` patterns as a kernel gets them: odd and unequal lengths, each bound on or off (narrower and
    wider than the lengths), sink tokens inside and beyond the window, or past the keys."""
    rng = random.Random(seed)
    for _ in range(n):
        nq, nk = rng.randint(1, 100), rng.randint(1, 100)
        left = rng.choice([-1, 0, rng.randint(1, 8), rng.randint(1, 120)])
        right = rng.choice([-1, 0, rng.randint(1, 8), rng.randint(1, 120)])
        sink_tokens = rng.choice([0, 1, rng.randint(1, 20), rng.randint(1, 130)])
        yield Pattern(nq, nk, left, right, sink_tokens)


def test_kernel_rule_equals_the_pattern_rule(device):
    """The Triton rule (gstar.kernels.ranges.visible) against Pattern.visible, pair by pair, for every row
    of the sequence and for keys up to 28 past its end (which must stay hidden)."""
    rows, cols = 128, 128
    for p in _random_patterns(300):
        mask = torch.full((rows, cols), -1, dtype=torch.int8, device=device)
        _mask_kernel[(1,)](mask, p.nq, p.nk, p.left, p.right, p.sink_tokens, ROWS=rows, COLS=cols,
                           HAS_LEFT=p.left >= 0, HAS_RIGHT=p.right >= 0, HAS_SINK_TOKENS=p.sink_tokens > 0)
        want = p.visible(torch.arange(p.nq)[:, None], torch.arange(cols)[None, :])
        assert torch.equal(mask[:p.nq].bool().cpu(), want), p


@triton.jit
def _ranges_kernel(KV, QT, nq, nk, left, right, sink_tokens, n_q_tiles, n_kv_tiles,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """KV: (n_q_tiles, 5) and QT: (n_kv_tiles, 4) int32, written with every tile's ranges."""
    for t in range(0, n_q_tiles):
        r = kv_range(t * BLOCK_M, nq, nk, left, right, sink_tokens, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        for c in tl.static_range(5):
            tl.store(KV + t * 5 + c, r[c])
    for t in range(0, n_kv_tiles):
        r = q_range(t * BLOCK_N, nq, nk, left, right, sink_tokens, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        for c in tl.static_range(4):
            tl.store(QT + t * 4 + c, r[c])


@pytest.mark.parametrize("bm,bn", [(16, 16), pytest.param(16, 32, marks=pytest.mark.slow),
                                   pytest.param(32, 16, marks=pytest.mark.slow)])
def test_kernel_ranges_equal_the_pattern_tables(bm, bn, device):
    for (nq, nk), window, s in itertools.product(LENGTHS, WINDOWS, SINKS):
        p = Pattern.make(nq, nk, window=window, sink_tokens=s)
        kv = torch.full((triton.cdiv(nq, bm), 5), -7, dtype=torch.int32, device=device)
        qt = torch.full((triton.cdiv(nk, bn), 4), -7, dtype=torch.int32, device=device)
        _ranges_kernel[(1,)](kv, qt, nq, nk, p.left, p.right, p.sink_tokens, kv.shape[0], qt.shape[0],
                             BLOCK_M=bm, BLOCK_N=bn, HAS_LEFT=p.left >= 0, HAS_RIGHT=p.right >= 0)
        assert kv.tolist() == kv_block_table(p, bm, bn).tolist(), (p, bm, bn)
        assert qt.tolist() == q_block_table(p, bm, bn).tolist(), (p, bm, bn)


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
