"""gstar.pattern against the brute-force predicate: nothing visible skipped, nothing fully masked visited."""

import itertools

import pytest
import torch

from gstar.pattern import Pattern, kv_block_table, q_block_table

LENGTHS = [(1, 1), (1, 17), (17, 1), (17, 17), (33, 64), (64, 33), (70, 130), (113, 127), (128, 128)]
WINDOWS = [(-1, -1), (-1, 0), (0, 0), (3, 0), (5, 2), (16, 16), (31, 0), (64, 0), (200, 0), (-1, 3), (7, -1)]
SINKS = [0, 1, 4, 20]
CHUNKS = [0, 1, 5, 16, 40]
TILES = [(16, 16), (16, 32), (32, 16), (64, 64)]


def _cases():
    for (nq, nk), window, s, (bm, bn) in itertools.product(LENGTHS, WINDOWS, SINKS, TILES):
        yield Pattern.make(nq, nk, window=window, sink_tokens=s), bm, bn


def _tile(mask, r0, bm, c0, bn):
    return mask[r0:r0 + bm, c0:c0 + bn]


@pytest.mark.parametrize("bm,bn", TILES)
def test_kv_table_covers_exactly_the_visible_blocks(bm, bn):
    for (nq, nk), window, s, chunk in itertools.product(LENGTHS, WINDOWS, SINKS, CHUNKS):
        p = Pattern.make(nq, nk, window=window, sink_tokens=s, chunk=chunk)
        mask = p.mask()
        table = kv_block_table(p, bm, bn).tolist()
        assert len(table) == -(-nq // bm)
        for t, (sink_end, band_start, full_start, full_end, band_end) in enumerate(table):
            assert 0 <= sink_end <= band_start <= full_start <= full_end <= band_end <= -(-nk // bn)
            visited = set(range(sink_end)) | set(range(band_start, band_end))
            for b in range(-(-nk // bn)):
                tile = _tile(mask, t * bm, bm, b * bn, bn)
                assert bool(tile.any()) == (b in visited), (p, bm, bn, t, b)
                if full_start <= b < full_end:  # rows past Nq are never stored, so only keys must be whole
                    assert tile.shape[1] == bn and bool(tile.all()), (p, bm, bn, t, b)


@pytest.mark.parametrize("bm,bn", TILES)
def test_q_table_covers_exactly_the_visible_blocks(bm, bn):
    for (nq, nk), window, s, chunk in itertools.product(LENGTHS, WINDOWS, SINKS, CHUNKS):
        p = Pattern.make(nq, nk, window=window, sink_tokens=s, chunk=chunk)
        mask = p.mask()
        table = q_block_table(p, bm, bn).tolist()
        assert len(table) == -(-nk // bn)
        for b, (start, full_start, full_end, end) in enumerate(table):
            assert 0 <= start <= full_start <= full_end <= end <= -(-nq // bm)
            for t in range(-(-nq // bm)):
                tile = _tile(mask, t * bm, bm, b * bn, bn)
                assert bool(tile.any()) == (start <= t < end), (p, bm, bn, b, t)
                if full_start <= t < full_end:
                    assert tile.shape == (bm, bn) and bool(tile.all()), (p, bm, bn, b, t)


def test_interior_is_used_for_plain_causal():
    p = Pattern.make(256, 256, causal=True)
    table = kv_block_table(p, 64, 64).tolist()
    # the last Q tile sees three full blocks and masks only its diagonal block
    assert table[-1] == [0, 0, 0, 3, 4]


def test_visible_pairs_matches_mask():
    for (nq, nk), window, s, chunk in itertools.product(LENGTHS, WINDOWS, SINKS, CHUNKS):
        p = Pattern.make(nq, nk, window=window, sink_tokens=s, chunk=chunk)
        assert p.visible_pairs() == int(p.mask().sum())


def test_normalisation():
    assert Pattern.make(8, 8, causal=True, window=(3, 5)).right == 0
    assert Pattern.make(8, 8, window=(-1, 0), sink_tokens=4).sink_tokens == 0
    assert Pattern.make(8, 4, window=(2, 0), sink_tokens=9).sink_tokens == 4
    p = Pattern.make(4, 6, window=(2, 0), sink_tokens=1)
    expected = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1]])
    assert torch.equal(p.mask().int(), expected)


def test_left_bound_past_every_key_is_dropped():
    """A left bound of Nk - 1 or more hides no key: Pattern.make drops it (and sink tokens with it, when no chunk
    needs them), and the rule of the pattern as given, built without normalising, sees the same keys."""
    for (nq, nk), right, s, chunk in itertools.product([(8, 8), (3, 9), (9, 3), (1, 5)], (-1, 0, 2), (0, 2), (0, 3)):
        for left in (nk - 2, nk - 1, nk, nk + 40):
            if left < 0:
                continue
            made = Pattern.make(nq, nk, window=(left, right), sink_tokens=s, chunk=chunk)
            raw = Pattern(nq, nk, left, right, min(s, nk), chunk)
            assert torch.equal(made.mask(), raw.mask()), (nq, nk, left, right, s, chunk)
            assert (made.left < 0) == (left >= nk - 1)


def test_chunk_rule():
    """Llama 4's chunks (a query sees the keys of its own chunk of positions, counted from key 0), with causality,
    a window and sink tokens, drawn: Nq = 6, Nk = 8 (p(i) = i + 2), chunk 3, causal, one sink token."""
    p = Pattern.make(6, 8, causal=True, sink_tokens=1, chunk=3)
    expected = torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0],   # p = 2: chunk 0
                             [1, 0, 0, 1, 0, 0, 0, 0],   # p = 3: chunk 1, the sink token beside it
                             [1, 0, 0, 1, 1, 0, 0, 0],
                             [1, 0, 0, 1, 1, 1, 0, 0],
                             [1, 0, 0, 0, 0, 0, 1, 0],   # p = 6: chunk 2
                             [1, 0, 0, 0, 0, 0, 1, 1]])
    assert torch.equal(p.mask().int(), expected)
    assert not Pattern.make(4, 2, chunk=2).mask()[:2].any()  # rows before the keys (p(i) < 0) see nothing
    assert Pattern.make(8, 8, chunk=4, sink_tokens=2).sink_tokens == 2  # the chunk is a left bound
